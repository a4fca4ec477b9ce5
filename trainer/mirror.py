"""A second home for committed checkpoints: a background copy to S3, and resume from it when FSx has none.

FSx lives in one Availability Zone and one cluster; the mirror (``--ckpt-mirror s3://BUCKET/PREFIX``, any
S3-compatible endpoint with ``--ckpt-mirror-endpoint-url``) survives both. Layout in the bucket::

    PREFIX/checkpoints/step_000000100/__<rank>_<i>.distcp   DCP shards
                                      .metadata              DCP metadata
                                      COMMITTED              JSON marker (the local one + sizes), uploaded LAST

A mirrored step counts only once its ``COMMITTED`` object exists, exactly like on FSx: an upload cut off
half-way leaves shards without a marker, which are never downloaded and are deleted by retention.

Upload (rank 0, which commits): ``CheckpointManager._commit`` enqueues the step after writing the local
marker; a daemon thread uploads its files with s3transfer (multipart, ``--ckpt-mirror-concurrency``
parallel requests, each retried by botocore's ``standard`` mode), then the marker, then applies
``--ckpt-mirror-keep`` (marker deleted first, then the rest). The training loop only appends to a queue.
The newest pending step goes first, so a checkpoint taken on a spot interruption notice jumps the queue.
A checkpoint whose upload still fails is tried again after a backoff, unless newer checkpoints have made it
obsolete. Local retention leaves a step on FSx until the mirror is done with it. Every object goes up with
S3's additional checksum (full-object CRC32, whatever the part size); after the upload S3's value is read back
(``HeadObject``) and the marker records it per file.

Nothing fails silently: a mirror that cannot build its client, whose thread fails, or whose upload or
retention fails is a ``mirror_error`` event (``phase``: client, thread, upload, retention, download), a
``WARNING: the S3 mirror ...`` line on rank 0's console (the train step's log), the
``goodput_mirror_errors{phase}`` metric and the summary's ``mirror`` entry. Training goes on, unless
``--require-mirror``: then the failure ends the run (``MirrorFailed``, not retried by any layer) at the next
commit or at the end of training, and a mirror that cannot be listed fails it at setup.

Download (``maybe_fetch_from_mirror``, collective, from ``CheckpointManager._load_committed``): if FSx has
no committed checkpoint, rank 0 downloads the newest marked step into ``.step_<N>.mirror-download``,
checks every size and CRC32 against the marker (and the SDK checks each whole-object GET against S3's
checksum: ``ChecksumMode``), writes the local ``COMMITTED`` into it, verifies every item against the
checksums taken when it was staged (``verify_files``: bytes corrupted before the upload pass S3's checks),
and renames it to ``step_<N>``; then every rank loads it as usual. A step that fails any check is refused
(``mirror_error``, phase download; a failed checksum also a ``checksum_mismatch`` event, source ``mirror``) and
the next older one is tried; if none can be downloaded, the run starts afresh with a warning
(``--require-mirror``: fails), unless some failed their checksums: then it stops rather than start over.

Events: ``mirror_start``, ``mirror_committed`` (step, bytes, seconds, lag_s = now - local commit time),
``mirror_error``, ``mirror_skipped``, ``mirror_deleted``, ``mirror_drain``, ``resumed_from_mirror``;
``mirror_stats`` turns them into the ``mirror`` entry of ``summary.json``.

boto3 is imported only when a mirror is configured. Try it against a local endpoint::

    python -m trainer --data DATASET --out RUN --ckpt-mirror s3://ckpt/run1 \\
        --ckpt-mirror-endpoint-url http://127.0.0.1:5000
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .config import CheckpointConfig
from .errors import ChecksumMismatch, MirrorFailed
from .events import Event, EventLog
from .durable import publish_dir, write_bytes
from .layout import CHECKPOINTS, COMMITTED, committed_steps, step_dir, step_of
from .s3url import parse_s3_url

log = logging.getLogger(__name__)

_MAX_RETRY_S = 300.0
_DOWNLOAD_SUFFIX = ".mirror-download"
# S3's additional checksum of every mirrored object: a full-object CRC32 is zlib's CRC32 of the file, however
# the upload was split into parts (CRC32C and CRC64NVME would need awscrt).
_UPLOAD_ARGS = {"ChecksumAlgorithm": "CRC32", "ChecksumType": "FULL_OBJECT"}
_DOWNLOAD_ARGS = {"ChecksumMode": "ENABLED"}
ERROR_PHASES = ("client", "thread", "upload", "retention", "download")     # of mirror_error events
CRC32_KEY = "mirror_crc32"      # the remote marker's {file: base64 CRC32 that S3 stored}
_REMOTE_KEYS = ("sizes", "mirrored_at", CRC32_KEY)     # in the remote marker only, not in the local one


def file_crc32(path: Path) -> str:
    """Base64 of the big-endian CRC32 of a file, as S3 reports ``ChecksumCRC32``."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            crc = zlib.crc32(chunk, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def s3_client(cfg: CheckpointConfig):
    """A boto3 S3 client for the mirror: standard credential chain (IRSA in the cluster), botocore's
    ``standard`` retries (exponential backoff with jitter on throttling, 5xx and connection errors)."""
    import boto3
    from botocore.config import Config

    # total_max_attempts counts the first request too (Config's "max_attempts" would count only retries).
    config = Config(retries={"mode": "standard", "total_max_attempts": cfg.mirror_max_attempts},
                    max_pool_connections=max(10, cfg.mirror_concurrency + 2),
                    # S3-compatible endpoints (MinIO, moto, on-premises) generally need path-style addressing.
                    s3={"addressing_style": "path"} if cfg.mirror_endpoint_url else None)
    return boto3.session.Session().client("s3", endpoint_url=cfg.mirror_endpoint_url or None, config=config)


