"""One job at a time in a run directory.

A second job started on a run directory while the first still trains there would take itself for a restart of
the first: it shares the run's name and so its memory snapshots, re-fires or skips its faults, and both commit
the same steps into one checkpoint directory. So every node's launch wrapper (``trainer.warmstart``, which lives
as long as the job on its node, across in-job restarts) holds a shared lock on its job's file in the run's
``jobs/`` directory (``flock``: the kernel drops it when the process ends, by a crash too). A job that finds
another job's file locked waits for that job to end, up to a bound, and is refused after it; of two jobs started
at once, the one that started first trains. The file names its job's node, process and start, so a refused job
says which to stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from . import layout

log = logging.getLogger("trainer")


class RunInUse(RuntimeError):
    """Another job trains in the run directory."""


@dataclass(frozen=True)
class Holder:
    """What a job's file says of it: its identity, and the node process that wrote it first."""

    job: str
    host: str
    pid: int
    since: float          # time.time() at which it took the file

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}, since {started}"


def _read(fd: int) -> Holder | None:
    try:
        return Holder(**json.loads(os.pread(fd, 4096, 0)))
    except (OSError, ValueError, TypeError):     # being written, or not a job's record
        return None


def _live_jobs(out: Path, own: str | None = None) -> list[Holder | None]:
    """The jobs other than ``own`` whose files are locked (None: one not named yet); the others' files, left by
    jobs that ended, are deleted."""
    live = []
    for path in sorted(layout.jobs_dir(out).glob("*.lock")):
        if own is not None and path.name == _file_name(own):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)      # under the lock: a job that opened it meanwhile sees it gone
        except BlockingIOError:
            live.append(_read(fd))
        finally:
            os.close(fd)
    return live


def _file_name(job: str) -> str:
    return hashlib.sha256(job.encode()).hexdigest()[:16] + ".lock"


def _who(jobs: list[Holder | None]) -> str:
    return "; ".join(h.describe() if h else "a job that has not named itself yet" for h in jobs)


def _refusal(out: Path, jobs: list[Holder | None]) -> str:
    return (f"{out} is in use: another job is training there ({_who(jobs)}); stop that job or wait for it to end, "
            f"or give this run another --out")


def in_use_by(out: str | Path) -> str | None:
    """Why a job cannot start in ``out`` now (another job holds it), or None."""
    try:
        live = _live_jobs(Path(out)) if layout.jobs_dir(out).is_dir() else []
    except OSError:
        return None               # no flock here: the wrapper says so when it starts
    return _refusal(Path(out), live) if live else None


class JobLock:
    """This node's share of its job's hold on a run directory, until ``close`` or the process's end."""

    def __init__(self, fd: int, path: Path):
        self._fd, self._path = fd, path

    @classmethod
    def hold(cls, out: str | Path, job: str, wait_s: float, *, poll_s: float = 0.5) -> JobLock | None:
        """Take this node's share of job ``job``'s hold on ``out``, then wait up to ``wait_s`` for any other job
        that started before this one to end (a stopped job's final checkpoint); ``RunInUse`` if one still holds
        ``out`` then. None where the file system has no ``flock`` (Lustre mounted with ``noflock``): said once,
        on the console."""
        out = Path(out)
        try:
            fd, mine, path = cls._share(out, job)
        except OSError as e:
            log.warning("%s cannot be locked (%s): nothing stops a second job from training in %s",
                        layout.jobs_dir(out), e, out)
            return None
        deadline, waited = time.monotonic() + wait_s, False
        try:
            # Jobs that started after this one give way to it; a job not named yet may be older.
            while older := [h for h in _live_jobs(out, own=job) if h is None or (h.since, h.job) < (mine.since, job)]:
                if time.monotonic() >= deadline:
                    raise RunInUse(_refusal(out, older))
                if not waited:
                    log.warning("waiting up to %.0fs for another job training in %s to end (%s)", wait_s, out,
                                _who(older))
                    waited = True
                time.sleep(poll_s)
        except BaseException:
            cls(fd, path).close()
            raise
        return cls(fd, path)

    @staticmethod
    def _share(out: Path, job: str) -> tuple[int, Holder, Path]:
        """A shared lock on ``job``'s file, which names the job (its first node's record is kept)."""
        path = layout.jobs_dir(out) / _file_name(job)
        while True:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue                  # jobs/ removed just now by the last job to end
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass                      # deleted as an ended job's file before the lock was taken
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        record = _read(fd)
        if record is None or record.job != job:
            record = Holder(job, socket.gethostname(), os.getpid(), time.time())
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(vars(record)).encode(), 0)
        return fd, record, path

    def close(self) -> None:
        """Let go; the last of the job's nodes to do so deletes the job's file (and ``jobs/`` once empty)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # no other node of the job holds it
            self._path.unlink()
            self._path.parent.rmdir()
        os.close(self._fd)
        self._fd = -1
