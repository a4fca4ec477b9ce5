"""Stage a dataset from S3 (or a local directory) onto FSx and build the trainer's dataset there.

Layout of a staged dataset, ``<fsx_root>/datasets/<name>/<version>/``::

    raw/<key relative to the prefix>   the source objects, byte for byte
    tokenizer/tokenizer.json           the tokenizer, unless it is ``bytes`` (``components.stage.tokenizer``)
    manifest.json                      the trainer's manifest (written last) + ``objects``: key, ETag, size
    train_00000.bin, val_00000.bin     token shards, one per pack and split (``components.stage.tokens``)
    .stage/                            journal of verified objects, temp files, lock (private to staging)

Documents are read from plain text, JSONL (plain, gzip, zstd) or Parquet files (``components.stage.formats``;
bad records are counted per file under ``bad_record_policy``) and tokenized on every core. The fan-out
across pods is ``components.stage.fanout``. ``docs/datasets.md`` describes the parameters and the manifest.

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

The KFP component is ``components.stage.dataset_op.stage_op``; this module imports no kfp (and no torch), so the
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
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterator, NamedTuple, Protocol

from components.s3 import s3_client
from components.stage.formats import BadFile, detect_format, read_documents
from components.stage.splits import DATASET_INFOS, README, SplitPlan, resolve_splits
from components.stage.tokens import (
    BAD_RECORD_POLICIES, BATCH_BYTES, PACK_BYTES, BadRecordsError, ReadConfig, dataset_manifest, plan_packs,
    tokenize_packs, worker_allocator)
from components.stage.tokenizer import (TokenizerInfo, TokenizerSpec, check_tokenizer_source, parse_tokenizer,
                                        stage_tokenizer)
from trainer.durable import move, rename_unsynced, write_bytes
from trainer.layout import MANIFEST, dataset_dir
from trainer.s3url import is_s3_url, parse_s3_url

log = logging.getLogger(__name__)

STAGE_DIR = ".stage"
JOURNAL = "journal.jsonl"
PREVIOUS_MANIFEST = "previous-manifest.json"
NAME_MAX = 255        # bytes in one path component (Linux, Lustre)
PATH_MAX = 4096       # bytes in a whole path
MB = 1024 * 1024
CHUNK = MB           # bytes per read of an object body
MIN_BATCH_BYTES = 4096


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
        """Files finished and bytes received since the last call (from several threads); once ``tokenizing``
        was called, files tokenized."""

    def tokenizing(self, files: int) -> None:
        """Called once the transfers are done, before ``files`` files are tokenized."""


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
    excluded: int = 0              # objects left out by the include/exclude globs (never downloaded)
    refused: list[dict] = field(default_factory=list)   # {"key", "reason"}: never written
    failed: list[dict] = field(default_factory=list)    # {"key", "error"}
    files: int = 0                 # files in the dataset (those refused whole by a bad record included)
    train_tokens: int = 0
    val_tokens: int = 0
    token_dtype: str = ""
    vocab_size: int = 0
    tokenizer: dict = field(default_factory=dict)       # the manifest's tokenizer entry
    bad_records: dict = field(default_factory=dict)     # the manifest's bad_records: total, by_kind, files
    split_source: dict = field(default_factory=dict)    # the manifest's split_source: how the splits were found
    rebuilt: bool = False          # False: nothing changed, the existing manifest was kept
    list_s: float = 0.0
    transfer_s: float = 0.0
    build_s: float = 0.0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.refused and not self.failed and not (self.bad_records or {}).get("total")

    def to_dict(self) -> dict:
        return asdict(self)


class StagedObject(NamedTuple):
    key: str        # the source key (or path relative to a local source)
    rel: str        # path under raw/
    size: int
    etag: str       # S3 ETag without quotes; "local:<mtime_ns>" for a local source


# --------------------------------------------------------------------------------------- helpers
def parse_source(source: str) -> tuple[str | None, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix with a trailing slash or ""); a directory -> (None, path)."""
    if is_s3_url(source):
        url = parse_s3_url(source, "source")
        return url.bucket, url.prefix
    if "://" in source:
        raise ValueError(f"{source!r}: unsupported source; use s3://BUCKET/PREFIX or a local directory")
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"source directory {source!r} does not exist")
    return None, str(path.resolve())


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


def _refuse_collisions(objects: list[StagedObject]) -> tuple[list[StagedObject], list[dict]]:
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
    """rel -> {key, etag, size} of objects already verified in place: previous manifest, then the journals
    (the stage's own and those of fan-out workers)."""
    known: dict[str, dict] = dict((read_previous_manifest(dest) or {}).get("objects", {}))
    state = dest / STAGE_DIR
    for journal in sorted([state / JOURNAL, *state.glob(f"*/{JOURNAL}")]):
        if not journal.exists():
            continue
        for line in journal.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue          # a line torn by the interruption
            known[rec.pop("rel")] = rec
    return known