def transfer_manager(client, cfg: CheckpointConfig):
    """s3transfer's manager: files above the part size go up and down as parallel multipart transfers."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    part = cfg.mirror_part_mib * 1024 * 1024
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                            max_concurrency=cfg.mirror_concurrency, use_threads=True,
                            preferred_transfer_client="classic")
    return create_transfer_manager(client, config)


class MirrorLayout:
    """Keys of the mirror: ``<prefix>checkpoints/step_<N, 9 digits>/<file>``."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        parsed = parse_s3_url(url, "--ckpt-mirror")
        self.bucket, self.root = parsed.bucket, f"{parsed.prefix}{CHECKPOINTS}/"

    def step_prefix(self, step: int) -> str:
        return f"{self.root}{step_dir(Path(), step).name}/"

    def key(self, step: int, name: str) -> str:
        return self.step_prefix(step) + name

    def list_steps(self, client) -> dict[int, bool]:
        """Every step with at least one object in the mirror -> whether its marker exists."""
        steps: dict[int, bool] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.root):
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(self.root):]
                directory, _, name = rest.partition("/")
                step = step_of(Path(directory))
                if step is None or not name:
                    continue
                steps[step] = steps.get(step, False) or name == COMMITTED
        return steps

    def read_marker(self, client, step: int) -> dict:
        body = client.get_object(Bucket=self.bucket, Key=self.key(step, COMMITTED))["Body"].read()
        return json.loads(body)

    def delete_step(self, client, step: int) -> None:
        """Un-commit first (the marker), then delete the rest: a half-deleted step is never taken for whole."""
        client.delete_object(Bucket=self.bucket, Key=self.key(step, COMMITTED))
        keys = [obj["Key"] for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.step_prefix(step)) for obj in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=self.bucket,
                                  Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})


def _files_of(marker: dict) -> list[str]:
    # The local marker lists the shards and .metadata; never the per-rank .done files or temp files.
    return [n for n in marker["files"] if n != COMMITTED and not n.endswith(".tmp")]


def _error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


@dataclass
class _Item:
    step: int
    committed_at: float       # wall clock of the local commit (from its marker)
    not_before: float = 0.0   # monotonic time before which a failed upload is not tried again
    attempts: int = 0


