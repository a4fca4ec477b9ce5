"""What the multi-node tests read of a ``LocalCluster`` (made by conftest's ``cluster`` fixture): its events,
its nodes' logs, the run's summary."""

from __future__ import annotations

import json

from trainer.events import read_events
from trainer.launch import LocalCluster

from tests.conftest import until


def events(c: LocalCluster) -> list[dict]:
    return read_events(c.out / "events.jsonl")


def wait_for(c: LocalCluster, predicate, timeout: float = 120) -> dict:
    found: list[dict] = []
    assert until(lambda: found.extend(e for e in events(c) if predicate(e)) or found, timeout), logs(c)
    return found[0]


def logs(c: LocalCluster) -> str:
    return "\n".join(f"--- node {n.index}\n" + "\n".join(n.log.read_text(errors="replace").splitlines()[-60:])
                     for n in c.nodes if n.log and n.log.exists())


def summary(c: LocalCluster) -> dict:
    return json.loads((c.out / "summary.json").read_text())