class StageLock:
    """One stage at a time per dataset directory (flock; not every file system supports it)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self) -> "StageLock":
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

    def record(self, obj: StagedObject) -> None:
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
        self.held: list[tuple[StagedObject, _Target]] | None = []
        self.drop: set[str] = set()

    def target(self, obj: StagedObject, tmp: str) -> _Target:
        return _Target(tmp, self.verify_etag and _is_md5_etag(obj.etag))

    def finish(self, obj: StagedObject, target: _Target, error: BaseException | None) -> None:
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

    def _place(self, obj: StagedObject, target: _Target) -> None:
        final = os.path.join(self.raw, obj.rel)
        parent = os.path.dirname(final)
        if parent not in self.made_dirs:
            os.makedirs(parent, exist_ok=True)
            self.made_dirs.add(parent)
        rename_unsynced(target.path, final)     # made to count by the journal and the manifest
        self.journal.record(obj)
        with self.lock:
            self.result.transferred += 1
            self.result.transferred_bytes += obj.size

    def _fail(self, obj: StagedObject, target: _Target, e: BaseException) -> None:
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
        def __init__(self, obj: StagedObject, target: _Target):
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

    def transfer(obj: StagedObject, tmp: str) -> None:
        target = finisher.target(obj, tmp)
        manager.download(bucket, obj.key, target, subscribers=[Subscriber(obj, target)])

    def get(obj: StagedObject, tmp: str) -> None:
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

        def submit(obj: StagedObject) -> None:
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
    todo: list[StagedObject] = []
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
@dataclass(frozen=True)
class DatasetSettings:
    """What turns staged files into the dataset's tokens; recorded in the manifest (``stage.settings``), so
    changing any of them rebuilds the dataset."""

    tokenizer: str = "bytes"             # see components.stage.tokenizer
    data_format: str = "auto"            # auto (by file name) | text | jsonl | parquet
    text_field: str = "text"             # JSONL field holding a document
    text_column: str = "text"            # Parquet column holding a document
    include: tuple[str, ...] = ()        # globs of paths under the source to stage (none: all)
    exclude: tuple[str, ...] = ()        # globs of paths to leave out
    val_percent: int = 5                 # share of documents (by key hash) in validation, when the source has no split
    bad_record_policy: str = "skip"      # skip (leave out, count, report) | fail (stop the stage)
    bpe_sample_bytes: int = 256 * MB     # source bytes of training files a bpe: tokenizer is trained on
    pack_bytes: int = PACK_BYTES         # source bytes per pack of shards (see components.stage.tokens)
    train_glob: tuple[str, ...] = ()     # globs of the training split's files (components.stage.splits)
    val_glob: tuple[str, ...] = ()       # globs of the validation split's files
    batch_bytes: int = BATCH_BYTES       # text a tokenizer process holds at once: a batch, or a long document's piece
    val_tokens: int = 0                  # a validation budget in tokens, in place of val_percent (stage_budget)

    def check(self) -> TokenizerSpec:
        """ValueError for a bad setting (before anything is written); the parsed tokenizer."""
        detect_format("x", self.data_format)
        if self.bad_record_policy not in BAD_RECORD_POLICIES:
            raise ValueError(f"bad_record_policy must be skip or fail, got {self.bad_record_policy!r}")
        if not 0 <= self.val_percent <= 50:
            raise ValueError(f"val_percent must be between 0 and 50, got {self.val_percent}")
        if self.pack_bytes < 1 or self.bpe_sample_bytes < 1:
            raise ValueError("pack_bytes and bpe_sample_bytes must be positive")
        if self.batch_bytes < MIN_BATCH_BYTES:
            raise ValueError(f"batch_bytes must be at least {MIN_BATCH_BYTES}, got {self.batch_bytes}")
        if self.val_tokens < 0:
            raise ValueError(f"val_tokens must be 0 (use val_percent) or a number of tokens, got {self.val_tokens}")
        return parse_tokenizer(self.tokenizer)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("include", "exclude", "train_glob", "val_glob"):
            d[name] = list(d[name])
        if not d["val_tokens"]:
            del d["val_tokens"]        # unset: the settings of datasets staged before it compare equal (no rebuild)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DatasetSettings":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @property
    def read(self) -> ReadConfig:
        return ReadConfig(self.data_format, self.text_field, self.text_column)


class StageRefused(StageError):
    """A policy refused the source (unsafe keys, bad records): a rerun fails the same way until the source
    or the policy changes, so it is not worth retrying."""


def split_globs(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"a,b"`` or ``["a", "b"]`` -> ``("a", "b")`` (the CLI and KFP pass comma-separated strings)."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    return tuple(p.strip() for p in items if p.strip())


def stage_dataset(
    source: str,
    fsx_root: str | Path,
    name: str,
    version: str,
    endpoint_url: str | None = None,
    *,
    tokenizer: str = "bytes",
    data_format: str = "auto",
    text_field: str = "text",
    text_column: str = "text",
    include: str | list[str] | tuple[str, ...] = (),
    exclude: str | list[str] | tuple[str, ...] = (),
    bad_record_policy: str = "skip",
    refused_key_policy: str = "fail",
    bpe_sample_bytes: int = 256 * MB,
    pack_bytes: int = PACK_BYTES,
    workers: int | None = None,
    max_concurrency: int = 32,
    multipart_threshold: int = 16 * MB,
    multipart_chunksize: int = 16 * MB,
    retry_mode: str = "standard",
    max_attempts: int = 10,
    verify_etag: bool = True,
    val_percent: int = 5,
    train_glob: str | list[str] | tuple[str, ...] = (),
    val_glob: str | list[str] | tuple[str, ...] = (),
    batch_bytes: int = BATCH_BYTES,
    val_tokens: int = 0,
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
        tokenizer: ``bytes``, a tokenizer.json / Hugging Face model directory / ``s3://`` location of one, or
            ``bpe:VOCAB`` (see ``components.stage.tokenizer``).
        data_format: ``auto`` (by file name: .jsonl[.gz|.zst], .parquet, else text), ``text``, ``jsonl``,
            ``parquet``.
        text_field: the JSONL field that holds a document's text.
        text_column: the Parquet column that holds it.
        include: globs (or one comma-separated string) of paths under the source to stage; empty: all.
        exclude: globs of paths to leave out (never downloaded).
        bad_record_policy: ``skip``: bad records are left out, counted per file and reported in the manifest
            and the result; ``fail``: the first file with one stops the stage (``StageRefused``, no manifest).
        refused_key_policy: ``fail``: a key that would land outside the destination stops the stage before
            anything is written (``StageRefused``); ``skip``: such keys are reported and left out.
        bpe_sample_bytes: a ``bpe:`` tokenizer is trained on the training files, in path order, up to this
            many source bytes.
        pack_bytes: source bytes per pack of shards.
        workers: tokenizer processes (default: one per core).
        max_concurrency: parallel GETs of small objects, and as many again of parts of large objects.
        multipart_threshold: objects at least this large (bytes) are fetched with parallel ranged GETs.
        multipart_chunksize: size of one ranged GET (bytes).
        retry_mode: botocore retry mode: ``standard`` (backoff with jitter) or ``adaptive`` (also slows the
            client down after throttling; see ``s3_client``).
        max_attempts: attempts per request, first try included.
        verify_etag: compare the MD5 of single-part objects with their ETag (turn off for SSE-KMS buckets).
        val_percent: when the source has no splits of its own: the share of documents in the validation
            split, drawn by a hash of each document's ``id`` (else its file's path and position); a plain text
            file is one document, drawn by its path. See ``components.stage.splits``.
        train_glob: globs (or one comma-separated string) of the training split's files; with ``val_glob``
            they override the source's own splits (files matching neither are left out).
        val_glob: globs of the validation split's files; given alone, every other file is training.
        batch_bytes: text a tokenizer process encodes at once, and the longest piece a document (or a JSONL
            line) is read in: a process's memory is a few times this, whatever a file's size or a
            document's length.
        val_tokens: when the source has no splits of its own: about this many tokens of documents in the
            validation split, in place of ``val_percent`` (which it overrides), drawn by the same hash against a
            share of documents chosen from the source's estimated tokens (``components.stage.budget``). A
            source with splits of its own is refused with it.
        fsx_dra: ``raw/`` is linked to the bucket by an FSx data repository association: preload its files
            with ``lfs hsm_restore`` instead of copying.
        hsm_batch_size: files per ``lfs hsm_restore`` call in that mode.
        hsm_poll_s: seconds between ``lfs hsm_state`` checks while a batch is being restored.
        progress: receives file and byte counts as the stage advances.

    Returns:
        What was staged, skipped, excluded, refused and built.

    Raises:
        ValueError: bad arguments (nothing was written).
        StageRefused: a policy refused the source (see ``refused_key_policy``, ``bad_record_policy``).
        StageError: the source could not be listed, or objects failed (no manifest was written; rerun to
            resume), or the dataset could not be built.
    """
    t_start = time.monotonic()
    settings = DatasetSettings(tokenizer, data_format, text_field, text_column, split_globs(include),
                               split_globs(exclude), val_percent, bad_record_policy, bpe_sample_bytes, pack_bytes,
                               split_globs(train_glob), split_globs(val_glob), batch_bytes, val_tokens)
    spec = settings.check()
    worker_allocator()                   # a bad GOODPUT_TOKENIZE_MALLOC fails here, not after the downloads
    if refused_key_policy not in ("skip", "fail"):
        raise ValueError(f"refused_key_policy must be skip or fail, got {refused_key_policy!r}")
    bucket, prefix = parse_source(source)
    dest = dataset_dir(fsx_root, name, version)
    if retry_mode not in ("adaptive", "standard", "legacy"):
        raise ValueError(f"retry_mode must be adaptive, standard or legacy, got {retry_mode!r}")
    if max_concurrency < 1 or max_attempts < 1:
        raise ValueError("max_concurrency and max_attempts must be at least 1")
    check_tokenizer_source(spec, endpoint_url)
    raw = dest / "raw"
    uri = f"s3://{bucket}/{prefix}" if bucket else prefix
    result = StageResult(source=uri, dataset_dir=str(dest))
    build = DatasetBuilder(dest, uri, settings, spec, endpoint_url, workers, result)

    if fsx_dra:
        return _stage_dra(uri, dest, raw, result, build, hsm_batch_size, hsm_poll_s, progress, t_start)

    # ---- the first page of the listing before anything is written: a wrong bucket or endpoint, or a
    # missing permission, fails here
    source_of = Source(bucket, prefix, endpoint_url, retry_mode, max_attempts, max_concurrency,
                       multipart_threshold, multipart_chunksize, verify_etag)
    pages = source_of.pages(settings, result)
    try:
        first = next(pages, [])
    except source_of.list_errors as e:
        raise StageError(f"cannot list {uri}: {e}") from e
    if refused_key_policy == "fail":
        # The whole listing first: a refused key stops the stage before anything is written.
        try:
            listed = [first, *pages]
        except source_of.list_errors as e:
            raise StageError(f"cannot list {uri}: {e}") from e
        _, refused = check_keys([o for page in listed for o in page], raw, prefix if bucket else "")
        refused = unique_refused(source_of.refused + refused)
        if refused:
            result.refused = refused
            log_refused(refused)
            raise StageRefused(refused_message(refused, uri), result)
        if not any(listed):
            raise StageError(f"nothing to stage: {uri} is empty" + (
                f" ({result.excluded} objects excluded by include/exclude)" if result.excluded else ""), result)
        first, pages = [], iter(listed)
    elif not first and not source_of.refused and not result.excluded:
        raise StageError(f"nothing to stage: {uri} is empty", result)     # an empty first page: nothing listed

    dest.mkdir(parents=True, exist_ok=True)
    state = dest / STAGE_DIR
    state.mkdir(exist_ok=True)
    with StageLock(state / "lock"):
        objects = sync_raw(source_of, itertools.chain([first], pages), raw, state, dest, result, progress,
                           remove_stale=True, t_start=t_start)
        log_refused(result.refused)
        if not objects:
            raise StageError(f"nothing to stage under {uri} ({len(result.refused)} keys refused, "
                             f"{result.excluded} excluded by include/exclude)", result)
        build.run(objects, state, progress)
        (state / JOURNAL).unlink(missing_ok=True)     # the manifest now records every object
    result.wall_s = round(time.monotonic() - t_start, 3)
    return result