class CheckpointMirror:
    """Rank 0's uploader: one daemon thread, fed by ``enqueue`` from the commit.

    Args:
        root: ``<out>/checkpoints`` on FSx.
        cfg: checkpoint section (``mirror*`` fields).
        events: the run's event log.
    """

    def __init__(self, root: Path, cfg: CheckpointConfig, events: EventLog):
        import importlib.util

        if importlib.util.find_spec("boto3") is None:
            raise RuntimeError("--ckpt-mirror needs boto3 (pip install boto3)")
        self.root, self.cfg, self.events = root, cfg, events
        self.layout = MirrorLayout(cfg.mirror)
        self._cv = threading.Condition()
        self._pending: dict[int, _Item] = {}
        self._current: int | None = None
        self._mirrored: set[int] | None = None     # marked steps in the mirror, listed on first use
        self._stopping = False
        self._failure: str | None = None           # the first failure: what --require-mirror ends the run with
        self._client = self._manager = None
        self._futures: list = []                   # s3transfer futures of the upload in flight
        self.events.emit(Event.MIRROR_READY, url=self.layout.url, keep=cfg.mirror_keep, required=cfg.require_mirror)
        if cfg.require_mirror:
            # A mirror that cannot be reached fails the run now, at setup, not at its first commit.
            try:
                self._connect()
                self._list_mirrored()
            except Exception as e:  # noqa: BLE001 - reported, then fatal
                self._failed("client", e, consequence="the run fails (--require-mirror)")
                self._check()
        # Started now (during setup), so importing boto3 and building the client stay off the loop.
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckpt-mirror")
        self._thread.start()

    # ------------------------------------------------------------------------------- loop-facing side
    def enqueue(self, step: int, committed_at: float) -> None:
        """A checkpoint was committed locally: mirror it (never blocks).

        Raises:
            MirrorFailed: with ``--require-mirror``, once the mirror has failed.
        """
        self._check()
        with self._cv:
            if self._stopping:
                return
            self._pending[step] = _Item(step, committed_at)
            self._cv.notify_all()

    def holds(self, step: int) -> bool:
        """Whether ``step`` is still to be uploaded (local retention must not delete it yet)."""
        with self._cv:
            return step in self._pending or step == self._current

    def drain(self, timeout_s: float) -> bool:
        """Wait until every enqueued checkpoint is mirrored (or given up on), at most ``timeout_s``.

        Waits in short slices: the main thread keeps running Python, so NVRx's progress watchdog sees it
        alive. A failed upload waits at most ``--ckpt-mirror-retry-s`` (not its grown backoff) before it is
        tried again. Returns whether it drained.

        Raises:
            MirrorFailed: with ``--require-mirror``, if the mirror failed or did not drain.
        """
        drained = self._drain(timeout_s)
        self._check()
        if not drained and self.cfg.require_mirror:
            self._fatal(MirrorFailed(f"the S3 mirror {self.layout.url} did not upload the last checkpoints within "
                                     f"--ckpt-mirror-drain-s ({timeout_s:g} s) and --require-mirror is set; FSx "
                                     f"has them"))
        return drained

    def _check(self) -> None:
        with self._cv:
            failure = self._failure
        if failure is not None and self.cfg.require_mirror:
            self._fatal(MirrorFailed(f"the S3 mirror {self.layout.url} failed ({failure}) and --require-mirror is set"))

    def _fatal(self, e: MirrorFailed) -> None:
        # Said at once, as trainer.recovery.exit_if_recurring will: only this rank fails, the others wait for it
        # in a collective, and the in-process layer's way out waits for them; the launch wrapper stops the
        # launcher on this event.
        self.events.emit(Event.FATAL, reason=f"{type(e).__name__}: {e}")
        raise e

    def _drain(self, timeout_s: float) -> bool:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cv:
            if timeout_s > 0:
                for item in self._pending.values():
                    item.not_before = min(item.not_before, t0 + self.cfg.mirror_retry_s)
                self._cv.notify_all()
            while (self._pending or self._current is not None) and time.monotonic() < deadline:
                if self._failure is not None and self.cfg.require_mirror:
                    break           # the run fails anyway: no need to wait for retries
                self._cv.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            left = sorted(self._pending) + ([self._current] if self._current is not None else [])
        if left or time.monotonic() - t0 > 0.05:
            self.events.emit(Event.MIRROR_DRAIN, waited_s=round(time.monotonic() - t0, 3), left=left)
        if left:
            log.warning("mirror: %s not uploaded after %.0fs (--ckpt-mirror-drain-s); FSx still has them",
                        left, timeout_s)
        return not left

    def close(self, drain_s: float) -> None:
        """Drain (bounded), then stop the thread; an upload still running is cancelled. Never raises: it runs
        in teardown (``drain`` is where --require-mirror fails the run)."""
        self._drain(drain_s)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        # s3transfer's threads are joined at interpreter exit: cancel, so a stuck upload cannot hold it up.
        # (Per future: TransferManager.shutdown(cancel=True) is broken in s3transfer 0.17.)
        for f in list(self._futures):
            f.cancel()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------------------------------- failures
    def _failed(self, phase: str, e: BaseException, step: int | None = None, *, consequence: str,
                **fields) -> None:
        """Report a mirror failure: a ``mirror_error`` event and a warning on the console, where the train step's
        log shows it; ``--require-mirror`` ends the run on it (``_check``)."""
        text = _error_text(e)
        what = f"{phase} of step {step}" if step is not None else phase
        log.warning("WARNING: the S3 mirror %s failed (%s): %s; %s", self.layout.url, what, text, consequence)
        self.events.emit(Event.MIRROR_ERROR, step=step, phase=phase, error=text, **fields)
        with self._cv:
            self._failure = self._failure or f"{what}: {text}"
            self._cv.notify_all()

    def _off(self) -> str:
        """Turn the mirror off (its thread failed); returns the consequence, for the warning."""
        with self._cv:
            self._pending.clear()
            self._stopping = True
            self._cv.notify_all()
        if self.cfg.require_mirror:
            return "the run fails (--require-mirror)"
        return "the mirror is off for the rest of this run: new checkpoints are on FSx only"

    # ---------------------------------------------------------------------------------- the thread
    def _connect(self) -> None:
        if self._client is None:
            self._client = s3_client(self.cfg)
            self._manager = transfer_manager(self._client, self.cfg)

    def _list_mirrored(self) -> None:
        if self._mirrored is None:
            listing = self.layout.list_steps(self._client)
            with self._cv:
                self._mirrored = {s for s, marked in listing.items() if marked}

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001 - the mirror must never stop training (unless required)
            self._failed("client", e, consequence=self._off(), retry_in_s=None)
            return
        try:
            while True:
                item = self._next()
                if item is None:
                    break
                self._mirror(item)
        except Exception as e:  # noqa: BLE001 - a bug here must not stop training nor pin steps on FSx
            log.exception("mirror thread failed")
            self._failed("thread", e, consequence=self._off(), retry_in_s=None)
        self._manager.shutdown()

    def _next(self) -> _Item | None:
        """The next checkpoint to upload: the newest ready one. Blocks; None once stopping."""
        with self._cv:
            while not self._stopping:
                self._drop_superseded()
                now = time.monotonic()
                ready = [s for s, it in self._pending.items() if it.not_before <= now]
                if ready:
                    item = self._pending.pop(max(ready))
                    self._current = item.step
                    return item
                wait = min((it.not_before - now for it in self._pending.values()), default=None)
                self._cv.wait(wait)
            return None

    def _drop_superseded(self) -> None:
        """Pending steps that retention would delete at once (older than the newest ``keep``) are dropped.

        This also bounds what local retention must keep on FSx while S3 is unreachable.
        """
        if not self._pending:
            return
        window = sorted((self._mirrored or set()) | set(self._pending))
        if len(window) <= self.cfg.mirror_keep:
            return
        cutoff = window[-self.cfg.mirror_keep]
        for step in [s for s in self._pending if s < cutoff]:
            del self._pending[step]
            self.events.emit(Event.MIRROR_SKIPPED, step=step, reason="superseded by newer mirrored checkpoints")

    def _mirror(self, item: _Item) -> None:
        try:
            self._upload(item)
        finally:
            with self._cv:
                self._current = None
                self._cv.notify_all()

    def _upload(self, item: _Item) -> None:
        step, client, lay = item.step, self._client, self.layout
        path = step_dir(self.root, step)
        item.attempts += 1
        t0 = time.monotonic()
        try:
            self._list_mirrored()
            try:
                marker = json.loads((path / COMMITTED).read_text())
                sizes = {n: (path / n).stat().st_size for n in _files_of(marker)}
            except FileNotFoundError:
                self.events.emit(Event.MIRROR_SKIPPED, step=step, reason="no longer on FSx")
                return
            nbytes = sum(sizes.values())
            self.events.emit(Event.MIRROR_START, step=step, files=len(sizes), bytes=nbytes, attempt=item.attempts)
            futures = self._futures = [self._manager.upload(str(path / n), lay.bucket, lay.key(step, n),
                                                            extra_args=_UPLOAD_ARGS) for n in sizes]
            errors = []
            for f in futures:       # wait for all, so no part of this step is still in flight on failure
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            self._futures = []
            if errors:
                raise errors[0]
            if self._stopping:
                raise RuntimeError("mirror closed during the upload")
            crc32 = {n: self._stored_crc32(step, path / n) for n in sizes}
            # The marker goes last: only now is the mirrored step whole.
            remote = {**marker, "sizes": sizes, CRC32_KEY: crc32, "mirrored_at": time.time()}
            client.put_object(Bucket=lay.bucket, Key=lay.key(step, COMMITTED), Body=json.dumps(remote).encode(),
                              ContentType="application/json")
        except Exception as e:  # noqa: BLE001 - retried later; training never stops for the mirror (unless required)
            retry_in = min(_MAX_RETRY_S, self.cfg.mirror_retry_s * 2 ** (item.attempts - 1))
            consequence = "the run fails (--require-mirror)" if self.cfg.require_mirror else \
                f"attempt {item.attempts}, trying again in {retry_in:.1f}s; FSx keeps the checkpoint meanwhile"
            self._failed("upload", e, step, consequence=consequence, attempt=item.attempts, retry_in_s=retry_in)
            with self._cv:
                if not self._stopping and step not in self._pending:
                    item.not_before = time.monotonic() + retry_in
                    self._pending[step] = item
            return
        took = time.monotonic() - t0
        lag = time.time() - marker["committed_at"]
        self.events.emit(Event.MIRROR_COMMITTED, step=step, bytes=nbytes, seconds=round(took, 4), lag_s=round(lag, 4),
                         attempt=item.attempts)
        log.info("mirror: step %d -> %s (%.1f MB in %.2fs, %.2fs after its local commit)", step, lay.url,
                 nbytes / 1e6, took, lag)
        with self._cv:
            self._mirrored.add(step)
        try:
            self._retain()
        except Exception as e:  # noqa: BLE001 - retention is tried again after the next upload
            self._failed("retention", e, consequence="the run fails (--require-mirror)" if self.cfg.require_mirror
                         else "old checkpoints stay in the mirror until the next upload's retention",
                         retry_in_s=None)

    def _stored_crc32(self, step: int, path: Path) -> str:
        """The CRC32 S3 stored for an uploaded file (it checked the SDK's against the bytes it received); an
        endpoint that keeps no additional checksums gets the file's, computed here."""
        head = self._client.head_object(Bucket=self.layout.bucket, Key=self.layout.key(step, path.name),
                                        ChecksumMode="ENABLED")
        return head.get("ChecksumCRC32") or file_crc32(path)

    def _retain(self) -> None:
        """Keep the newest ``--ckpt-mirror-keep`` marked steps; delete older steps, marked or torn."""
        listing = self.layout.list_steps(self._client)
        marked = sorted(s for s, m in listing.items() if m)
        if len(marked) <= self.cfg.mirror_keep:
            return
        cutoff = marked[-self.cfg.mirror_keep]
        for step in sorted(s for s in listing if s < cutoff):
            self.layout.delete_step(self._client, step)
            with self._cv:
                self._mirrored.discard(step)
            self.events.emit(Event.MIRROR_DELETED, step=step, torn=not listing[step])


