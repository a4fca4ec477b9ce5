"""Documents out of staged files: plain text, JSONL (plain, gzip, zstd) and Parquet, read as streams.

    for doc in read_documents(path, "jsonl", text_field="text", bad=counter): ...

A file's format is named by the ``data_format`` stage parameter or, with ``auto``, by its name:
``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst`` are JSONL, ``*.parquet`` is Parquet, anything else is
plain text (one document per file). Records that cannot become a document are counted in ``bad`` by
kind (``BAD_KINDS``) and left out; a file that cannot be read at all raises ``BadFile`` with its kind,
and the caller drops everything that file produced. Memory stays bounded: JSONL is read a line at a
time, Parquet a record batch of one column at a time.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
from collections import Counter
from pathlib import Path
from typing import Iterator

FORMATS = ("auto", "text", "jsonl", "parquet")
BAD_KINDS = {
    "malformed_json": "a JSONL line that is not valid JSON",
    "missing_field": "a record without the text field (or with a non-string value; a null in Parquet)",
    "not_utf8": "text that is not UTF-8",
    "empty": "an empty document",
    "binary": "a plain text file holding NUL bytes (a binary file)",
    "wrong_schema": "a Parquet file without the text column, or with a non-string one",
    "unreadable": "a file that cannot be read: corrupt compression, not Parquet, truncated",
}
PARQUET_BATCH_ROWS = 1024


class BadFile(Exception):
    """The whole file is refused; ``kind`` is one of ``BAD_KINDS``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def detect_format(rel: str, data_format: str = "auto") -> str:
    """The format of ``rel``: ``data_format`` unless it is ``auto``, else by the file name."""
    if data_format not in FORMATS:
        raise ValueError(f"data_format must be one of {', '.join(FORMATS)}, got {data_format!r}")
    if data_format != "auto":
        return data_format
    name = rel.rsplit("/", 1)[-1].lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def matches(rel: str, include: list[str], exclude: list[str]) -> bool:
    """Whether ``rel`` is staged: it matches an include glob (none given: all) and no exclude glob.

    A pattern with a ``/`` is matched against the whole path (``data/*.parquet``; ``*`` also crosses
    ``/``), one without against the file name at any depth (``train-*.parquet``), like .gitignore.
    """
    name = rel.rsplit("/", 1)[-1]

    def hit(pattern: str) -> bool:
        return fnmatch.fnmatchcase(rel if "/" in pattern else name, pattern)

    return (not include or any(hit(p) for p in include)) and not any(hit(p) for p in exclude)


def _open_stream(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    raw = open(path, "rb")
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard

        # read_across_frames: files written by `zstd` in several frames (or concatenated) are read whole.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True,
                                                                            closefd=True))
    return raw


def _jsonl(path: Path, text_field: str, bad: Counter) -> Iterator[str]:
    import zstandard

    try:
        with _open_stream(path) as f:
            for line in f:
                if not line.strip():
                    continue                 # a blank line is no record (files often end with one)
                try:
                    record = json.loads(line)
                except UnicodeDecodeError:
                    bad["not_utf8"] += 1
                    continue
                except ValueError:
                    bad["malformed_json"] += 1
                    continue
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    bad["missing_field"] += 1
                elif not text:
                    bad["empty"] += 1
                else:
                    yield text
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise BadFile("unreadable", f"{path.name}: {type(e).__name__}: {e}") from e


def _parquet(path: Path, text_column: str, bad: Counter) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise BadFile("unreadable", f"{path.name}: {type(e).__name__}: {e}") from e
    schema = pf.schema_arrow
    if text_column not in schema.names:
        raise BadFile("wrong_schema", f"{path.name}: no column {text_column!r} (columns: "
                                      f"{', '.join(schema.names)}); set text_column")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BadFile("wrong_schema", f"{path.name}: column {text_column!r} is {kind}, not a string")
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_column]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    bad["missing_field"] += 1
                elif not text:
                    bad["empty"] += 1
                else:
                    yield text
    except (OSError, pa.ArrowException) as e:
        raise BadFile("unreadable", f"{path.name}: {type(e).__name__}: {e}") from e


def _text(path: Path, as_bytes: bool, bad: Counter) -> Iterator[str | bytes]:
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise BadFile("binary", f"{path.name}: NUL bytes, not a text file")
    if not data:
        bad["empty"] += 1
        return
    if as_bytes:
        yield data                           # the byte vocabulary takes any bytes, as it always has
        return
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile("not_utf8", f"{path.name}: not UTF-8 ({e})") from e


def read_documents(path: Path, fmt: str, *, text_field: str = "text", text_column: str = "text",
                   as_bytes: bool = False, bad: Counter) -> Iterator[str | bytes]:
    """The documents of one file, in file order; bad records are counted in ``bad`` and skipped.

    Args:
        path: the staged file.
        fmt: ``text``, ``jsonl`` or ``parquet`` (see ``detect_format``).
        text_field: the JSONL field that holds a document's text.
        text_column: the Parquet column that holds it.
        as_bytes: plain text files are read as bytes, undecoded (the byte vocabulary).
        bad: bad-record counter by kind, updated as the file is read.

    Raises:
        BadFile: the whole file is refused (binary, not UTF-8, wrong Parquet schema, unreadable).
    """
    if fmt == "jsonl":
        return _jsonl(path, text_field, bad)
    if fmt == "parquet":
        return _parquet(path, text_column, bad)
    return _text(path, as_bytes, bad)