def refused_message(refused: list[dict], uri: str) -> str:
    first = refused[0]
    return (f"{len(refused)} keys under {uri} were refused ({refused_counts(refused)}), e.g. "
            f"{shorten(repr(first['key']), 80)}; nothing was staged. Rename or remove them at the source, or "
            f"stage with refused_key_policy=skip to leave them out (not retryable: the same source fails the same "
            f"way)")


def unique_refused(refused: list[dict]) -> list[dict]:
    """Each refused key once (its first reason), in the order they were found."""
    return list({r["key"]: r for r in reversed(refused)}.values())[::-1]


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters in the middle (head…tail): both ends of a key tell which it is."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def refused_counts(refused: list[dict]) -> str:
    """``2 '..' component would escape the destination, 1 absolute path``: refused keys by reason, most first."""
    return ", ".join(f"{n} {reason}" for reason, n in Counter(r["reason"] for r in refused).most_common())


def refusal_lines(refused: list[dict], width: int = 120, limit: int = 50) -> list[str]:
    """One line per refused key (the first ``limit``), the key shortened so that the line fits ``width``."""
    lines, refused = [], unique_refused(refused)
    for r in refused[:limit]:
        room = max(40, width - len("refused : ") - len(r["reason"]))    # a short key is never cut
        lines.append(f"refused {shorten(repr(r['key']), room)}: {r['reason']}")
    if len(refused) > limit:
        lines.append(f"... and {len(refused) - limit} more refused keys")
    return lines