# ------------------------------------------------------------------------------------------ resume


def fetch_newest(root: Path, cfg: CheckpointConfig, events: EventLog) -> int | None:
    """Download the newest marked step of the mirror into ``root``; return its step, or None if none.

    A step without a marker (an upload cut off half-way) is never considered. A listing that fails even
    after the SDK's retries raises: starting from scratch next to a mirror that may hold the run's
    progress would silently throw that progress away.
    """
    lay = MirrorLayout(cfg.mirror)
    client = s3_client(cfg)
    t0 = time.monotonic()
    listing = lay.list_steps(client)
    marked = sorted((s for s, m in listing.items() if m), reverse=True)
    ignored = sorted(s for s, m in listing.items() if not m)
    if ignored:
        log.info("mirror: ignoring steps without a marker (uploads cut off half-way): %s", ignored)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".step_*{_DOWNLOAD_SUFFIX}"):
        shutil.rmtree(stale, ignore_errors=True)
    corrupt = []
    with transfer_manager(client, cfg) as manager:
        for step in marked:
            try:
                nbytes = _download(client, manager, lay, root, step)
            except Exception as e:  # noqa: BLE001 - try the next older step
                if isinstance(e, ChecksumMismatch):
                    corrupt.append(step)
                    events.emit(Event.CHECKSUM_MISMATCH, source="mirror", step=step, rank=0, reason=str(e)[:400])
                log.warning("WARNING: the S3 mirror %s: step %d refused or not downloadable: %s; trying an older one",
                            lay.url, step, _error_text(e))
                events.emit(Event.MIRROR_ERROR, step=step, phase="download", error=_error_text(e), retry_in_s=None)
                continue
            took = time.monotonic() - t0
            events.emit(Event.RESUMED_FROM_MIRROR, step=step, bytes=nbytes, download_s=round(took, 4), url=lay.url,
                        ignored_unmarked=ignored)
            log.info("resume: FSx has no committed checkpoint; fetched step %d from %s (%.1f MB in %.1fs)", step,
                     lay.url, nbytes / 1e6, took)
            return step
    if marked:
        text = (f"none of the {len(marked)} mirrored checkpoints in {lay.url} could be downloaded (mirror_error "
                f"events say why)")
        if cfg.require_mirror:
            raise MirrorFailed(f"{text} and --require-mirror is set")
        if corrupt:
            # Bytes other than those mirrored: starting over would bury the run's progress under a fresh start.
            raise RuntimeError(f"{text}: steps {corrupt} failed their checksums; refusing to start over from scratch")
        log.warning("WARNING: %s: training starts afresh", text)
        return None
    log.info("resume: no committed checkpoint on FSx nor in %s: fresh start", lay.url)
    return None


