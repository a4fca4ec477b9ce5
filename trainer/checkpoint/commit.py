"""The commit protocol, retention and torn-step clean-up of ``<out>/checkpoints/``.

Each rank records that its part of step N is on disk by writing ``step_N/.rank<r>.done`` (its write
results). Rank 0 commits step N once every rank's done file exists: DCP's ``.metadata``, then the
``COMMITTED`` marker through a rename. No collective is needed, so ranks never stall on each other's
disks, and a dead rank simply leaves a torn directory, which is never loaded and is deleted later.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..events import Event, EventLog
from ..durable import fsync_dir, write_bytes
from ..layout import COMMITTED, committed_steps, step_dir, step_of
from ..mirror import CheckpointMirror
from ..parallel import Dist
from .integrity import marker_fields

log = logging.getLogger(__name__)


def delete_checkpoint(path: Path) -> None:
    """Un-commit first (marker gone, fsynced), then delete: a half-deleted directory is never valid."""
    try:
        (path / COMMITTED).unlink()
        fsync_dir(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Pending:
    """A step handed to the writers and not committed yet."""

    step: int
    started: float
    writer: Any = None      # rank 0: the NVRx FileSystemWriterAsync, needed to write .metadata
    metadata: Any = None    # rank 0: the global DCP metadata from planning


class Commits:
    """The steps in flight, their commits (rank 0), and the purge of old and torn step directories.

    Args:
        root: ``<out>/checkpoints``.
        d: this process's distributed context.
        events: the run's event log.
        keep: committed checkpoints kept (``--ckpt-keep``).
        mirror: rank 0's S3 mirror (``--ckpt-mirror``), fed at every commit; None without one.
    """

    def __init__(self, root: Path, d: Dist, events: EventLog, keep: int, mirror: CheckpointMirror | None):
        self.root, self.d, self.events, self.keep, self.mirror = root, d, events, keep, mirror
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending: deque[Pending] = deque()
        self._purger: threading.Thread | None = None
        # Rank 0 commits on a thread of its own (maybe_commit_behind), the loop at its end (maybe_commit): one
        # at a time, in step order. What the thread failed with is raised on the loop at its next commit.
        self._lock = threading.RLock()
        self._committer: threading.Thread | None = None
        self._failed: BaseException | None = None

    def add(self, p: Pending) -> None:
        with self._lock:   # the writer's hand-over thread adds, the committer thread commits
            self.pending.append(p)

    def record_done(self, step: int, results: Any, checksums: dict[str, str]) -> None:
        """This rank's part of ``step`` is on disk: the checksums of what it staged, then its write results,
        durably (the done file is what the commit waits for)."""
        self.record_checksums(step, checksums)
        write_bytes(step_dir(self.root, step) / f".rank{self.d.rank}.done", pickle.dumps(results))

    def record_checksums(self, step: int, checksums: dict[str, str]) -> None:
        """This rank's checksums of the items it wrote for ``step`` (``integrity.planned_digests``)."""
        write_bytes(step_dir(self.root, step) / f".rank{self.d.rank}.sums", json.dumps(checksums).encode())

    def maybe_commit_behind(self) -> None:
        """``maybe_commit``, on rank 0 on a thread: the loop does not wait for ``.metadata``, the marker and
        their fsyncs (tens of milliseconds, most of what a save blocked for when it committed the step before)."""
        self._raise_failed()
        if not self.d.is_main:
            self.maybe_commit()
        elif self._committer is None or not self._committer.is_alive():
            self._committer = threading.Thread(target=self._commit_behind, name="ckpt-commit", daemon=True)
            self._committer.start()

    def _commit_behind(self) -> None:
        with self._lock:
            try:
                self._maybe_commit()
            except Exception as e:   # raised on the loop, at its next commit
                self._failed = e

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def maybe_commit(self) -> None:
        """Rank 0: commit every pending step whose parts are all done; other ranks forget their done steps."""
        with self._lock:
            self._maybe_commit()
        self._raise_failed()

    def _maybe_commit(self) -> None:
        if not self.d.is_main:
            # Non-zero ranks are done with a step once their own results are on disk.
            while self.pending and (step_dir(self.root, self.pending[0].step)
                                    / f".rank{self.d.rank}.done").exists():
                self.pending.popleft()
            return
        while self.pending:
            p = self.pending[0]
            path = step_dir(self.root, p.step)
            done = [path / f".rank{r}.done" for r in range(self.d.world_size)]
            if not all(f.exists() for f in done):
                return
            self.pending.popleft()
            self._commit(p, results=[pickle.loads(f.read_bytes()) for f in done])

    def commit(self, p: Pending, results: list | None) -> None:
        """Rank 0: ``.metadata`` (unless a synchronous ``dcp.save`` wrote it: ``results`` None), then the marker."""
        with self._lock:
            self._commit(p, results)

    def _commit(self, p: Pending, results: list | None) -> None:
        path = step_dir(self.root, p.step)
        if results is not None:
            p.writer.finish(p.metadata, results)   # writes .metadata (tmp + rename, fsynced)
        checksums: dict[str, str] = {}
        for r in range(self.d.world_size):
            checksums.update(json.loads((path / f".rank{r}.sums").read_text()))
        marker = {"step": p.step, "world_size": self.d.world_size, "committed_at": time.time(),
                  "files": sorted(f.name for f in path.iterdir() if not f.name.startswith(".rank")),
                  **marker_fields(checksums)}
        write_bytes(path / COMMITTED, json.dumps(marker).encode())
        self.events.emit(Event.CKPT_COMMITTED, step=p.step, commit_s=round(time.monotonic() - p.started, 4))
        if self.mirror is not None:
            self.mirror.enqueue(p.step, marker["committed_at"])
        self._start_purge(p.step)

    def check_all_committed(self) -> None:
        """Rank 0, after every rank finished its writes: a step still pending lost a rank's results."""
        if self.d.is_main and self.pending:
            raise RuntimeError(f"checkpoint at step {self.pending[0].step} could not be committed: "
                               f"a rank's write results are missing")

    def newest(self) -> int | None:
        with self._lock:   # not while the commit thread commits
            steps = committed_steps(self.root)
        return steps[-1] if steps else None

    # ------------------------------------------------------------------------------------ retention
    def _start_purge(self, newest: int) -> None:
        # A daemon thread, so a slow delete on a network file system never blocks the loop and a failed
        # delete never kills training (torchtitan's purge thread).
        if self._purger is not None and self._purger.is_alive():
            return
        self._purger = threading.Thread(target=self.purge, args=(newest,), daemon=True, name="ckpt-purge")
        self._purger.start()

    def join_purge(self) -> None:
        if self._purger is not None:
            self._purger.join()

    def purge(self, newest: int) -> None:
        """Delete committed checkpoints beyond the newest ``keep`` (unless the mirror still needs them) and torn
        ones older than ``newest``."""
        try:
            for step in committed_steps(self.root)[:-self.keep]:
                if self.mirror is not None and self.mirror.holds(step):
                    continue    # not in the mirror yet: deleted by a later purge
                delete_checkpoint(step_dir(self.root, step))
            self.delete_torn(older_than=newest)
        except OSError as e:  # pragma: no cover - depends on the file system
            log.warning("checkpoint purge failed: %s", e)

    def delete_torn(self, older_than: int | None = None) -> None:
        """Delete uncommitted step directories (all at start; during a run only those older than the
        newest commit, since newer ones may still be in flight)."""
        for p in self.root.iterdir():
            step = step_of(p)
            if step is None or (p / COMMITTED).exists():
                continue
            if older_than is not None and step >= older_than:
                continue
            self.events.emit(Event.CKPT_TORN_DELETED, step=step)
            shutil.rmtree(p, ignore_errors=True)
