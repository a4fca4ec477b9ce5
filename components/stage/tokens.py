"""Staged files -> token shards and the manifest, on every core, deterministically.

The unit of output is a *pack*: consecutive files of the listing (in path order) up to ``pack_bytes``
of source. A pack is a function of the listing alone (paths and sizes, known before anything is
downloaded), so whoever tokenizes it - one stage on all cores, or one of many fan-out workers - writes
the same shards ``train_<pack>.bin`` / ``val_<pack>.bin``, and the manifest lists them in pack order:
the same source and tokenizer always give byte-identical shards and manifest.

Inside a stage, files are tokenized by a pool of processes (one per core; ``tokenizers`` runs
single-threaded in each, so the cores are not oversubscribed). A worker streams one file - a batch of
documents at a time - into a temporary token file; the parent appends those, in path order, to the
pack's shards. Memory is a batch (``batch_bytes``) per worker whatever the file sizes and document lengths:
a long document is read and encoded in pieces (``components.stage.formats.Piece``).

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

from components.stage.formats import BAD_KINDS, PIECE_BYTES, BadFile, detect_format, read_documents
from components.stage.splits import document_split
from components.stage.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

PACK_BYTES = 256 * 1024 * 1024     # source bytes per pack (a shard per split and pack)
BATCH_BYTES = PIECE_BYTES          # text per encode_batch call in a worker, and the longest piece of a document
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
SPLITS = ("train", "val")


def _init_worker(tokenizer_path: str | None, eos_id: int | None, dtype: str, read: ReadConfig, tmp_dir: str,
                 threshold: int, batch_bytes: int) -> None:
    import numpy as np

    os.environ["TOKENIZERS_PARALLELISM"] = "false"     # one process per core already
    tok = None
    if tokenizer_path:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_path)
    _W.update(tok=tok, eos=eos_id, dtype=np.dtype(dtype), read=read, tmp=tmp_dir,
              threshold=threshold, batch_bytes=batch_bytes)


class _SplitOut:
    """One split's temporary token file of one source file, with its counts; a document can be taken back."""

    def __init__(self, path: str):
        self.path, self.f = path, None
        self.documents = self.tokens = self.text_bytes = 0

    def write(self, data: bytes, tokens: int, text_bytes: int, documents: int) -> None:
        if self.f is None:
            self.f = open(self.path, "wb")
        self.f.write(data)
        self.tokens += tokens
        self.text_bytes += text_bytes
        self.documents += documents

    def mark(self) -> tuple:
        return (self.f.tell() if self.f else 0, self.tokens, self.text_bytes, self.documents)

    def rollback(self, mark: tuple) -> None:
        offset, self.tokens, self.text_bytes, self.documents = mark
        if self.f is not None:
            self.f.seek(offset)
            self.f.truncate()

    def close(self) -> str | None:
        """The token file's path, or None when the split got no token (no file is left behind)."""
        if self.f is None:
            return None
        self.f.close()
        if not self.tokens:
            os.unlink(self.path)
            return None
        return self.path

    def counts(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes}


def _tokenize_file(job: tuple[str, str, str]) -> dict:
    """Tokenize one staged file into a temporary token file per split; return its manifest entry and those
    files. ``rule``: the whole file's split (``train``/``val``), or ``documents`` (each document's by its key).

    A document longer than a batch is encoded piece by piece, alone; the pieces of other documents are
    encoded ``batch_bytes`` at a time."""
    import numpy as np

    rel, path, rule = job
    tok, eos, dtype, read, limit = _W["tok"], _W["eos"], _W["dtype"], _W["read"], _W["batch_bytes"]
    fmt = detect_format(rel, read.data_format)
    stem = os.path.join(_W["tmp"], hashlib.sha256(rel.encode()).hexdigest()[:32])
    outs = {s: _SplitOut(f"{stem}.{s}.tok") for s in SPLITS}
    bad: Counter = Counter()
    batch: list[tuple[str, str | bytes, bool]] = []

    def flush() -> None:
        if not batch:
            return
        if tok is None:                   # the byte vocabulary: a document's UTF-8 bytes are its tokens
            for split in SPLITS:
                mine = [(p if isinstance(p, bytes) else p.encode(), last) for s, p, last in batch if s == split]
                if mine:
                    data = b"".join(d for d, _ in mine)
                    outs[split].write(data, len(data), len(data), sum(last for _, last in mine))
        else:
            ids = [e.ids for e in tok.encode_batch_fast([p for _, p, _ in batch], add_special_tokens=False)]
            for split in SPLITS:
                mine = [(x, p, last) for (s, p, last), x in zip(batch, ids) if s == split]
                if not mine:
                    continue
                for x, _, last in mine:
                    if last:
                        x.append(eos)         # documents are separated by the EOS
                n = sum(len(x) for x, _, _ in mine)
                arr = np.fromiter(itertools.chain.from_iterable(x for x, _, _ in mine), dtype=dtype, count=n)
                outs[split].write(arr.tobytes(), n, sum(len(p.encode()) for _, p, _ in mine),
                                  sum(last for _, _, last in mine))
        batch.clear()

    split, mark, size = None, None, 0
    try:
        pieces = read_documents(Path(path), fmt, rel=rel, text_field=read.text_field, text_column=read.text_column,
                                as_bytes=tok is None, bad=bad, piece_bytes=limit)
        for piece in pieces:
            if piece.text is None:            # the long document turned out bad: take back what it wrote
                if split is not None:
                    flush()
                    outs[split].rollback(mark)
                    split = None
                continue
            if split is None:                 # a document starts
                split = rule if rule != "documents" else document_split(piece.key, _W["threshold"])
                if not piece.last:
                    flush()
                    mark = outs[split].mark()
            batch.append((split, piece.text, piece.last))
            size += len(piece.text)
            if not piece.last or size >= limit:
                flush()
                size = 0
            if piece.last:
                split = None
        flush()
        tmp = {s: o.close() for s, o in outs.items()}
    except BadFile as e:
        for o in outs.values():
            if o.close():
                os.unlink(o.path)
            o.documents = o.tokens = o.text_bytes = 0
        bad[e.kind] += 1
        tmp, refused = {s: None for s in SPLITS}, str(e)
    else:
        refused = None
    entry = {"path": rel, "format": fmt, "split": rule,
             **{k: sum(o.counts()[k] for o in outs.values()) for k in ("documents", "tokens", "text_bytes")},
             "splits": {s: o.counts() for s, o in outs.items()}}
    if refused:
        entry["refused"] = refused
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    entry.update(bytes=os.path.getsize(path), sha256=h.hexdigest(), bad=dict(sorted(bad.items())))
    return {"entry": entry, "tmp": tmp}