def _download(client, manager, lay: MirrorLayout, root: Path, step: int) -> int:
    marker = lay.read_marker(client, step)
    if marker.get("step") != step:
        raise ValueError(f"marker of step {step} says step {marker.get('step')}")
    sizes = marker["sizes"]
    tmp = root / f".{step_dir(root, step).name}{_DOWNLOAD_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    futures = [manager.download(lay.bucket, lay.key(step, n), str(tmp / n), extra_args=_DOWNLOAD_ARGS)
               for n in _files_of(marker)]
    for f in futures:
        f.result()
    for name, size in sizes.items():
        got = (tmp / name).stat().st_size
        if got != size:
            raise ValueError(f"{name}: {got} bytes downloaded, the marker says {size}")
    # The SDK checks only whole-object GETs; ranged (multipart) downloads are checked here, every file is.
    crc32 = marker.get(CRC32_KEY)
    if crc32 is None:
        log.info("mirror: step %d was mirrored without checksums (an older version): sizes checked only", step)
    for name, want in (crc32 or {}).items():
        got = file_crc32(tmp / name)
        if got != want:
            raise ChecksumMismatch(f"{name}: CRC32 {got} downloaded, S3 stored {want} when it was mirrored")
    local = {k: v for k, v in marker.items() if k not in _REMOTE_KEYS}
    write_bytes(tmp / COMMITTED, json.dumps({**local, "fetched_from": lay.url}).encode())
    # Bytes that were wrong before the upload (on FSx, or as the writer wrote them) pass S3's checksums: the
    # checksums taken at staging tell, before the step is published where a restore would take it. (A step
    # that records none is published, and refused by the restore's own verification, like one on FSx.)
    if "checksums" in local:
        from .checkpoint.integrity import verify_files

        verify_files(tmp)
    # Over an uncommitted leftover of the same step; whole, marker included, from the moment it is there.
    publish_dir(tmp, step_dir(root, step))
    return sum(sizes.values())


