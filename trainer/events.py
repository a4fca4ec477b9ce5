"""The run's event log: ``<out>/events.jsonl``, one JSON object per line, appended by every rank.

Each event has ``t`` (wall clock, seconds since the epoch), ``rank``, ``event`` and its own fields. The
log spans every attempt of a run (restarts append), so ``summary.json`` is derived from it alone.

A line can be torn only by a writer that died mid-write (or is still writing): the last line of the file.
The next writer to open the log seals such a line: it ends it and appends a ``torn_line`` event, so the
torn line stays recognisable once later attempts append after it. Readers skip a torn last line and a
sealed one; any other line that is not an event is an ``EventLogError`` naming the file and the line.

``Event`` is the schema: each event's name and fields, the one definition that emitters (``EventLog.emit``
checks the fields it is given) and readers (which compare ``e["event"]`` with its members) use.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import time
from pathlib import Path


class Event(enum.StrEnum):
    """Every event of the log: its name (the ``event`` of a line; a member equals its name, so a line read back
    compares with it) and its fields, those every emit gives (``fields``) and those some give (``optional``).
    docs/training.md lists them (tests/test_events.py keeps the two the same)."""

    def __new__(cls, name: str, fields: tuple[str, ...] = (), optional: tuple[str, ...] = ()):
        event = str.__new__(cls, name)
        event._value_ = name
        event.fields, event.optional = frozenset(fields), frozenset(optional)
        return event

    # A process of an attempt, and the run
    WORKER_START = "worker_start", ("pid", "warm")
    RUN_START = "run_start", ("world_size", "restart_count", "run_id", "agent_attempts", "agent_restart_counts")
    RESTART = "restart", ("layer",), ("restart_count", "membership_change", "iteration")
    RESUMED = "resumed", ("step", "source")
    FRESH_START = "fresh_start", ("step", "source")
    INIT_FROM = "init_from", ("path",)
    STEP = "step", ("step", "loss", "step_s", "lr", "tokens", "tokens_per_s"), ("mfu",)
    RUN_END = "run_end", ("step", "val_loss")
    SIGTERM = "sigterm", ("step", "signal")
    EXIT = "exit", ("reason", "step", "ckpt_s")
    FATAL = "fatal", ("reason",)
    # Faults, hangs, slow ranks, spot reclaims
    FAULT_INJECTED = "fault_injected", ("fault", "kind", "step"), ("target",)
    FT_STEP_TIMEOUT = "ft_step_timeout", ("step", "timeout_s")
    DATA_STARVED = "data_starved", ("step", "ratio", "window_steps")
    STRAGGLER = "straggler", ("step", "ranks", "nodes", "relative", "individual", "scores")
    SPOT_NOTICE = "spot_notice", ("action", "notice_time", "seconds_left")
    SPOT_CHECKPOINT = "spot_checkpoint", ("step", "since_notice_s")
    SPOT_WATCH_ERROR = "spot_watch_error", ("error",)
    # Checkpoints
    CKPT_INTERVAL = "ckpt_interval", ("steps", "block_s", "interference_s", "mtbf_s", "step_s")
    CKPT_START = "ckpt_start", ("step",)
    CKPT_SNAPSHOT = "ckpt_snapshot", ("step", "block_s", "sync"), (
        "wait_s", "commit_s", "stage_s", "plan_s", "start_s", "copy_before_plan_s", "copy_wait_s", "copy_s",
        "core_wait_s")
    MEMORY_SNAPSHOT = "memory_snapshot", ("step", "block_s", "copy_s"), (
        "start_s", "copy_wait_s", "mark_s", "owed", "core_wait_s")
    CKPT_HANDED_OVER = "ckpt_handed_over", ("step", "deferred_s", "hand_over_s", "booted"), ("held_for_boot",)
    HELPER_HUNG = "helper_hung", ("reason",)
    WRITES_MISCOUNTED = "writes_miscounted", ("rank", "what", "counted", "in_nvrx")
    CKPT_COMMITTED = "ckpt_committed", ("step", "commit_s")
    CKPT_TORN_DELETED = "ckpt_torn_deleted", ("step",)
    CKPT_LOADED = "ckpt_loaded", ("step", "source"), ("load_s", "fetched")
    CKPT_VERIFIED = "ckpt_verified", ("step", "verify_s")
    RESHARDED = "resharded", ("from_world_size", "to_world_size", "step")
    CHECKSUM_MISMATCH = "checksum_mismatch", ("source", "step", "rank", "reason")
    PEER_REFUSED = "peer_refused", ("role", "peer", "reason")
    # The S3 mirror
    MIRROR_READY = "mirror_ready", ("url", "keep", "required")
    MIRROR_START = "mirror_start", ("step", "files", "bytes", "attempt")
    MIRROR_COMMITTED = "mirror_committed", ("step", "bytes", "seconds", "lag_s", "attempt")
    MIRROR_SKIPPED = "mirror_skipped", ("step", "reason")
    MIRROR_DELETED = "mirror_deleted", ("step", "torn")
    MIRROR_DRAIN = "mirror_drain", ("waited_s", "left")
    MIRROR_ERROR = "mirror_error", ("step", "phase", "error"), ("retry_in_s", "attempt")
    RESUMED_FROM_MIRROR = "resumed_from_mirror", ("step", "bytes", "download_s", "url", "ignored_unmarked")
    # The log itself: seals the torn line right before it (written by ``EventLog`` on open)
    TORN_LINE = "torn_line"

    def check(self, given: dict) -> None:
        """Raises TypeError unless ``given`` has every field of this event and no other."""
        missing, unknown = self.fields - given.keys(), given.keys() - self.fields - self.optional
        problems = [f"{what} field(s) {sorted(names)}" for what, names in (("missing", missing), ("unknown", unknown))
                    if names]
        if problems:
            raise TypeError(f"event {self.value!r}: {'; '.join(problems)} (its fields: {sorted(self.fields)}, "
                            f"optional: {sorted(self.optional)})")


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
                os.write(self._fd, b"\n" + self._record(Event.TORN_LINE, {}))

    def _record(self, event: Event, fields: dict) -> bytes:
        return (json.dumps({"t": round(time.time(), 6), "rank": self.rank, "event": event, **fields}) + "\n").encode()

    def emit(self, event: Event, **fields) -> None:
        """Append ``event`` with ``fields``.

        Raises:
            TypeError: ``event`` is not an ``Event``, or ``fields`` are not its fields (a programming error:
                no reader would find such an event).
        """
        if not isinstance(event, Event):
            raise TypeError(f"EventLog.emit takes an Event (trainer.events), not {event!r}")
        event.check(fields)
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
        if sealed is None or sealed["event"] != Event.TORN_LINE:
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
