"""A validation split of about ``val_tokens`` tokens, drawn by document as ``val_percent`` is.

    plan = budget_plan(plan, raw, objects, val_tokens=2_000_000, read=..., tokenizer=info, tokenizer_dir=dest)
    plan.threshold()          # documents whose key hash is below it are validation

The split must be known before a document is tokenized (a fan-out worker sees only its packs), so the budget
becomes a share of documents, chosen from an estimate of the source's tokens: the listed size of the files split
by document times the tokens per byte of source of a sample: those files in path order, read and tokenized until
``SAMPLE_BYTES`` of text (the file the sample ends in counts its tokens per byte of text times the text its size
and metadata say it holds: a Parquet file's text column, a gzip or zstd file's uncompressed size); the one rate
applies to every file, so a source that mixes compressed and plain files is estimated at its first files' rate.
The share is rounded up to a step of a geometric grid (``GRID``: 4 steps per halving): added files
move no document between the splits while the estimate stays on the same step; when it crosses one (the source
grew, or the sample's tokens per byte changed), the threshold moves one step, and a step down (a source grown) only
moves documents from validation to training. The same source always gets the same threshold. The manifest's
``split_source`` records the budget, the estimate, the share and the threshold.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from pathlib import Path

from components.stage.formats import BadFile, detect_format, read_documents
from components.stage.splits import SplitPlan

SAMPLE_BYTES = 4 * 1024 * 1024     # text of the sample the tokens per byte are measured on
GRID = 4                           # threshold steps per halving of the share (a step is 2 ** (1/4): 19%)
MAX_SHARE = 0.5                    # a budget over half the estimated tokens is refused


def sample_files(plan: SplitPlan, objects) -> list:
    """The files the sample is read from: those split by document, in path order, up to ``SAMPLE_BYTES`` of
    source (the fan-out's plan fetches them before the workers run)."""
    out, size = [], 0
    for o in sorted(objects):
        if plan.rules.get(o.rel) == "documents" and size < SAMPLE_BYTES:
            out.append(o)
            size += o.size
    return out


def text_bytes(path: Path, fmt: str, text_column: str) -> int:
    """About how many bytes of text ``path`` holds, from its size or metadata alone (nothing is decoded)."""
    size = path.stat().st_size
    name = path.name.lower()
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            leaf = [meta.schema.column(i).path for i in range(meta.num_columns)].index(text_column)
            return sum(meta.row_group(g).column(leaf).total_uncompressed_size for g in range(meta.num_row_groups))
        if name.endswith(".gz") and size >= 4:
            with open(path, "rb") as f:
                f.seek(-4, 2)
                return struct.unpack("<I", f.read(4))[0]     # ISIZE: the uncompressed size modulo 2**32
        if name.endswith((".zst", ".zstd")):
            import zstandard

            with open(path, "rb") as f:
                declared = zstandard.frame_content_size(f.read(18))
            return declared if declared > 0 else size
    except Exception:  # noqa: B902 - a file that cannot be read counts by its size; tokenizing it reports it
        return size
    return size


def tokens_per_source_byte(raw: Path, files: list, read, tokenizer, tokenizer_dir: Path, piece_bytes: int) -> float:
    """Tokens (end-of-document tokens included) per byte of source over the sample ``files``, read in order until
    ``SAMPLE_BYTES`` of text: a file read to its end counts its tokens, the file the sample ends in its tokens per
    byte of text times the text its size and metadata hold (``text_bytes``)."""
    tok = None
    if tokenizer.path:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_dir / tokenizer.path))
    tokens = size = sampled = 0.0
    for o in files:
        path, fmt = raw / o.rel, detect_format(o.rel, read.data_format)
        file_tokens = file_text = 0
        try:
            for piece in read_documents(path, fmt, rel=o.rel, text_field=read.text_field,
                                        text_column=read.text_column, as_bytes=tok is None, bad=Counter(),
                                        piece_bytes=piece_bytes):
                if piece.text is None:
                    continue
                n = len(piece.text) if isinstance(piece.text, bytes) else len(piece.text.encode())
                file_text += n
                file_tokens += n if tok is None else len(tok.encode(piece.text, add_special_tokens=False).ids) + \
                    piece.last
                if sampled + file_text >= SAMPLE_BYTES:
                    break
            else:
                tokens, size, sampled = tokens + file_tokens, size + o.size, sampled + file_text
                continue
        except BadFile:
            continue                 # counted when the file is tokenized
        return (tokens + file_tokens / file_text * text_bytes(path, fmt, read.text_column)) / (size + o.size)
    return tokens / size if size else 0.0


def grid_step(val_tokens: int, estimated_tokens: int) -> int:
    """The step k of the smallest share of the grid, 2 ** (-k / GRID), that holds ``val_tokens``."""
    return math.floor(-GRID * math.log2(val_tokens / estimated_tokens))


def step_threshold(k: int) -> int:
    """floor(2 ** 64 * 2 ** (-k / GRID)), in integers: the same on every machine."""
    whole, part = divmod(k, GRID)
    return math.isqrt(math.isqrt(1 << (GRID * (64 - whole) - part)))


def budget_plan(plan: SplitPlan, raw: Path, objects, *, val_tokens: int, read, tokenizer, tokenizer_dir: Path,
                piece_bytes: int) -> SplitPlan:
    """``plan`` (split by document) with the threshold that gives about ``val_tokens`` validation tokens.

    Raises:
        ValueError: the budget is more than ``MAX_SHARE`` of the estimate, or nothing could be sampled.
    """
    files = [o for o in sorted(objects) if plan.rules.get(o.rel) == "documents"]
    rate = tokens_per_source_byte(raw, sample_files(plan, objects), read, tokenizer, tokenizer_dir, piece_bytes)
    estimated = round(sum(o.size for o in files) * rate)
    if not estimated:
        raise ValueError(f"val_tokens={val_tokens}: no text found in the sample of the {len(files)} files split by "
                         f"document to estimate the source's tokens")
    if val_tokens > MAX_SHARE * estimated:
        raise ValueError(f"val_tokens={val_tokens:,} is more than half of the source's estimated {estimated:,} "
                         f"tokens; lower val_tokens, or use val_percent")
    threshold = step_threshold(grid_step(val_tokens, estimated))
    return SplitPlan(plan.rules, {**plan.source, "val_tokens": val_tokens, "estimated_tokens": estimated,
                                  "tokens_per_source_byte": round(rate, 6),
                                  "val_share": round(threshold / (1 << 64), 6), "threshold": threshold})
