"""Documents out of staged files: plain text, JSONL (plain, gzip, zstd) and Parquet, read as streams.

    for piece in read_documents(path, "jsonl", rel="shard-0.jsonl", text_field="text", bad=counter): ...

A file's format is named by the ``data_format`` stage parameter or, with ``auto``, by its name:
``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst`` are JSONL, ``*.parquet`` is Parquet, anything else is
plain text (one document per file). Records that cannot become a document are counted in ``bad`` by
kind (``BAD_KINDS``) and left out; a file that cannot be read at all raises ``BadFile`` with its kind,
and the caller drops everything that file produced. Memory stays bounded: documents come out as pieces of
at most ``piece_bytes`` (a JSONL line or a text file longer than that is parsed as it streams); Parquet is
read a record batch of about ``piece_bytes`` of text at a time (a single value is read whole: Parquet
stores it in one page), and a value longer than that goes out in pieces cut from Arrow's buffer.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import itertools
import json
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Iterator, NamedTuple

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
PARQUET_BATCH_ROWS = 1024         # the most rows of a Parquet record batch (fewer when values are long)
PIECE_BYTES = 4 * 1024 * 1024      # the longest piece of a document read at once (see ``Piece``)
ID_FIELD = "id"                    # a record's identity, when it has one: its split is drawn from it


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


class Piece(NamedTuple):
    """Part of a document: its ``key`` (``id:<id field>`` or ``<path>#<position>``: what its split is drawn
    from), ``text`` (at most about ``piece_bytes``), and whether it is the document's ``last`` piece. A piece
    with ``text`` None withdraws the document it belongs to (a long record that turned out bad)."""

    key: str
    text: str | bytes | None
    last: bool


def _cut(data: bytes, limit: int) -> int:
    """Where to end a piece of ``data`` (longer than ``limit``): before its last space in ``limit`` bytes, so
    that a tokenizer which splits words at spaces (byte-level BPE, Whitespace, Metaspace) sees the words it
    would see in the whole text; with no space, before a UTF-8 character that ``limit`` ends in."""
    at = data.rfind(b" ", 1, limit)
    if at > 0:
        return at
    at = limit
    while at > 1 and 0x80 <= data[at] < 0xC0:      # a UTF-8 continuation byte is no place to cut
        at -= 1
    return at


def _record_key(record: dict, rel: str, position: int) -> str:
    ident = record.get(ID_FIELD)
    if isinstance(ident, str) or (isinstance(ident, int) and not isinstance(ident, bool)):
        return f"id:{ident}"
    return f"{rel}#{position}"


def _pieces(key: str, text: str, piece_bytes: int) -> Iterator[Piece]:
    """A document read whole (one JSONL line or Parquet value), as pieces of at most ``piece_bytes``."""
    if len(text) <= piece_bytes // 4 or len(data := text.encode()) <= piece_bytes:
        yield Piece(key, text, True)
        return
    while len(data) > piece_bytes:
        at = _cut(data, piece_bytes)
        yield Piece(key, data[:at].decode(), False)
        data = data[at:]
    yield Piece(key, data.decode(), True)


def _jsonl(path: Path, rel: str, text_field: str, bad: Counter, piece_bytes: int) -> Iterator[Piece]:
    import zstandard

    try:
        with _open_stream(path) as f:
            for position in itertools.count():
                # A line is read whole only up to piece_bytes: a longer one is parsed as it streams.
                line = f.readline(piece_bytes)
                if not line:
                    return
                if len(line) == piece_bytes and not line.endswith(b"\n"):
                    yield from _LongRecord(f, line, piece_bytes).pieces(f"{rel}#{position}", text_field, bad)
                    continue
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
                    yield from _pieces(_record_key(record, rel, position), text, piece_bytes)
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise BadFile("unreadable", f"{path.name}: {type(e).__name__}: {e}") from e


class _Malformed(Exception):
    """The long record is not the JSON object it should be (its line is skipped to the end)."""


class _LongRecord:
    """One JSONL line longer than ``piece_bytes``, parsed as it is read, ``piece_bytes`` at a time: the text
    field's string comes out in pieces (decoded by ``json``, cut at spaces so no escape or character is
    split), every other value is skipped unread. Memory stays a few pieces whatever the line's length."""

    WS = b" \t\r\n"

    def __init__(self, f, head: bytes, piece_bytes: int):
        self.f, self.buf, self.i, self.size, self.eol = f, head, 0, piece_bytes, False

    def _more(self) -> bool:
        """Append the next part of the line to the buffer (what was consumed is dropped); False at its end."""
        if self.eol:
            return False
        chunk = self.f.readline(self.size)
        if not chunk or chunk.endswith(b"\n"):
            self.eol = True
        self.buf = self.buf[self.i:] + chunk
        self.i = 0
        return bool(chunk)

    def _peek(self) -> int:
        while True:
            while self.i < len(self.buf) and self.buf[self.i] in self.WS:
                self.i += 1
            if self.i < len(self.buf):
                return self.buf[self.i]
            if not self._more():
                return -1

    def _expect(self, char: bytes) -> None:
        if self._peek() != char[0]:
            raise _Malformed
        self.i += 1

    def _string_end(self) -> int:
        """The index of the closing quote of the string starting at ``self.i`` (after its quote), or -1 if the
        buffer ends first."""
        j = self.i
        while True:
            j = self.buf.find(b'"', j)
            if j < 0:
                return -1
            k = j
            while k > self.i and self.buf[k - 1] == 0x5C:     # backslashes before the quote
                k -= 1
            if (j - k) % 2 == 0:
                return j
            j += 1

    def _raw_string(self, limit: int | None) -> Iterator[bytes]:
        """The escaped bytes of the string at the cursor, in parts cut at spaces (or ends of escapes)."""
        self._expect(b'"')
        while True:
            end = self._string_end()
            stop = end if end >= 0 else len(self.buf)
            if limit is not None and stop - self.i > limit:
                raise _Malformed                    # a key this long is not one
            while stop - self.i > self.size:
                at = self.i + self._safe_cut(self.buf[self.i:stop])
                yield self.buf[self.i:at]
                self.i = at
            if end >= 0:
                yield self.buf[self.i:end]
                self.i = end + 1
                return
            if not self._more():
                raise _Malformed                    # the line ends inside the string

    def _safe_cut(self, raw: bytes) -> int:
        at = _cut(raw, self.size)
        if raw[at:at + 1] != b" ":
            # No space: cut before the escape (up to 12 bytes: a surrogate pair) the limit may fall in.
            back = raw.rfind(b"\\", max(0, at - 12), at)
            if back >= 0:
                while back > 0 and raw[back - 1] == 0x5C:
                    back -= 1
                if re.match(rb"\\u[dD][89abAB]", raw[back - 6:back - 2]):
                    back -= 6                       # a high surrogate stays with its low one
                at = back if back > 0 else at
        return at

    def _skip_value(self) -> None:
        c = self._peek()
        if c == ord('"'):
            for _ in self._raw_string(None):
                pass
            return
        depth = 0
        while True:
            c = self._peek()
            if c < 0:
                if depth:
                    raise _Malformed
                return
            if c == ord('"'):
                self._skip_value()
                continue
            if c in b"{[":
                depth += 1
            elif c in b"}]":
                if depth == 0:
                    return
                depth -= 1
            elif c == ord(",") and depth == 0:
                return
            self.i += 1
            if depth == 0 and c in b"}]":
                return

    def _to_line_end(self) -> None:
        while self._more():
            self.i = len(self.buf)

    def pieces(self, key: str, text_field: str, bad: Counter) -> Iterator[Piece]:
        found = started = False
        text = ""
        try:
            self._expect(b"{")
            end = self._peek() == ord("}")
            while not end:
                name = json.loads(b'"' + b"".join(self._raw_string(self.size)) + b'"')
                self._expect(b":")
                if name == text_field and not found and self._peek() == ord('"'):
                    found = True
                    for raw in self._raw_string(None):
                        if raw:
                            if started:
                                yield Piece(key, text, False)
                            text, started = json.loads(b'"' + raw + b'"'), True
                else:
                    self._skip_value()
                end = self._peek() == ord("}")
                if not end:
                    self._expect(b",")
            self.i += 1                            # the closing brace
            if self._peek() >= 0:
                raise _Malformed                   # something after the object
        except (_Malformed, ValueError, UnicodeDecodeError) as e:
            self._to_line_end()
            bad["not_utf8" if isinstance(e, UnicodeDecodeError) else "malformed_json"] += 1
            if started:
                yield Piece(key, None, True)
            return
        if not found:
            bad["missing_field"] += 1
        elif not started:
            bad["empty"] += 1
        else:
            yield Piece(key, text, True)