def maybe_fetch_from_mirror(root: Path, cfg: CheckpointConfig, d, events: EventLog, poll_s: float = 0.25) -> None:
    """Collective: when FSx has no committed checkpoint, rank 0 fetches the newest one from the mirror.

    The download can take longer than the process group's collective timeout, so nobody waits in one long
    collective: rank 0 downloads in a thread and all ranks meet in short all-reduces until it is done.
    """
    import torch
    import torch.distributed as dist

    need = [False]
    if d.is_main:
        local = committed_steps(root)
        need[0] = not local
        if local:
            log.info("resume: newest committed checkpoint on FSx is step %d; the mirror is not needed", local[-1])
    # Sync point: rank 0's decision.
    dist.broadcast_object_list(need, src=0)
    if not need[0]:
        return
    outcome: dict = {}
    worker = None
    if d.is_main:
        def fetch() -> None:
            try:
                outcome["step"] = fetch_newest(root, cfg, events)
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread below
                outcome["error"] = e

        worker = threading.Thread(target=fetch, daemon=True, name="ckpt-mirror-fetch")
        worker.start()
    while True:
        state = 0.0 if worker is None or worker.is_alive() else (2.0 if "error" in outcome else 1.0)
        flag = torch.tensor([state], device=d.device)
        # Sync point, repeated every poll_s: 0 = rank 0 still downloading, 1 = done, 2 = failed.
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
        time.sleep(poll_s)
    if flag.item() > 1:
        if d.is_main:
            raise RuntimeError(f"cannot read the checkpoint mirror {cfg.mirror}: {_error_text(outcome['error'])}") \
                from outcome["error"]
        raise RuntimeError(f"rank 0 could not read the checkpoint mirror {cfg.mirror}")


