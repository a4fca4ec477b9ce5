"""The run's event log: ``<out>/events.jsonl``, one JSON object per line, appended by every rank.

Each event has ``t`` (wall clock, seconds since the epoch), ``rank``, ``event`` and its own fields. The
log spans every attempt of a run (restarts append), so ``summary.json`` is derived from it alone.

A line can be torn only by a writer that died mid-write (or is still writing): the last line of the file.
The next writer to open the log seals such a line: it ends it and appends a ``torn_line`` event, so the
torn line stays recognisable once later attempts append after it. Readers skip a torn last line and a
sealed one; any other line that is not an event is an ``EventLogError`` naming the file and the line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

TORN_LINE = "torn_line"
"""The event that seals the torn line right before it (written by ``EventLog`` on open)."""


class EventLogError(ValueError):
    """A line of the event log that is not an event and was not torn by a crash: the log was edited or damaged."""


class EventLog:
    def __init__(self, path: Path, rank: int):
        self.path, self.rank = Path(path), rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND makes each single write() land whole at the end, even with several ranks appending.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._seal_torn_line()

    def _seal_torn_line(self) -> None:
        # Locked, so that of the ranks opening the log at once only the first seals the line.
        with _locked(self._fd):
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                os.write(self._fd, b"\n" + self._record(TORN_LINE, {}))

    def _record(self, event: str, fields: dict) -> bytes:
        return (json.dumps({"t": round(time.time(), 6), "rank": self.rank, "event": event, **fields}) + "\n").encode()

    def emit(self, event: str, **fields) -> None:
        if self._fd < 0:
            return        # closed: a SIGTERM during interpreter teardown has nothing left to record
        os.write(self._fd, self._record(event, fields))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def _locked(fd: int):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:       # a file system without flock (Lustre mounted without it): unlocked, as before
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _decode(line: bytes) -> dict | None:
    """The event on ``line``, or None if it is not one."""
    try:
        event = json.loads(line)
    except ValueError:       # JSONDecodeError, or UnicodeDecodeError of a multi-byte character cut in two
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None


def parse_lines(lines: list[bytes], path: Path, first_line: int = 1) -> tuple[list[dict], int]:
    """The events of whole ``lines`` (numbered from ``first_line``), and how many lines were used.

    A line that is not an event is skipped when the next line seals it (``torn_line``); when it is the last
    of ``lines`` it is left unused (the caller decides: the file's torn last line, or wait for its seal).

    Raises:
        EventLogError: any other line that is not an event.
    """
    events = []
    for i, line in enumerate(lines):
        event = _decode(line)
        if event is not None:
            events.append(event)
            continue
        if i + 1 == len(lines):
            return events, i
        sealed = _decode(lines[i + 1])
        if sealed is None or sealed["event"] != TORN_LINE:
            raise EventLogError(f"{path}:{first_line + i}: not an event ({line[:80]!r}); only a line torn by a "
                                f"crash mid-write may be malformed, and this one is neither the last nor sealed")
    return events, len(lines)


def read_events(path: Path) -> list[dict]:
    """All events of a run; a line torn by a crash mid-write (the last, or a sealed one) is skipped.

    Raises:
        EventLogError: a line that is not an event, other than those (it names the file and the line).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if not lines[-1]:
        lines.pop()           # the file ends with a whole line
    # A last line left unused is not an event: torn by a writer that died, or one still writing it.
    events, _ = parse_lines(lines, path)
    return events