def _parquet_rows(pf, column: int, piece_bytes: int) -> int:
    """Rows per record batch so that a batch holds about ``piece_bytes`` of text: from the largest average
    value of the text column over the row groups (their metadata's uncompressed size), at least one row."""
    meta = pf.metadata
    widest = max((meta.row_group(g).column(column).total_uncompressed_size / max(1, meta.row_group(g).num_rows)
                  for g in range(meta.num_row_groups)), default=1.0)
    return max(1, min(PARQUET_BATCH_ROWS, int(piece_bytes // max(1.0, widest))))


def _value_bytes(array, i: int) -> memoryview:
    """The UTF-8 bytes of the string ``array[i]``, in Arrow's data buffer: not copied (a scalar's ``as_buffer``
    copies the value)."""
    import pyarrow as pa

    _, offsets, data = array.buffers()
    fmt = "<q" if pa.types.is_large_string(array.type) else "<i"
    start, end = struct.unpack_from(f"{fmt}{fmt[1]}", offsets, (array.offset + i) * struct.calcsize(fmt))
    return memoryview(data)[start:end]


def _long_value(key: str, data: memoryview, piece_bytes: int) -> Iterator[Piece]:
    """A value longer than ``piece_bytes`` (its bytes in Arrow's buffer) as pieces, never copied whole into a
    Python string (a 200 MB cell would take 200 MB more, and up to four times that for non-ASCII text)."""
    start = 0
    while len(data) - start > piece_bytes:
        window = bytes(data[start:start + piece_bytes + 1])
        at = _cut(window, piece_bytes)
        yield Piece(key, window[:at].decode(), False)
        start += at
    yield Piece(key, bytes(data[start:]).decode(), True)


def _parquet(path: Path, rel: str, text_column: str, bad: Counter, piece_bytes: int) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        # buffer_size: column chunks are read a page buffer at a time, not whole row groups.
        pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (OSError, pa.ArrowException) as e:
        raise BadFile("unreadable", f"{path.name}: {type(e).__name__}: {e}") from e
    schema = pf.schema_arrow
    if text_column not in schema.names:
        raise BadFile("wrong_schema", f"{path.name}: no column {text_column!r} (columns: "
                                      f"{', '.join(schema.names)}); set text_column")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BadFile("wrong_schema", f"{path.name}: column {text_column!r} is {kind}, not a string")
    id_kind = schema.field(ID_FIELD).type if ID_FIELD in schema.names and ID_FIELD != text_column else None
    keyed = id_kind is not None and (pa.types.is_string(id_kind) or pa.types.is_large_string(id_kind)
                                     or pa.types.is_integer(id_kind))
    columns = [text_column, ID_FIELD] if keyed else [text_column]
    position = 0
    try:
        leaf = [pf.schema.column(i).path for i in range(len(pf.schema))].index(text_column)
        for batch in pf.iter_batches(batch_size=_parquet_rows(pf, leaf, piece_bytes), columns=columns):
            ids = batch.column(1).to_pylist() if keyed else itertools.repeat(None)
            texts = batch.column(0)
            lengths = pc.binary_length(texts).to_pylist()
            # A batch of about piece_bytes converts at once (faster); one with a long value, value by value.
            values = texts.to_pylist() if sum(filter(None, lengths)) <= 2 * piece_bytes else None
            for i, (n, ident) in enumerate(zip(lengths, ids)):
                key = f"id:{ident}" if ident is not None else f"{rel}#{position}"
                if n is None:
                    bad["missing_field"] += 1
                elif not n:
                    bad["empty"] += 1
                elif n > piece_bytes:
                    yield from _long_value(key, _value_bytes(texts, i), piece_bytes)
                else:
                    yield Piece(key, values[i] if values is not None else texts[i].as_py(), True)
                position += 1
    except (OSError, pa.ArrowException) as e:
        raise BadFile("unreadable", f"{path.name}: {type(e).__name__}: {e}") from e


def _text(path: Path, rel: str, as_bytes: bool, bad: Counter, piece_bytes: int) -> Iterator[Piece]:
    with open(path, "rb") as f:
        data = f.read(piece_bytes + 1)
        if b"\x00" in data[:8192]:
            raise BadFile("binary", f"{path.name}: NUL bytes, not a text file")
        if not data:
            bad["empty"] += 1
            return
        while True:
            last = len(data) <= piece_bytes
            at = len(data) if last else _cut(data, piece_bytes)
            if as_bytes:
                piece = data[:at]                # the byte vocabulary takes any bytes, as it always has
            else:
                try:
                    piece = data[:at].decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadFile("not_utf8", f"{path.name}: not UTF-8 ({e})") from e
            yield Piece(rel, piece, last)
            if last:
                return
            data = data[at:] + f.read(piece_bytes + 1 - (len(data) - at))


def read_documents(path: Path, fmt: str, *, rel: str = "", text_field: str = "text", text_column: str = "text",
                   as_bytes: bool = False, bad: Counter, piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """The documents of one file, in file order, as pieces of at most about ``piece_bytes`` (a document
    longer than that, or a JSONL line, is read and cut as it streams); bad records are counted in ``bad``
    and skipped.

    Args:
        path: the staged file.
        fmt: ``text``, ``jsonl`` or ``parquet`` (see ``detect_format``).
        rel: the file's path in the source: the key of a text file, and of a record without an ``id``
            (with its position: the line of a JSONL file, the row of a Parquet file).
        text_field: the JSONL field that holds a document's text.
        text_column: the Parquet column that holds it.
        as_bytes: plain text files are read as bytes, undecoded (the byte vocabulary).
        bad: bad-record counter by kind, updated as the file is read.
        piece_bytes: the bound on a piece (and on a JSONL line read whole).

    Raises:
        BadFile: the whole file is refused (binary, not UTF-8, wrong Parquet schema, unreadable).
    """
    if fmt == "jsonl":
        return _jsonl(path, rel, text_field, bad, piece_bytes)
    if fmt == "parquet":
        return _parquet(path, rel, text_column, bad, piece_bytes)
    return _text(path, rel, as_bytes, bad, piece_bytes)
