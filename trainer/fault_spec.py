"""The faults a run injects, for tests, benchmarks and users validating a cluster: what ``--inject-fault`` and
``--chaos-seed`` name. The config and the launcher parse them here, so a bad one is refused before anything
starts; ``trainer.faults`` fires them in the ranks.

``--inject-fault KIND@STEP[:RANK]`` (repeatable; RANK defaults to 0) fires KIND on RANK during step
STEP, after the backward pass and before the optimizer step:

    exception    raise an exception (in-process restart catches it)
    kill         SIGKILL this rank (ft_launcher restarts the worker group)
    hang         stop making progress without exiting (the rank monitor / watchdog notices)
    hang-after-snapshot
                 hang at the first step at or after STEP at which this rank's newest memory snapshot is of a
                 step past the newest committed checkpoint (with --ckpt-sync none commits after it): a test
                 that then loses a node knows a snapshot newer than the checkpoint is there to restore
    sigterm      send SIGTERM to this rank (checkpoint, clean exit; the job is restarted)
    ckpt-crash   SIGKILL this rank right after its part of the first checkpoint at or after STEP was
                 handed to the writer (the checkpoint is torn and must never be used)

The ``corrupt-*`` kinds flip one byte of a copy of the state, at the first step at or after STEP at which
the copy exists with an older one to fall back to, then SIGKILL this rank: the restart's restore must refuse
the copy (a ``checksum_mismatch`` event) and take the next source. ``KIND@STEP[:RANK]/SEED`` picks the file
and the byte from SEED (default 0); the ``fault_injected`` event names them (``target``):

    corrupt-snapshot  this rank's newest memory snapshot, or the one before it, in a tensor's bytes
    corrupt-ckpt      a tensor's bytes in a shard of the newest of at least two committed checkpoints on FSx; the
                      node's memory snapshots are forgotten first (as when the node is lost), so the restore
                      reads the checkpoint (rank 0 only: it commits, so no newer checkpoint comes after the flip)
    corrupt-mirror    a byte of an object of the newest of at least two checkpoints in the S3 mirror
                      (``--ckpt-mirror``); FSx's checkpoints and the node's memory snapshots are then lost (as
                      when the job moves to another cluster), so the restore fetches from the mirror (rank 0)
    corrupt-peer      a tensor's bytes in the copy of this rank's newest memory snapshot that the holder node keeps
                      (``trainer/peer.py``), once it keeps it and an older checkpoint is committed (the fault
                      waits up to ``trainer.faults.PEER_WAIT_S`` for the copy to arrive); the node's memory
                      snapshots are then forgotten (as when the node is lost), so the restore fetches this rank's
                      state from the holder. The holder's memory must be on this machine: a ``LocalCluster``,
                      whose nodes' snapshot directories lie side by side (peer snapshots on)

``--chaos-seed S --fault-every SECONDS``: random kinds and ranks, one fault every SECONDS of the run's
wall time (on average, exponential gaps), reproducible from the seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

CORRUPT_KINDS = ("corrupt-snapshot", "corrupt-ckpt", "corrupt-mirror", "corrupt-peer")
KINDS = ("exception", "kill", "hang", "hang-after-snapshot", "sigterm", "ckpt-crash", *CORRUPT_KINDS)
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<rank>\d+))?(?:/(?P<seed>\d+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    seed: int | None = None     # corrupt-*: picks the bytes

    @property
    def id(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}" + ("" if self.seed is None else f"/{self.seed}")

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        m = _SPEC.match(spec.strip())
        if not m or m["kind"] not in KINDS:
            raise ValueError(f"bad fault {spec!r}: expected KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)} "
                             f"(corrupt-*: KIND@STEP[:RANK][/SEED])")
        fault = cls(m["kind"], int(m["step"]), int(m["rank"] or 0), None if m["seed"] is None else int(m["seed"]))
        if fault.seed is not None and fault.kind not in CORRUPT_KINDS:
            raise ValueError(f"bad fault {spec!r}: only the corrupt-* kinds take a /SEED")
        if fault.kind in ("corrupt-ckpt", "corrupt-mirror") and fault.rank != 0:
            raise ValueError(f"bad fault {spec!r}: {fault.kind} fires on rank 0, which commits (no newer checkpoint "
                             f"may be committed after the flip)")
        return fault


def chaos_schedule(seed: int, every_s: float, world_size: int, horizon_s: float = 7 * 24 * 3600.0,
                   kinds: tuple[str, ...] = ("exception", "kill", "hang")) -> list[tuple[float, str, int]]:
    """(seconds into the run, kind, rank) of random faults, reproducible from ``seed``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / every_s)
        if t > horizon_s:
            return out
        out.append((t, rng.choice(kinds), rng.randrange(world_size)))


def corruption_fault(seed: int, world_size: int, kinds: tuple[str, ...] = CORRUPT_KINDS,
                     steps: tuple[int, int] = (4, 8)) -> str:
    """A ``corrupt-*`` fault for chaos seed ``seed``: the kinds in turn, a step in ``steps`` and (for the
    snapshots and their peer copies) a rank drawn from the seed, and the seed to pick the bytes."""
    rng = random.Random(seed)
    kind = kinds[seed % len(kinds)]
    rank = rng.randrange(world_size) if kind in ("corrupt-snapshot", "corrupt-peer") else 0
    return f"{kind}@{rng.randint(*steps)}:{rank}/{seed}"