# ----------------------------------------------------------------------------------- the parent
def tokenize_packs(raw: Path, out_dir: Path, packs: dict[int, list[str]], rules: dict[str, str], *,
                   read: ReadConfig, tokenizer: TokenizerInfo, dtype: str, bad_record_policy: str, tmp_dir: Path,
                   threshold: int, batch_bytes: int = BATCH_BYTES, workers: int | None = None,
                   progress=None) -> tuple[list[dict], dict[int, dict]]:
    """Tokenize ``packs`` (index -> paths under ``raw``) into ``out_dir``; ``rules`` gives each path's split
    (``components.stage.splits``; a path without one is left out), ``threshold`` the split of a document of a
    ``documents`` file (``SplitPlan.threshold``).

    Returns:
        (file entries in path order, {pack index: {split: shard entry}}).

    Raises:
        BadRecordsError: ``bad_record_policy`` is ``fail`` and a file had bad records (the shards of this
            call are removed).
    """
    from trainer.data import ShardFile

    jobs = [(rel, str(raw / rel), rules[rel]) for i in sorted(packs) for rel in packs[i] if rel in rules]
    pack_of = {rel: i for i in packs for rel in packs[i]}
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tok_path = str(out_dir / tokenizer.path) if tokenizer.path else None
    init = (tok_path, tokenizer.eos_id, dtype, read, str(tmp_dir), threshold, batch_bytes)
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
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
            for split, tmp in res["tmp"].items():
                if tmp is None:
                    continue
                writers = open_pack[1]
                if split not in writers:
                    writers[split] = ShardFile(out_dir, f"{split}_{i:05d}.bin", dtype)
                with open(tmp, "rb") as f:
                    while block := f.read(16 << 20):
                        writers[split].write(block)
                os.unlink(tmp)
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


def empty_val_hint(split_source: dict, files: int) -> str:
    """What to change when the validation split came out empty, by how the splits were found."""
    by = split_source.get("by")
    if by == "document" and "val_tokens" in split_source:
        return (f"{files} files; no document was drawn at val_tokens={split_source['val_tokens']} (a share of "
                f"{split_source['val_share']}): raise val_tokens, or add documents")
    if by == "document":
        return (f"{files} files; no document was drawn at val_percent={split_source['val_percent']}: raise "
                f"val_percent, or add documents (plain text files are drawn whole, by path)")
    if by == "globs":
        return f"{files} files; val_glob {split_source['val_glob']} matched none with a document: fix val_glob"
    return f"{files} files; the source's {split_source.get('val_from')} files hold no document"


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
                     shards: dict[int, dict], split_source: dict, need_val: bool, extra: dict) -> dict:
    """The manifest of a tokenized dataset (see ``docs/datasets.md``); ValueError if a split is empty."""
    from trainer.data import FORMAT

    entries = sorted(entries, key=lambda e: e["path"])
    splits = {}
    for split in ("train", "val"):
        parts = [shards[i][split] for i in sorted(shards) if split in shards[i]]
        splits[split] = {"tokens": sum(p["tokens"] for p in parts),
                         "bytes": sum(e["splits"][split]["text_bytes"] for e in entries),
                         "documents": sum(e["splits"][split]["documents"] for e in entries), "shards": parts}
    if need_val and splits["val"]["tokens"] == 0:
        raise ValueError(f"the validation split is empty ({empty_val_hint(split_source, len(entries))})")
    if splits["train"]["tokens"] == 0:
        raise ValueError(f"no training tokens in {len(entries)} files (see bad_records and split_source)")
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
        "split_source": split_source,
        "bad_records": bad_record_report(entries),
        **extra,
    }
