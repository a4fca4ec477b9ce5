"""The run's event log: ``<out>/events.jsonl``, one JSON object per line, appended by every rank.

Each event has ``t`` (wall clock, seconds since the epoch), ``rank``, ``event`` and its own fields. The
log spans every attempt of a run (restarts append), so ``summary.json`` is derived from it alone.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path, rank: int):
        self.path, self.rank = Path(path), rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND makes each single write() land whole at the end, even with several ranks appending.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields) -> None:
        if self._fd < 0:
            return        # closed: a SIGTERM during interpreter teardown has nothing left to record
        record = {"t": round(time.time(), 6), "rank": self.rank, "event": event, **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_events(path: Path) -> list[dict]:
    """All events of a run; a line torn by a crash mid-write is skipped."""
    events = []
    if not Path(path).exists():
        return events
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
