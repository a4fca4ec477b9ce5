"""Staged files -> token shards and the manifest, on every core, deterministically.

The unit of output is a *pack*: consecutive files of the listing (in path order) up to ``pack_bytes``
of source. A pack is a function of the listing alone (paths and sizes, known before anything is
downloaded), so whoever tokenizes it - one stage on all cores, or one of many fan-out workers - writes
the same shards ``train_<pack>.bin`` / ``val_<pack>.bin``, and the manifest lists them in pack order:
the same source and tokenizer always give byte-identical shards and manifest.

Inside a stage, files are tokenized by a pool of processes (one per core; ``tokenizers`` runs
single-threaded in each, so the cores are not oversubscribed). A worker streams one file - a batch of
documents at a time - into a temporary token file; the parent appends those, in path order, to the
pack's shards. Memory is a batch per worker whatever the file sizes.

The workers run on a faster malloc than glibc's where one is installed (``worker_allocator``): a third of
``tokenizers``' encode time is spent in glibc's malloc and free, and mimalloc takes about 30% off a worker's
CPU time per byte (``bench/tokenization.py``). The tokens do not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import hashlib
import itertools
import logging
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

from components.stage_formats import BAD_KINDS, BadFile, detect_format, read_documents
from components.stage_tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

PACK_BYTES = 256 * 1024 * 1024     # source bytes per pack (a shard per split and pack)
BATCH_CHARS = 4 * 1024 * 1024      # text per encode_batch call in a worker
BAD_RECORD_POLICIES = ("skip", "fail")
MAX_BAD_FILES_LISTED = 1000        # files with bad records named in the manifest (all are counted)
MALLOC_ENV = "GOODPUT_TOKENIZE_MALLOC"
# malloc libraries the workers preload, the fastest on tokenizers' encode first (Debian: libmimalloc2.0,
# libtcmalloc-minimal4, libjemalloc2).
ALLOCATORS = ("mimalloc", "tcmalloc_minimal", "jemalloc")


class BadRecordsError(ValueError):
    """``bad_record_policy=fail`` and a file had bad records; nothing was written for the dataset."""


@dataclass(frozen=True)
class ReadConfig:
    """How documents are read from the staged files (recorded in the manifest)."""

    data_format: str = "auto"      # auto | text | jsonl | parquet
    text_field: str = "text"       # JSONL
    text_column: str = "text"      # Parquet

    def to_dict(self) -> dict:
        return asdict(self)


def plan_packs(files: Iterable[tuple[str, int]], pack_bytes: int = PACK_BYTES) -> list[list[str]]:
    """Group (path, size) into packs: consecutive paths in sorted order, each at most ``pack_bytes``
    unless a single file is larger."""
    packs: list[list[str]] = []
    size = 0
    for rel, n in sorted(files):
        if not packs or (size + n > pack_bytes and packs[-1]):
            packs.append([])
            size = 0
        packs[-1].append(rel)
        size += n
    return packs


def partitions(n_packs: int, parts: int) -> list[list[int]]:
    """Contiguous, nearly equal ranges of pack indices, one per fan-out worker (none left empty)."""
    parts = max(1, min(parts, n_packs))
    return [list(range(i * n_packs // parts, (i + 1) * n_packs // parts)) for i in range(parts)]


# ------------------------------------------------------------------------------- worker processes
def worker_allocator() -> str | None:
    """The malloc library the tokenizer workers preload, or None for glibc's.

    ``$GOODPUT_TOKENIZE_MALLOC``: ``auto`` (default: the first of ``ALLOCATORS`` installed), ``system``
    (glibc's), or a library name (``jemalloc``) or path. ValueError if the one named is not found.
    """
    choice = os.environ.get(MALLOC_ENV, "auto").strip() or "auto"
    if choice == "system":
        return None
    if choice == "auto":
        return next(filter(None, map(ctypes.util.find_library, ALLOCATORS)), None)
    found = choice if "/" in choice else ctypes.util.find_library(choice.removeprefix("lib"))
    if not found or ("/" in found and not os.path.isfile(found)):
        raise ValueError(f"{MALLOC_ENV}={choice}: no such malloc library; install it (e.g. the libmimalloc2.0 "
                         f"package), or set {MALLOC_ENV} to auto or system")
    return found


@contextlib.contextmanager
def _preloaded(library: str | None) -> Iterator[None]:
    """Processes spawned inside the block preload ``library``: a spawned process gets os.environ as it is
    when it starts, and the dynamic loader reads LD_PRELOAD only then; the parent's is restored after."""
    if library is None:
        yield
        return
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{library}:{before}" if before else library
    try:
        yield
    finally:
        if before is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = before


_W: dict = {}


def _init_worker(tokenizer_path: str | None, eos_id: int | None, dtype: str, read: ReadConfig,
                 tmp_dir: str) -> None:
    import numpy as np

    os.environ["TOKENIZERS_PARALLELISM"] = "false"     # one process per core already
    tok = None
    if tokenizer_path:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_path)
    _W.update(tok=tok, eos=eos_id, dtype=np.dtype(dtype), read=read, tmp=tmp_dir)