def log_refused(refused: list[dict]) -> None:
    # INFO: the step's log (KFP logs INFO) lists them once; the CLI prints its own lines, not these.
    for line in refusal_lines(refused):
        log.info("%s", line)


def check_keys(listed: list[tuple[str, int, str]], raw: Path, prefix: str) -> tuple[list[StagedObject], list[dict]]:
    """Unsafe keys and keys that are also directories of others are refused; the rest become objects."""
    objects, refused, seen = [], [], set()
    for key, size, etag in listed:
        if key in seen:
            continue
        seen.add(key)
        rel = key[len(prefix):]
        reason = unsafe_reason(rel, raw)
        if reason:
            refused.append({"key": key, "reason": reason})
        else:
            objects.append(StagedObject(key, rel, size, etag))
    objects, collisions = _refuse_collisions(objects)
    return objects, refused + collisions


class Source:
    """Listing and fetching of one source (S3 or a directory), with the include/exclude filter."""

    def __init__(self, bucket: str | None, prefix: str, endpoint_url: str | None, retry_mode: str, max_attempts: int,
                 max_concurrency: int, multipart_threshold: int, multipart_chunksize: int, verify_etag: bool):
        self.bucket, self.prefix, self.verify_etag = bucket, prefix, verify_etag
        self.transfer = dict(max_concurrency=max_concurrency, multipart_threshold=multipart_threshold,
                             multipart_chunksize=multipart_chunksize)
        self.refused: list[dict] = []
        self.list_errors: tuple = ()
        self.client = None
        if bucket:
            from botocore.exceptions import BotoCoreError, ClientError

            self.list_errors = (BotoCoreError, ClientError)
            self.client = s3_client(endpoint_url, retry_mode=retry_mode, max_attempts=max_attempts,
                                    max_pool_connections=2 * max_concurrency + 4)

    def key_prefix(self) -> str:
        return self.prefix if self.bucket else ""

    def pages(self, settings: DatasetSettings, result: StageResult) -> Iterator[list[tuple[str, int, str]]]:
        """Listed (key, size, ETag) per page, include/exclude applied (``result.excluded`` counts the rest)."""
        from components.stage.formats import matches

        if self.bucket:
            raw_pages = _pages_s3(self.client, self.bucket, self.prefix)
        else:
            listed, self.refused = _list_local(self.prefix)
            raw_pages = iter([listed])
        cut = len(self.key_prefix())
        for page in raw_pages:
            kept = [o for o in page if matches(o[0][cut:], settings.include, settings.exclude)]
            result.excluded += len(page) - len(kept)
            yield kept

    def downloads(self, tmp_dir: Path, finisher: "_Finisher", progress: StageProgress | None):
        if self.bucket:
            return _s3_downloads(self.client, self.bucket, tmp_dir, finisher, progress, **self.transfer)
        return _local_copies(self.prefix, tmp_dir, finisher, progress)


