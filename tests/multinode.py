"""What the multi-node tests read of a ``LocalCluster`` (made by conftest's ``cluster`` fixture): its events,
its nodes' logs, the run's summary, its commits and its nodes' memory snapshots and peer copies."""

from __future__ import annotations

import contextlib
import json

from trainer.checkpoint.replica import NodeReplica
from trainer.events import read_events
from trainer.launch import LocalCluster
from trainer.peer import holder_of

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


def held(c, node: int, rank: int) -> list[int]:
    """Steps of ``rank``'s snapshots that node ``node``'s holder keeps (its store's index)."""
    keeper = c.nodes[holder_of(node, len(c.nodes))]
    steps: list[int] = []
    for index in keeper.memory_dir.glob(f"goodput-*/peer-store/node{node}/rank{rank}.index"):
        with contextlib.suppress(OSError, ValueError):
            steps += [e["step"] for e in json.loads(index.read_text()).values()]
    return sorted(steps)


def committed(c, before: float = float("inf")) -> int:
    """The newest step committed (before time ``before``), 0 if none."""
    return max((e["step"] for e in events(c) if e["event"] == "ckpt_committed" and e["t"] < before), default=0)


def newest_snapshot(c, i: int, rank: int) -> int | None:
    """The step of ``rank``'s newest memory snapshot on node ``i``."""
    markers = [NodeReplica(d, rank).marked() for d in c.nodes[i].memory_dir.glob("goodput-*")]
    return next((m["step"] for m in markers if m), None)