def _batches(docs: Iterator[str | bytes], limit: int) -> Iterator[list]:
    batch, size = [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tokenize_file(job: tuple[str, str, str]) -> dict:
    """Tokenize one staged file into a temporary token file; return its manifest entry and counts."""
    import numpy as np

    rel, path, split = job
    tok, eos, dtype, read = _W["tok"], _W["eos"], _W["dtype"], _W["read"]
    fmt = detect_format(rel, read.data_format)
    out = os.path.join(_W["tmp"], hashlib.sha256(rel.encode()).hexdigest()[:32] + ".tok")
    bad: Counter = Counter()
    entry = {"path": rel, "format": fmt, "split": split, "documents": 0, "tokens": 0, "text_bytes": 0}
    try:
        with open(out, "wb") as f:
            docs = read_documents(Path(path), fmt, text_field=read.text_field, text_column=read.text_column,
                                  as_bytes=tok is None, bad=bad)
            for batch in _batches(docs, BATCH_CHARS):
                if tok is None:           # the byte vocabulary: a document's UTF-8 bytes are its tokens
                    data = b"".join(d if isinstance(d, bytes) else d.encode() for d in batch)
                    f.write(data)
                    n, nbytes = len(data), len(data)
                else:
                    ids = [e.ids for e in tok.encode_batch_fast(batch, add_special_tokens=False)]
                    for x in ids:
                        x.append(eos)         # documents are separated by the EOS
                    arr = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids)))
                    f.write(arr.tobytes())
                    n, nbytes = len(arr), sum(len(d.encode()) for d in batch)
                entry["documents"] += len(batch)
                entry["tokens"] += n
                entry["text_bytes"] += nbytes
    except BadFile as e:
        os.unlink(out)
        bad[e.kind] += 1
        entry.update(documents=0, tokens=0, text_bytes=0, refused=str(e))
        out = None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    entry.update(bytes=os.path.getsize(path), sha256=h.hexdigest(), bad=dict(sorted(bad.items())))
    return {"entry": entry, "tmp": out}