def sync_raw(source: Source, pages: Iterator[list[tuple[str, int, str]]], raw: Path, state: Path, dest: Path,
             result: StageResult, progress: StageProgress | None, *, remove_stale: bool,
             t_start: float) -> list[StagedObject]:
    """Bring ``raw/`` in line with the listed objects; return the objects staged (refused ones excluded).

    ``state`` holds this sync's temp files and journal (a fan-out worker has its own). With
    ``remove_stale`` (a whole-source sync) files whose object left the source are removed from ``raw/``.
    Raises StageError when objects failed (verified ones are kept for the rerun).
    """
    tmp_dir = state / "tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)    # temp files of an interrupted run
    tmp_dir.mkdir(parents=True)
    raw.mkdir(exist_ok=True)
    known = _load_known(dest)
    journal = _Journal(state / JOURNAL)
    finisher = _Finisher(raw, journal, result, progress, source.verify_etag)
    objects: list[StagedObject] = []
    seen: set[str] = set()               # a key the listing yields again is the same object: once is enough
    submitted: dict[str, int] = {}       # rel -> size of every download started (the progress's totals)
    refused: list[dict] = list(source.refused)
    cut = source.key_prefix()
    if progress is not None:
        progress.start(None, None)
    try:
        # ---- list, check each key, and start fetching what is missing or changed while listing goes on
        # (aws s3 sync overlaps the two the same way); a page of 1000 keys takes a while on big prefixes.
        with source.downloads(tmp_dir, finisher, progress) as submit:
            try:
                for page in pages:
                    for key, size, etag in page:
                        if key in seen:
                            continue
                        seen.add(key)
                        rel = key[len(cut):]
                        reason = unsafe_reason(rel, raw)
                        if reason:
                            refused.append({"key": key, "reason": reason})
                            continue
                        obj = StagedObject(key, rel, size, etag)
                        objects.append(obj)
                        k = known.get(rel)
                        if not (k and k.get("etag") == etag and k.get("size") == size
                                and size_on_disk(os.path.join(raw, rel)) == size):
                            submitted[rel] = size
                            submit(obj)
            except source.list_errors as e:
                raise StageError(f"cannot list the source: {e}") from e
            result.list_s = round(time.monotonic() - t_start, 3)
            # Every key is known: refuse collisions, remove what left the source, then let files into raw/.
            objects, collisions = _refuse_collisions(objects)
            result.refused = unique_refused(refused + collisions)
            if remove_stale:
                result.removed = remove_stale_files(raw, {o.rel for o in objects})
            finisher.release(drop={c["key"][len(cut):] for c in collisions})
            todo = [o for o in objects if o.rel in submitted]
            result.objects = len(objects)
            result.skipped_unchanged = len(objects) - len(todo)
            if progress is not None:
                # Every download started is finished once (placed, failed, or dropped as a collision found
                # at the end of the listing), so that is the total: never passed, always reached.
                progress.start(len(submitted), sum(submitted.values()))
        # Leaving the block waited for every transfer.
    finally:
        journal.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    result.transfer_s = round(time.monotonic() - t_start - result.list_s, 3)
    refused_keys = {r["key"] for r in result.refused}
    result.failed = [f for f in result.failed if f["key"] not in refused_keys]
    if result.failed:
        result.wall_s = round(time.monotonic() - t_start, 3)
        first_errors = "; ".join(f"{f['key']}: {f['error']}" for f in result.failed[:3])
        raise StageError(f"{len(result.failed)} of {len(todo)} objects failed ({first_errors}); no manifest "
                         f"was written - rerun to resume (verified objects are kept)", result)
    return sorted(objects)