# ----------------------------------------------------------------------------------------- summary
def mirror_warning(stats: dict | None) -> str | None:
    """The line that ends the train step's log when the run's mirror failed (``stats``: ``mirror_stats``)."""
    if not stats or not stats["errors"]:
        return None
    phases = ", ".join(f"{phase} {n}" for phase, n in stats["errors_by_phase"].items())
    newest = stats["last_mirrored_step"]
    return (f"WARNING: the S3 checkpoint mirror failed {stats['errors']} time(s) in this run ({phases}; last: "
            f"{stats['last_error']}){'; it turned itself off' if stats['disabled'] else ''}; "
            f"{'no checkpoint was mirrored' if newest is None else f'newest mirrored checkpoint: step {newest}'} "
            f"(events.jsonl: mirror_error)")


# Events that only a run with a mirror has.
MIRROR_EVENTS = frozenset(e for e in Event if e.startswith("mirror_")) | {Event.RESUMED_FROM_MIRROR}


def mirror_stats(events: list[dict]) -> dict | None:
    """The ``mirror`` entry of ``summary.json`` (None when the run had no mirror)."""
    if not any(e["event"] in MIRROR_EVENTS for e in events):
        return None
    done = [e for e in events if e["event"] == Event.MIRROR_COMMITTED]
    resumed = [e["step"] for e in events if e["event"] == Event.RESUMED_FROM_MIRROR]
    errors = [e for e in events if e["event"] == Event.MIRROR_ERROR]
    last = errors[-1] if errors else None
    return {
        "checkpoints_mirrored": len(done),
        # The newest step in the mirror (uploads go newest first, so a retried older one may finish last).
        "last_mirrored_step": max(e["step"] for e in done) if done else None,
        "bytes_mirrored": sum(e["bytes"] for e in done),
        "lag_s_last": done[-1]["lag_s"] if done else None,
        "lag_s_max": max(e["lag_s"] for e in done) if done else None,
        "upload_s_max": max(e["seconds"] for e in done) if done else None,
        "errors": len(errors),
        "errors_by_phase": dict(Counter(e["phase"] for e in errors)),
        # The mirror turned itself off (its client or thread failed): later checkpoints are on FSx only.
        "disabled": any(e["phase"] in ("client", "thread") for e in errors),
        "last_error": None if last is None else
        f"{last['phase']}{'' if last.get('step') is None else ' of step ' + str(last['step'])}: {last['error']}",
        "skipped": sum(e["event"] == Event.MIRROR_SKIPPED for e in events),
        "resumed_from_mirror_step": resumed[-1] if resumed else None,
    }
