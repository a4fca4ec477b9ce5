"""Stage a dataset from S3 (or a local directory) onto FSx and build the trainer's dataset there.

Layout of a staged dataset, ``<fsx_root>/datasets/<name>/<version>/``::

    raw/<key relative to the prefix>   the source objects, byte for byte
    manifest.json                      the trainer's manifest (written last) + ``objects``: key, ETag, size
    train_00000.bin, val_00000.bin     token shards (``trainer.data.build_dataset``)
    .stage/                            journal of verified objects, temp files, lock (private to staging)

How an object gets into ``raw/``: it is downloaded to ``.stage/tmp/`` while the listing goes on (one GET
per small object from a pool of threads, s3transfer's parallel ranged GETs for large ones, the SDK's
retry modes for throttling and 5xx); once complete its size, and its MD5 where the ETag is one
(single-part uploads, hashed as the bytes arrive), are checked; it is renamed into place, and recorded in
``.stage/journal.jsonl``, only once the whole listing has been checked and files that left the source
have been removed. A rerun skips every object whose ETag and size match the previous manifest or the
journal and whose file is on disk with that size, so an interrupted stage resumes where it stopped and
an unchanged prefix transfers nothing.
Temp files of an interrupted run are deleted at the next start.

Every key is checked before it is fetched: a key that would land outside ``raw/`` (``..``, an absolute
path, a NUL byte, an over-long name, an empty component) is refused, reported, and never written; so is
a key that is also the directory of other keys. The rest is staged. Objects that left the source are
removed from ``raw/``.

FSx data repository association (``fsx_dra=True``): ``raw/`` is already linked to the bucket, so the
files are preloaded with ``lfs hsm_restore`` in bounded batches instead of copied.

    goodput stage s3://my-bucket/corpus/ --fsx-root /fsx --name corpus --version 1
    goodput stage ./texts --fsx-root fsx --name mine --version 1        # a local directory

The KFP component is ``components.stage_op.stage_op``; this module imports no kfp (and no torch), so the
CLI starts fast.
"""


import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

log = logging.getLogger(__name__)

STAGE_DIR = ".stage"
JOURNAL = "journal.jsonl"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NAME_MAX = 255        # bytes in one path component (Linux, Lustre)
PATH_MAX = 4096       # bytes in a whole path
MB = 1024 * 1024
CHUNK = MB           # bytes per read of an object body


class StageError(RuntimeError):
    """Staging failed; ``result`` (when set) says what was done before the failure."""

    def __init__(self, message: str, result: "StageResult | None" = None):
        super().__init__(message)
        self.result = result


class StageProgress(Protocol):
    """What the stage reports while it runs (the CLI draws a progress bar from it)."""

    def start(self, files: int | None, nbytes: int | None) -> None:
        """Called with None while the source is being listed, then again with the totals to fetch."""

    def advance(self, files: int = 0, nbytes: int = 0) -> None:
        """Files finished and bytes received since the last call (from several threads)."""


@dataclass
class StageResult:
    """What a stage did. Counts are objects (files) unless named ``*_bytes``; times are seconds."""

    source: str
    dataset_dir: str
    objects: int = 0               # objects listed under the source that are staged (refused ones excluded)
    transferred: int = 0           # objects downloaded (or copied) by this run
    transferred_bytes: int = 0
    skipped_unchanged: int = 0     # objects already in place with the same ETag and size
    removed: int = 0               # files in raw/ whose object left the source
    restored: int = 0              # files preloaded with lfs hsm_restore (data repository association)
    refused: list[dict] = field(default_factory=list)   # {"key", "reason"}: never written
    failed: list[dict] = field(default_factory=list)    # {"key", "error"}
    files: int = 0                 # text files in the dataset
    train_tokens: int = 0
    val_tokens: int = 0
    rebuilt: bool = False          # False: nothing changed, the existing manifest was kept
    list_s: float = 0.0
    transfer_s: float = 0.0
    build_s: float = 0.0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.refused and not self.failed

    def to_dict(self) -> dict:
        return asdict(self)