def size_on_disk(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def remove_stale_files(raw: Path, wanted: set[str]) -> int:
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


def read_previous_manifest(dest: Path) -> dict | None:
    """The dataset's manifest, or the one a rebuild in progress set aside (``.stage/previous-manifest.json``)."""
    for path in (dest / MANIFEST, dest / STAGE_DIR / PREVIOUS_MANIFEST):
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return None


def retire_manifest(dest: Path) -> None:
    """Before any shard is rewritten: the old manifest leaves (a directory with a manifest is complete), kept
    aside so that its object records still let a rerun skip unchanged objects."""
    if (dest / MANIFEST).exists():
        (dest / STAGE_DIR).mkdir(exist_ok=True)
        move(dest / MANIFEST, dest / STAGE_DIR / PREVIOUS_MANIFEST)


def remove_unlisted_shards(dest: Path, manifest: dict) -> None:
    """Shards an earlier build left that the new manifest does not list (another pack layout)."""
    keep = {s["path"] for split in manifest["splits"].values() for s in split["shards"]}
    for p in dest.glob("*.bin"):
        if p.name not in keep and p.name.startswith(("train_", "val_")):
            p.unlink()


def manifest_extra(objects: list[StagedObject], settings: DatasetSettings, refused: list[dict],
                   mode: str | None = None) -> dict:
    """The manifest's record of the source objects and the stage's settings (what a rerun compares)."""
    stage = {"settings": settings.to_dict(), "refused": refused, **({"mode": mode} if mode else {})}
    return {"objects": {o.rel: {"key": o.key, "etag": o.etag, "size": o.size} for o in sorted(objects)},
            "stage": stage}


def split_plan(dest: Path, objects: list[StagedObject], settings: DatasetSettings) -> SplitPlan:
    """Each staged file's split (``components.stage.splits``), from the globs, the dataset card or
    ``dataset_infos.json`` in ``raw/`` (fetched before this is called), the file names, or by document."""
    rels = sorted(o.rel for o in objects)

    def card(name: str) -> bytes | None:
        path = dest / "raw" / name
        return path.read_bytes() if name in rels and path.is_file() else None

    return resolve_splits(rels, train_glob=settings.train_glob, val_glob=settings.val_glob,
                          val_percent=settings.val_percent, data_format=settings.data_format,
                          readme=card(README), dataset_infos=card(DATASET_INFOS), val_tokens=settings.val_tokens)


class DatasetBuilder:
    """Tokenizes the staged files into shards and writes the manifest, or keeps the manifest when nothing
    that goes into it changed."""

    def __init__(self, dest: Path, uri: str, settings: DatasetSettings, spec: TokenizerSpec,
                 endpoint_url: str | None, workers: int | None, result: StageResult):
        self.dest, self.uri, self.settings, self.spec = dest, uri, settings, spec
        self.endpoint_url, self.workers, self.result = endpoint_url, workers, result

    def bpe_sample(self, objects: list[StagedObject], plan: SplitPlan | None = None) -> list[StagedObject]:
        """The files a ``bpe:`` tokenizer learns from, in path order, up to bpe_sample_bytes: files of the
        training split or split by document (their validation documents are skipped); with ``plan`` None
        (the card is not fetched yet) every file that may be one."""
        sample, size = [], 0
        for o in sorted(objects):
            if plan is None or plan.rules.get(o.rel) in ("train", "documents"):
                if not sample or size + o.size <= self.settings.bpe_sample_bytes:
                    sample.append(o)
                    size += o.size
        return sample

    def tokenizer(self, objects: list[StagedObject], plan: SplitPlan) -> TokenizerInfo:
        """Stage the tokenizer next to the dataset (training it first for ``bpe:``, on training documents)."""
        from components.stage.splits import document_split, val_threshold

        raw = self.dest / "raw"
        # With val_tokens the threshold is chosen with this tokenizer (stage_budget): it learns from every document
        # of the sample.
        read = self.settings.read
        threshold = 0 if self.settings.val_tokens else val_threshold(self.settings.val_percent)

        def documents() -> Iterator[str]:
            for o in self.bpe_sample(objects, plan):
                by_document, keep = plan.rules[o.rel] == "documents", None
                try:
                    for piece in read_documents(raw / o.rel, detect_format(o.rel, read.data_format), rel=o.rel,
                                                text_field=read.text_field, text_column=read.text_column,
                                                bad=Counter(), piece_bytes=self.settings.batch_bytes):
                        if keep is None:          # a document starts
                            keep = not by_document or document_split(piece.key, threshold) == "train"
                        if keep and piece.text:
                            yield piece.text
                        if piece.last:
                            keep = None
                except BadFile:
                    continue         # counted when the file is tokenized

        try:
            return stage_tokenizer(self.spec, self.dest, endpoint_url=self.endpoint_url, documents=documents())
        except ValueError as e:
            raise StageError(str(e), self.result) from e

    def check_budget(self, plan: SplitPlan) -> None:
        """StageError when ``val_tokens`` is set and the source has splits of its own (before anything changes)."""
        by = plan.source["by"]
        if self.settings.val_tokens and by != "document":
            raise StageError(f"val_tokens={self.settings.val_tokens} applies to a source split by document, but "
                             f"this one's splits come from its {by} (see split_source); stage without val_tokens",
                             self.result)

    def budgeted(self, plan: SplitPlan, objects: list[StagedObject], info: TokenizerInfo) -> SplitPlan:
        """``plan`` with the threshold of the ``val_tokens`` budget (``components.stage.budget``); as it is
        without one. StageError when the budget does not fit."""
        from components.stage.budget import budget_plan

        if not self.settings.val_tokens:
            return plan
        self.check_budget(plan)
        try:
            return budget_plan(plan, self.dest / "raw", objects, val_tokens=self.settings.val_tokens,
                               read=self.settings.read, tokenizer=info, tokenizer_dir=self.dest,
                               piece_bytes=self.settings.batch_bytes)
        except ValueError as e:
            raise StageError(str(e), self.result) from e

    def run(self, objects: list[StagedObject], state: Path, progress: StageProgress | None,
            mode: str | None = None) -> None:
        t0 = time.monotonic()
        result = self.result
        extra = manifest_extra(objects, self.settings, result.refused, mode)
        previous = read_previous_manifest(self.dest)
        unchanged = (previous is not None and (self.dest / MANIFEST).exists() and result.transferred == 0
                     and result.removed == 0 and previous.get("source") == self.uri
                     and all(previous.get(k) == v for k, v in extra.items()))
        plan = split_plan(self.dest, objects, self.settings)
        self.check_budget(plan)
        if unchanged and self.spec.kind == "file":
            # The file may have changed where it came from: fetch it again, and compare.
            unchanged = self.tokenizer(objects, plan).sha256 == (previous.get("tokenizer") or {}).get("sha256")
        if unchanged:
            manifest = previous
        else:
            retire_manifest(self.dest)
            info = self.tokenizer(objects, plan)
            plan = self.budgeted(plan, objects, info)
            if progress is not None:
                progress.tokenizing(len(plan.rules))
            dtype, entries, shards = tokenize_objects(self.dest, objects, self.settings, plan, info, state / "tok",
                                                      self.workers, result, progress)
            manifest = assemble_manifest(self.uri, self.settings, plan, info, dtype, entries, shards, extra,
                                         result)
            write_bytes(self.dest / MANIFEST, json.dumps(manifest, indent=1).encode())
            remove_unlisted_shards(self.dest, manifest)
            (self.dest / STAGE_DIR / PREVIOUS_MANIFEST).unlink(missing_ok=True)
            result.rebuilt = True
        summarise(manifest, result)
        result.build_s = round(time.monotonic() - t0, 3)


def tokenize_objects(dest: Path, objects: list[StagedObject], settings: DatasetSettings, plan: SplitPlan,
                     info: TokenizerInfo, tmp_dir: Path, workers: int | None, result: StageResult,
                     progress: StageProgress | None = None,
                     packs: list[int] | None = None) -> tuple[str, list[dict], dict[int, dict]]:
    """Tokenize the staged ``objects`` (all packs, or a fan-out worker's ``packs``) into shards in ``dest``:
    (token dtype, file entries, {pack: {split: shard}})."""
    from trainer.data import token_dtype_for

    dtype = "uint8" if info.kind == "bytes" else token_dtype_for(info.vocab_size)
    layout = plan_packs([(o.rel, o.size) for o in objects], settings.pack_bytes)
    chosen = {i: layout[i] for i in (range(len(layout)) if packs is None else packs)}
    try:
        entries, shards = tokenize_packs(dest / "raw", dest, chosen, plan.rules, read=settings.read, tokenizer=info,
                                         dtype=dtype, bad_record_policy=settings.bad_record_policy, tmp_dir=tmp_dir,
                                         threshold=plan.threshold(), batch_bytes=settings.batch_bytes,
                                         workers=workers, progress=progress)
    except BadRecordsError as e:
        raise StageRefused(str(e), result) from e
    except (OSError, BrokenProcessPool) as e:
        raise StageError(f"tokenizing the staged files failed ({_short_error(e)}); no manifest was written - "
                         f"rerun to resume (the staged files are kept)", result) from e
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return dtype, entries, shards


def assemble_manifest(uri: str, settings: DatasetSettings, plan: SplitPlan, info: TokenizerInfo, dtype: str,
                      entries: list[dict], shards: dict[int, dict], extra: dict, result: StageResult) -> dict:
    # val_percent=0 asks for no validation split; a split the source names must hold documents.
    need_val = plan.source["by"] != "document" or settings.val_percent > 0 or settings.val_tokens > 0
    try:
        return dataset_manifest(source=uri, tokenizer=info, dtype=dtype, read=settings.read, entries=entries,
                                shards=shards, split_source=plan.source, need_val=need_val, extra=extra)
    except ValueError as e:
        raise StageError(f"staged {len(entries)} files, but the dataset cannot be built: {e}", result) from e


def summarise(manifest: dict, result: StageResult) -> None:
    result.files = len(manifest["files"])
    result.train_tokens = manifest["splits"]["train"]["tokens"]
    result.val_tokens = manifest["splits"]["val"]["tokens"]
    result.token_dtype = manifest["token_dtype"]
    result.vocab_size = manifest["vocab_size"]
    result.tokenizer = manifest.get("tokenizer") or {"kind": "bytes"}
    result.bad_records = manifest.get("bad_records") or {"total": 0, "by_kind": {}, "files": 0, "examples": []}
    result.split_source = manifest.get("split_source") or {"by": "file"}


def _stage_dra(uri: str, dest: Path, raw: Path, result: StageResult, build: DatasetBuilder, batch_size: int,
               poll_s: float, progress: StageProgress | None, t_start: float) -> StageResult:
    """Data repository association: raw/ is linked to the bucket; preload it, then build."""
    if not raw.is_dir():
        raise StageError(f"--fsx-dra: {raw} does not exist; create a data repository association that links "
                         f"it to {uri} first")
    from components.stage.formats import matches

    listed, refused = _list_local(str(raw))
    settings = build.settings
    kept = [x for x in listed if matches(x[0], settings.include, settings.exclude)]
    result.excluded = len(listed) - len(kept)
    result.refused = refused
    result.objects = len(kept)
    result.list_s = round(time.monotonic() - t_start, 3)
    if not kept:
        raise StageError(f"--fsx-dra: {raw} holds no files to stage; is the association's import done?", result)
    if progress is not None:
        progress.start(len(kept), 0)
    t0 = time.monotonic()
    result.restored = hsm_restore([str(raw / rel) for rel, _, _ in kept], batch_size=batch_size,
                                  poll_s=poll_s, progress=progress)
    result.transfer_s = round(time.monotonic() - t0, 3)
    state = dest / STAGE_DIR
    state.mkdir(exist_ok=True)
    with StageLock(state / "lock"):
        build.run([StagedObject(rel, rel, size, etag) for rel, size, etag in kept], state, progress, mode="dra")
    result.wall_s = round(time.monotonic() - t_start, 3)
    return result


def result_metadata(result: StageResult) -> dict:
    """The counts of a stage result as flat KFP metadata (lists cut to their first 100 entries)."""
    d = result.to_dict()
    bad = d.pop("bad_records") or {}
    d.pop("failed")
    d["refused"] = len(result.refused)
    d["refused_keys"] = [r["key"] for r in result.refused[:100]]
    d["bad_records"] = bad.get("total", 0)
    d["bad_records_by_kind"] = bad.get("by_kind", {})
    d["bad_record_files"] = [e["path"] for e in bad.get("examples", [])[:100]]
    return d