# ----------------------------------------------------------------------------------- the parent
def tokenize_packs(raw: Path, out_dir: Path, packs: dict[int, list[str]], splits: dict[str, str], *,
                   read: ReadConfig, tokenizer: TokenizerInfo, dtype: str, bad_record_policy: str, tmp_dir: Path,
                   workers: int | None = None, progress=None) -> tuple[list[dict], dict[int, dict]]:
    """Tokenize ``packs`` (index -> paths under ``raw``) into ``out_dir``.

    Returns:
        (file entries in path order, {pack index: {split: shard entry}}).

    Raises:
        BadRecordsError: ``bad_record_policy`` is ``fail`` and a file had bad records (the shards of this
            call are removed).
    """
    from trainer.data import ShardFile

    jobs = [(rel, str(raw / rel), splits[rel]) for i in sorted(packs) for rel in packs[i]]
    pack_of = {rel: i for i in packs for rel in packs[i]}
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tok_path = str(out_dir / tokenizer.path) if tokenizer.path else None
    init = (tok_path, tokenizer.eos_id, dtype, read, str(tmp_dir))
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    entries: list[dict] = []
    shards: dict[int, dict] = {}
    open_pack: tuple[int, dict[str, ShardFile]] | None = None
    written: list[Path] = []

    def close_pack() -> None:
        if open_pack is not None:
            i, writers = open_pack
            shards[i] = {s: w.close() for s, w in sorted(writers.items())}
            written.extend(out_dir / e["path"] for e in shards[i].values())

    if workers == 1:
        _init_worker(*init)
        pool, results = None, map(_tokenize_file, jobs)
    else:
        allocator = worker_allocator()
        log.info("tokenizing %d files on %d processes (malloc: %s)", len(jobs), workers, allocator or "glibc")
        # spawn: a forked child would inherit the parent's tokenizers thread pool (its Rust threads are gone).
        # An executor, not multiprocessing.Pool: a worker that dies (out of memory) fails the map instead of
        # leaving it waiting forever for that worker's result.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=init)
        with _preloaded(allocator):
            # The executor spawns its processes as jobs are submitted, and map submits every job here.
            results = pool.map(_tokenize_file, jobs)
    try:
        for res in results:
            entry = res["entry"]
            if entry["bad"] and bad_record_policy == "fail":
                kinds = ", ".join(f"{n} {k} ({BAD_KINDS[k]})" for k, n in entry["bad"].items())
                raise BadRecordsError(f"{entry['path']}: {kinds}{': ' + entry['refused'] if 'refused' in entry else ''}"
                                      f"; bad_record_policy=fail stops here (use skip to leave bad records out "
                                      f"and report them)")
            i = pack_of[entry["path"]]
            if open_pack is None or open_pack[0] != i:
                close_pack()
                open_pack = (i, {})
            if res["tmp"] is not None:
                if entry["tokens"]:
                    writers = open_pack[1]
                    split = entry["split"]
                    if split not in writers:
                        writers[split] = ShardFile(out_dir, f"{split}_{i:05d}.bin", dtype)
                    with open(res["tmp"], "rb") as f:
                        while block := f.read(16 << 20):
                            writers[split].write(block)
                os.unlink(res["tmp"])
            entries.append(entry)
            if progress is not None:
                progress.advance(files=1)
        close_pack()
        open_pack = None
    except BaseException:
        if open_pack is not None:
            for w in open_pack[1].values():
                w.abort()
        for p in written:
            p.unlink(missing_ok=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return entries, shards


def bad_record_report(entries: list[dict]) -> dict:
    """Counts by kind over all files, and the files that had any (their counts, and why one was refused)."""
    total: Counter = Counter()
    files = []
    for e in entries:
        if e["bad"]:
            total.update(e["bad"])
            files.append({"path": e["path"], **e["bad"], **({"refused": e["refused"]} if "refused" in e else {})})
    return {"total": sum(total.values()), "by_kind": dict(sorted(total.items())), "files": len(files),
            "examples": files[:MAX_BAD_FILES_LISTED]}


def dataset_manifest(*, source: str, tokenizer: TokenizerInfo, dtype: str, read: ReadConfig, entries: list[dict],
                     shards: dict[int, dict], val_percent: int, extra: dict) -> dict:
    """The manifest of a tokenized dataset (see ``docs/datasets.md``); ValueError if a split is empty."""
    from trainer.data import FORMAT

    entries = sorted(entries, key=lambda e: e["path"])
    splits = {}
    for split in ("train", "val"):
        files = [e for e in entries if e["split"] == split]
        parts = [shards[i][split] for i in sorted(shards) if split in shards[i]]
        splits[split] = {"tokens": sum(p["tokens"] for p in parts), "bytes": sum(e["text_bytes"] for e in files),
                         "documents": sum(e["documents"] for e in files), "shards": parts}
    if val_percent and splits["val"]["tokens"] == 0:
        raise ValueError(f"the validation split is empty ({len(entries)} files); add files or raise val_percent")
    if splits["train"]["tokens"] == 0:
        raise ValueError(f"no training tokens in {len(entries)} files (see bad_records)")
    tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    text_bytes = splits["train"]["bytes"] + splits["val"]["bytes"]
    return {
        "format": FORMAT,
        "source": source,
        "token_dtype": dtype,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer.to_dict(),
        "bytes_per_token": round(text_bytes / tokens, 6),
        "documents": read.to_dict(),
        "files": entries,
        "splits": splits,
        "bad_records": bad_record_report(entries),
        **extra,
    }