class _Object(NamedTuple):
    key: str        # the source key (or path relative to a local source)
    rel: str        # path under raw/
    size: int
    etag: str       # S3 ETag without quotes; "local:<mtime_ns>" for a local source


# --------------------------------------------------------------------------------------- helpers
def parse_source(source: str) -> tuple[str | None, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix with a trailing slash or ""); a directory -> (None, path)."""
    if source.startswith("s3://"):
        bucket, _, prefix = source[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"{source!r}: no bucket name; expected s3://BUCKET[/PREFIX]")
        prefix = prefix.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"     # a prefix names a directory: s3://b/data must not match data2/...
        return bucket, prefix
    if "://" in source:
        raise ValueError(f"{source!r}: unsupported source; use s3://BUCKET/PREFIX or a local directory")
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"source directory {source!r} does not exist")
    return None, str(path.resolve())


def dataset_dir(fsx_root: str | Path, name: str, version: str) -> Path:
    """``<fsx_root>/datasets/<name>/<version>``; name and version must be plain path components."""
    for what, value in (("name", name), ("version", version)):
        if not NAME_RE.match(value or ""):
            raise ValueError(f"dataset {what} {value!r} must be 1-128 characters of letters, digits, '.', '_' "
                             f"or '-', starting with a letter or digit")
    return Path(fsx_root) / "datasets" / name / version


def unsafe_reason(rel: str, raw_dir: Path) -> str | None:
    """Why ``rel`` must not be written under ``raw_dir`` (None if it is safe)."""
    if "\x00" in rel:
        return "contains a NUL byte"
    if rel.startswith("/"):
        return "absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return "'..' component would escape the destination"
    if any(p in ("", ".") for p in parts):
        return "empty or '.' path component"
    if any(len(p.encode()) > NAME_MAX for p in parts):
        return f"a path component is longer than {NAME_MAX} bytes"
    target = os.path.join(raw_dir, rel)
    if len(target.encode()) > PATH_MAX:
        return f"the destination path is longer than {PATH_MAX} bytes"
    # Belt and braces: the normalised path must stay inside raw/.
    if not os.path.normpath(target).startswith(os.path.normpath(raw_dir) + os.sep):
        return "resolves outside the destination"
    return None


def _refuse_collisions(objects: list[_Object]) -> tuple[list[_Object], list[dict]]:
    """A key that is also the directory of another key ("a" and "a/b") cannot exist on a file system."""
    dirs = set()
    for o in objects:
        parts = o.rel.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    keep = [o for o in objects if o.rel not in dirs]
    refused = [{"key": o.key, "reason": "is also the directory of other keys"} for o in objects if o.rel in dirs]
    return keep, refused


def _is_md5_etag(etag: str) -> bool:
    # Single-part uploads without SSE-KMS/SSE-C have the content's MD5 as ETag; multipart ones "<hex>-<parts>".
    return bool(re.fullmatch(r"[0-9a-f]{32}", etag))


def s3_client(endpoint_url: str | None = None, *, retry_mode: str = "standard", max_attempts: int = 10,
              max_pool_connections: int = 64):
    """A boto3 S3 client: standard credential chain (IRSA in the cluster), the SDK's retry mode.

    ``standard`` retries throttling (503 SlowDown) and 5xx with exponential backoff and jitter;
    ``adaptive`` also rate-limits the whole client after a throttling error, which protects a hot prefix
    but cuts throughput hard (measured here: 3 SlowDowns in 150 GETs made a stage 1.5x slower, 30 made it
    15x slower), so it is opt-in.
    """
    import boto3
    from botocore.config import Config

    import botocore.session

    config = Config(retries={"mode": retry_mode, "max_attempts": max_attempts},
                    max_pool_connections=max_pool_connections,
                    # S3-compatible endpoints (MinIO, moto, on-prem) generally need path-style addressing.
                    s3={"addressing_style": "path"} if endpoint_url else None)
    session = botocore.session.get_session()
    # LastModified is never used here, and parsing it (dateutil) is over half the client CPU of a listing
    # (10,000 keys: 1.7 s -> 0.7 s) and a tenth of a small GET's: keep timestamps as the strings S3 sent.
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    return boto3.session.Session(botocore_session=session).client("s3", endpoint_url=endpoint_url or None,
                                                                  config=config)


def _pages_s3(client, bucket: str, prefix: str) -> Iterator[list[tuple[str, int, str]]]:
    """(key, size, ETag) per listed page; zero-byte "folder" markers (keys ending in /) are dropped."""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        yield [(o["Key"], o["Size"], o["ETag"].strip('"')) for o in page.get("Contents", [])
               if not (o["Key"].endswith("/") and o["Size"] == 0)]


def _list_local(root: str) -> tuple[list[tuple[str, int, str]], list[dict]]:
    found, refused = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if os.path.islink(path):
                refused.append({"key": rel, "reason": "symbolic link (may point outside the source)"})
                continue
            st = os.stat(path)
            found.append((rel, st.st_size, f"local:{st.st_mtime_ns}"))
    return found, refused


def _load_known(dest: Path) -> dict[str, dict]:
    """rel -> {key, etag, size} of objects already verified in place: previous manifest, then the journal."""
    known: dict[str, dict] = {}
    try:
        known.update(json.loads((dest / "manifest.json").read_text()).get("objects", {}))
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    journal = dest / STAGE_DIR / JOURNAL
    if journal.exists():
        for line in journal.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue          # a line torn by the interruption
            known[rec.pop("rel")] = rec
    return known


class _Lock:
    """One stage at a time per dataset directory (flock; not every file system supports it)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self) -> "_Lock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise StageError(f"another stage is writing to {self.path.parent.parent}; wait for it to finish")
        except OSError as e:      # pragma: no cover - file systems mounted without flock
            log.warning("cannot lock %s (%s); make sure no other stage writes to the same dataset", self.path, e)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


class _Journal:
    """Appends one line per verified object; O_APPEND keeps lines whole across threads."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, obj: _Object) -> None:
        os.write(self.fd, (json.dumps({"rel": obj.rel, "key": obj.key, "etag": obj.etag, "size": obj.size})
                           + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class _Target:
    """The file one object is written into, as s3transfer's download target.

    It is opened on the first write (thousands of downloads may be queued at once) and is deliberately not
    seekable: s3transfer then hands over the bytes in order even when a large object arrives as parallel
    ranged GETs, so the MD5 is computed on the way in and the file is written sequentially.
    """

    def __init__(self, path: str, want_md5: bool):
        self.path, self.f, self.size = path, None, 0
        self.md5 = hashlib.md5(usedforsecurity=False) if want_md5 else None

    def write(self, data: bytes) -> int:
        if self.f is None:
            self.f = open(self.path, "wb")
        n = self.f.write(data)
        self.size += n
        if self.md5 is not None:
            self.md5.update(data)
        return n

    def close(self) -> None:
        if self.f is None:
            open(self.path, "wb").close()      # an empty object gets no write
        else:
            self.f.close()
        self.f = False


class _Finisher:
    """Verifies completed downloads and renames them into place (runs in s3transfer's threads).

    While the listing is still running, verified downloads are held in the temp directory: nothing enters
    raw/ before every key has been checked (a key can turn out to collide with a later one) and the
    files that left the source have been removed. ``release`` places the held ones; later downloads
    are placed as they finish.
    """

    def __init__(self, raw: Path, journal: _Journal, result: StageResult, progress: StageProgress | None,
                 verify_etag: bool):
        self.raw, self.journal, self.result, self.progress = str(raw), journal, result, progress
        self.verify_etag = verify_etag
        self.lock = threading.Lock()
        self.made_dirs: set[str] = set()
        self.held: list[tuple[_Object, _Target]] | None = []
        self.drop: set[str] = set()

    def target(self, obj: _Object, tmp: str) -> _Target:
        return _Target(tmp, self.verify_etag and _is_md5_etag(obj.etag))

    def finish(self, obj: _Object, target: _Target, error: BaseException | None) -> None:
        try:
            if target.f is not False:
                target.close()
            if error is not None:
                raise error
            if target.size != obj.size:
                raise StageError(f"{target.size} bytes downloaded, listed as {obj.size}")
            if target.md5 is not None and target.md5.hexdigest() != obj.etag:
                raise StageError(f"MD5 {target.md5.hexdigest()} does not match ETag {obj.etag} (corrupted in "
                                 f"transit; SSE-KMS objects need verify_etag=False)")
            with self.lock:
                held = self.held is not None
                if held:
                    self.held.append((obj, target))
            if held:
                pass
            elif obj.rel in self.drop:
                _unlink(target.path)         # its key was refused once the whole listing was known
            else:
                self._place(obj, target)
        except BaseException as e:  # noqa: B036 - every failure is recorded, none may kill the pool thread
            self._fail(obj, target, e)
        if self.progress is not None:
            self.progress.advance(files=1)

    def release(self, drop: set[str]) -> None:
        """The listing is complete: place the held downloads, except those of keys refused since (``drop``)."""
        with self.lock:
            held, self.held, self.drop = self.held or [], None, drop
        for obj, target in held:
            if obj.rel in drop:
                _unlink(target.path)
                continue
            try:
                self._place(obj, target)
            except OSError as e:
                self._fail(obj, target, e)

    def _place(self, obj: _Object, target: _Target) -> None:
        final = os.path.join(self.raw, obj.rel)
        parent = os.path.dirname(final)
        if parent not in self.made_dirs:
            os.makedirs(parent, exist_ok=True)
            self.made_dirs.add(parent)
        os.replace(target.path, final)
        self.journal.record(obj)
        with self.lock:
            self.result.transferred += 1
            self.result.transferred_bytes += obj.size

    def _fail(self, obj: _Object, target: _Target, e: BaseException) -> None:
        _unlink(target.path)
        with self.lock:
            self.result.failed.append({"key": obj.key, "error": _short_error(e)})


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


@contextlib.contextmanager
def _s3_downloads(client, bucket: str, tmp_dir: Path, finisher: _Finisher, progress: StageProgress | None, *,
                  max_concurrency: int, multipart_threshold: int, multipart_chunksize: int):
    """Yields ``submit(obj)``, which queues one download; leaving the block waits for every download (an
    exception cancels the ones not started).

    An object under ``multipart_threshold`` is one GetObject by ``max_concurrency`` worker threads that
    share the client, so the SDK's retry mode retries it as it retries any request. s3transfer would do
    the same GET, but its futures, subscribers and task queues cost about as much client CPU per object
    as the request itself, and on a small machine that CPU is taken from the endpoint (see
    ``bench/stage.py``). A body cut off mid-stream is not retried by the SDK: that object is handed to
    s3transfer, whose download retries such reads. Larger objects go to s3transfer from the start, as
    parallel ranged GETs (``max_concurrency`` more threads).
    """
    import queue

    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from s3transfer.subscribers import BaseSubscriber
    from s3transfer.utils import S3_RETRYABLE_DOWNLOAD_ERRORS

    class Subscriber(BaseSubscriber):
        def __init__(self, obj: _Object, target: _Target):
            self.obj, self.target = obj, target

        def on_queued(self, future, **kwargs):
            # Size and ETag from the listing: no HeadObject per object, and ranged GETs of a large object
            # carry If-Match, so an object replaced mid-download fails instead of mixing two versions.
            future.meta.provide_transfer_size(self.obj.size)
            future.meta.provide_object_etag(f'"{self.obj.etag}"')

        def on_progress(self, future, bytes_transferred, **kwargs):
            if progress is not None:
                progress.advance(nbytes=bytes_transferred)

        def on_done(self, future, **kwargs):
            try:
                future.result()
                error = None
            except BaseException as e:  # noqa: B036 - recorded by the finisher
                error = e
            finisher.finish(self.obj, self.target, error)

    def transfer(obj: _Object, tmp: str) -> None:
        target = finisher.target(obj, tmp)
        manager.download(bucket, obj.key, target, subscribers=[Subscriber(obj, target)])

    def get(obj: _Object, tmp: str) -> None:
        target = finisher.target(obj, tmp)
        error = None
        try:
            # If-Match: an object replaced since it was listed fails (412) instead of landing unverified.
            body = client.get_object(Bucket=bucket, Key=obj.key, IfMatch=f'"{obj.etag}"')["Body"]
            with contextlib.closing(body):
                for chunk in body.iter_chunks(CHUNK):
                    target.write(chunk)
        except S3_RETRYABLE_DOWNLOAD_ERRORS:
            target.close()
            transfer(obj, tmp)           # s3transfer starts the file over and retries the read
            return
        except Exception as e:  # noqa: B902 - recorded by the finisher, like s3transfer's errors
            error = e
        if progress is not None:
            progress.advance(nbytes=target.size)
        finisher.finish(obj, target, error)

    # Unbounded (every listed object is held in memory anyway): the listing runs ahead of the downloads,
    # so verified files are placed and journaled as they finish instead of waiting in the temp directory
    # for the end of the listing; an interrupted stage keeps them.
    todo: queue.SimpleQueue = queue.SimpleQueue()
    cancelled = threading.Event()

    def worker() -> None:
        while (item := todo.get()) is not None:
            if not cancelled.is_set():
                get(*item)

    config = TransferConfig(max_concurrency=max_concurrency, multipart_threshold=multipart_threshold,
                            multipart_chunksize=multipart_chunksize, use_threads=True,
                            preferred_transfer_client="classic")
    tmp = str(tmp_dir)
    count = itertools.count()
    with create_transfer_manager(client, config) as manager:
        workers = [threading.Thread(target=worker, name=f"stage-get-{i}", daemon=True)
                   for i in range(max_concurrency)]
        for w in workers:
            w.start()

        def submit(obj: _Object) -> None:
            path = os.path.join(tmp, f"{next(count):08d}")
            if obj.size < multipart_threshold:
                todo.put((obj, path))
            else:
                transfer(obj, path)

        try:
            yield submit
        except BaseException:
            cancelled.set()
            raise
        finally:
            for _ in workers:
                todo.put(None)
            for w in workers:
                w.join()
        # Leaving the manager's block waits for its transfers (cancels them after an exception).


@contextlib.contextmanager
def _local_copies(root: str, tmp_dir: Path, finisher: _Finisher, progress: StageProgress | None):
    """Yields ``submit(obj)``; the files are copied when the block is left."""
    todo: list[_Object] = []
    yield todo.append
    for i, obj in enumerate(todo):
        target = _Target(os.path.join(tmp_dir, f"{i:08d}"), want_md5=False)
        error = None
        try:
            with open(os.path.join(root, obj.key), "rb") as f:
                shutil.copyfileobj(f, target, 1 << 20)
        except OSError as e:
            error = e
        if progress is not None:
            progress.advance(nbytes=obj.size)
        finisher.finish(obj, target, error)


def _arg_batches(paths: list[str], max_files: int, max_arg_bytes: int = 128 * 1024) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for p in paths:
        n = len(p.encode()) + 1
        if batch and (len(batch) >= max_files or size + n > max_arg_bytes):
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += n
    if batch:
        yield batch


def hsm_restore(paths: list[str], *, batch_size: int = 500, poll_s: float = 2.0, timeout_s: float = 6 * 3600,
                progress: StageProgress | None = None) -> int:
    """Preload FSx files linked to S3 (data repository association): ``lfs hsm_restore`` in batches of
    at most ``batch_size`` files, waiting for each batch (``lfs hsm_state`` no longer says
    ``released``) before the next, so the file system's HSM queue stays bounded. Returns the number of
    files that had to be restored."""
    lfs = shutil.which("lfs")
    if lfs is None:
        raise StageError("`lfs` (the Lustre client) was not found on PATH: FSx data repository association mode "
                         "(--fsx-dra) preloads files with `lfs hsm_restore`, so run it where the FSx file system "
                         "is mounted with the Lustre client installed, or stage without --fsx-dra to copy from S3")

    def released(batch: list[str]) -> list[str]:
        out = subprocess.run([lfs, "hsm_state", *batch], check=True, capture_output=True, text=True).stdout
        # "<path>: (0x0000000d) released exists archived, archive_id:1"
        return [line.rsplit(": (", 1)[0] for line in out.splitlines()
                if ": (" in line and "released" in line.rsplit(": (", 1)[1].split(",")[0].split()]

    restored = 0
    deadline = time.monotonic() + timeout_s
    for batch in _arg_batches(paths, batch_size):
        pending = released(batch)
        if pending:
            subprocess.run([lfs, "hsm_restore", *pending], check=True, capture_output=True, text=True)
            restored += len(pending)
        while pending:
            if time.monotonic() > deadline:
                raise StageError(f"hsm_restore did not finish in {timeout_s:.0f}s; {len(pending)} files still "
                                 f"released, e.g. {pending[0]}")
            time.sleep(poll_s)
            pending = released(pending)
        if progress is not None:
            progress.advance(files=len(batch))
    return restored


# ------------------------------------------------------------------------------------------- core
def stage_dataset(
    source: str,
    fsx_root: str | Path,
    name: str,
    version: str,
    endpoint_url: str | None = None,
    *,
    max_concurrency: int = 32,
    multipart_threshold: int = 16 * MB,
    multipart_chunksize: int = 16 * MB,
    retry_mode: str = "standard",
    max_attempts: int = 10,
    verify_etag: bool = True,
    val_percent: int = 5,
    fsx_dra: bool = False,
    hsm_batch_size: int = 500,
    hsm_poll_s: float = 2.0,
    progress: StageProgress | None = None,
) -> StageResult:
    """Stage ``source`` into ``<fsx_root>/datasets/<name>/<version>/`` and build the dataset there.

    Args:
        source: ``s3://bucket/prefix`` (AWS or ``endpoint_url``) or a local directory.
        fsx_root: the FSx mount (a local directory outside the cluster).
        name: dataset name (one path component).
        version: dataset version (one path component).
        endpoint_url: S3-compatible endpoint; None for AWS. Credentials come from the standard chain.
        max_concurrency: parallel GETs of small objects, and as many again of parts of large objects.
        multipart_threshold: objects at least this large (bytes) are fetched with parallel ranged GETs.
        multipart_chunksize: size of one ranged GET (bytes).
        retry_mode: botocore retry mode: ``standard`` (backoff with jitter) or ``adaptive`` (also slows the
            client down after throttling; see ``s3_client``).
        max_attempts: attempts per request, first try included.
        verify_etag: compare the MD5 of single-part objects with their ETag (turn off for SSE-KMS buckets).
        val_percent: share of files, by path hash, in the validation split.
        fsx_dra: ``raw/`` is linked to the bucket by an FSx data repository association: preload its files
            with ``lfs hsm_restore`` instead of copying.
        hsm_batch_size: files per ``lfs hsm_restore`` call in that mode.
        hsm_poll_s: seconds between ``lfs hsm_state`` checks while a batch is being restored.
        progress: receives file and byte counts as the stage advances.

    Returns:
        What was staged, skipped, refused and built. Refused keys are reported, not raised.

    Raises:
        ValueError: bad arguments (nothing was written).
        StageError: the source could not be listed, or objects failed (no manifest was written; rerun to
            resume), or the dataset could not be built.
    """
    t_start = time.monotonic()
    bucket, prefix = parse_source(source)
    dest = dataset_dir(fsx_root, name, version)
    if retry_mode not in ("adaptive", "standard", "legacy"):
        raise ValueError(f"retry_mode must be adaptive, standard or legacy, got {retry_mode!r}")
    if max_concurrency < 1 or max_attempts < 1:
        raise ValueError("max_concurrency and max_attempts must be at least 1")
    raw = dest / "raw"
    uri = f"s3://{bucket}/{prefix}" if bucket else prefix
    result = StageResult(source=uri, dataset_dir=str(dest))

    if fsx_dra:
        return _stage_dra(uri, dest, raw, result, val_percent, hsm_batch_size, hsm_poll_s, progress, t_start)

    # ---- the first page of the listing before anything is written: a wrong bucket or endpoint, or a
    # missing permission, fails here
    if bucket:
        from botocore.exceptions import BotoCoreError, ClientError

        list_errors: tuple = (BotoCoreError, ClientError)
        client = s3_client(endpoint_url, retry_mode=retry_mode, max_attempts=max_attempts,
                           max_pool_connections=2 * max_concurrency + 4)
        pages = _pages_s3(client, bucket, prefix)
        refused: list[dict] = []
    else:
        list_errors = ()
        listed, refused = _list_local(prefix)
        pages = iter([listed])
    try:
        first = next(pages, [])
    except list_errors as e:
        raise StageError(f"cannot list {uri}: {e}") from e
    if not first and not refused:
        raise StageError(f"nothing to stage: {uri} is empty", result)

    dest.mkdir(parents=True, exist_ok=True)
    state = dest / STAGE_DIR
    state.mkdir(exist_ok=True)
    with _Lock(state / "lock"):
        tmp_dir = state / "tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)    # temp files of an interrupted run
        tmp_dir.mkdir()
        raw.mkdir(exist_ok=True)
        known = _load_known(dest)
        journal = _Journal(state / JOURNAL)
        finisher = _Finisher(raw, journal, result, progress, verify_etag)
        objects: list[_Object] = []
        submitted: set[str] = set()
        if progress is not None:
            progress.start(None, None)
        downloads = (_s3_downloads(client, bucket, tmp_dir, finisher, progress, max_concurrency=max_concurrency,
                                   multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize)
                     if bucket else _local_copies(prefix, tmp_dir, finisher, progress))
        try:
            # ---- list, check each key, and start fetching what is missing or changed while listing goes on
            # (aws s3 sync overlaps the two the same way); a page of 1000 keys takes a while on big prefixes.
            with downloads as submit:
                try:
                    for page in itertools.chain([first], pages):
                        for key, size, etag in page:
                            rel = key[len(prefix):] if bucket else key
                            reason = unsafe_reason(rel, raw)
                            if reason:
                                refused.append({"key": key, "reason": reason})
                                continue
                            obj = _Object(key, rel, size, etag)
                            objects.append(obj)
                            k = known.get(rel)
                            if not (k and k.get("etag") == etag and k.get("size") == size
                                    and _size_on_disk(os.path.join(raw, rel)) == size):
                                submitted.add(rel)
                                submit(obj)
                except list_errors as e:
                    raise StageError(f"cannot list {uri}: {e}") from e
                result.list_s = round(time.monotonic() - t_start, 3)
                # Every key is known: refuse collisions, remove what left the source, then let files into raw/.
                objects, collisions = _refuse_collisions(objects)
                result.refused = refused + collisions
                for r in result.refused:
                    log.warning("refused %r: %s", r["key"], r["reason"])
                wanted = {o.rel for o in objects}
                result.removed = _remove_stale(raw, wanted)
                finisher.release(drop={c["key"][len(prefix):] if bucket else c["key"] for c in collisions})
                todo = [o for o in objects if o.rel in submitted]
                result.objects = len(objects)
                result.skipped_unchanged = len(objects) - len(todo)
                if progress is not None:
                    progress.start(len(todo), sum(o.size for o in todo))
            # Leaving the block waited for every transfer.
        finally:
            journal.close()
            shutil.rmtree(tmp_dir, ignore_errors=True)
        result.transfer_s = round(time.monotonic() - t_start - result.list_s, 3)
        refused_keys = {r["key"] for r in result.refused}
        result.failed = [f for f in result.failed if f["key"] not in refused_keys]
        if not objects:
            raise StageError(f"nothing to stage under {uri} ({len(result.refused)} keys refused)", result)
        if result.failed:
            result.wall_s = round(time.monotonic() - t_start, 3)
            first_errors = "; ".join(f"{f['key']}: {f['error']}" for f in result.failed[:3])
            raise StageError(f"{len(result.failed)} of {len(todo)} objects failed ({first_errors}); no manifest "
                             f"was written - rerun to resume (verified objects are kept)", result)

        # ---- build the dataset (skipped when nothing changed since the manifest was written)
        objects_map = {o.rel: {"key": o.key, "etag": o.etag, "size": o.size} for o in sorted(objects)}
        extra = {"objects": objects_map, "stage": {"val_percent": val_percent, "refused": result.refused}}
        _build(dest, raw, [o.rel for o in objects], uri, val_percent, extra, result)
        (state / JOURNAL).unlink(missing_ok=True)     # the manifest now records every object
    result.wall_s = round(time.monotonic() - t_start, 3)
    return result


def _size_on_disk(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _remove_stale(raw: Path, wanted: set[str]) -> int:
    """Delete files under raw/ whose object is no longer in the source (or is now refused), then the
    directories that left empty (a key may now need that path for a file)."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(raw, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.relpath(path, raw).replace(os.sep, "/") not in wanted:
                os.unlink(path)
                removed += 1
        if dirpath != str(raw) and not os.listdir(dirpath):
            os.rmdir(dirpath)
    return removed


def _build(dest: Path, raw: Path, rels: list[str], uri: str, val_percent: int, extra: dict,
           result: StageResult) -> None:
    """Build the dataset from ``raw/<rel>`` files, or keep the manifest when none of its inputs changed."""
    t0 = time.monotonic()
    previous = None
    try:
        previous = json.loads((dest / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    unchanged = (previous is not None and result.transferred == 0 and result.removed == 0
                 and previous.get("source") == uri
                 and all(previous.get(k) == v for k, v in extra.items()))
    if unchanged:
        manifest = previous
    else:
        from trainer.data import build_dataset     # numpy: not needed when nothing changed

        files = [raw / rel for rel in rels]
        try:
            manifest = build_dataset(raw, dest, files=files, source=uri, val_percent=val_percent, extra=extra)
        except ValueError as e:
            raise StageError(f"staged {len(files)} files, but the dataset cannot be built: {e}", result) from e
        result.rebuilt = True
    result.files = len(manifest["files"])
    result.train_tokens = manifest["splits"]["train"]["tokens"]
    result.val_tokens = manifest["splits"]["val"]["tokens"]
    result.build_s = round(time.monotonic() - t0, 3)


def _stage_dra(uri: str, dest: Path, raw: Path, result: StageResult, val_percent: int, batch_size: int,
               poll_s: float, progress: StageProgress | None, t_start: float) -> StageResult:
    """Data repository association: raw/ is linked to the bucket; preload it, then build."""
    if not raw.is_dir():
        raise StageError(f"--fsx-dra: {raw} does not exist; create a data repository association that links "
                         f"it to {uri} first")
    listed, refused = _list_local(str(raw))
    result.refused = refused
    result.objects = len(listed)
    result.list_s = round(time.monotonic() - t_start, 3)
    if not listed:
        raise StageError(f"--fsx-dra: {raw} holds no files; is the association's import done?", result)
    if progress is not None:
        progress.start(len(listed), 0)
    t0 = time.monotonic()
    result.restored = hsm_restore([str(raw / rel) for rel, _, _ in listed], batch_size=batch_size,
                                  poll_s=poll_s, progress=progress)
    result.transfer_s = round(time.monotonic() - t0, 3)
    objects_map = {rel: {"key": rel, "etag": etag, "size": size} for rel, size, etag in listed}
    extra = {"objects": objects_map, "stage": {"val_percent": val_percent, "refused": refused, "mode": "dra"}}
    _build(dest, raw, [rel for rel, _, _ in listed], uri, val_percent, extra, result)
    result.wall_s = round(time.monotonic() - t_start, 3)
    return result
