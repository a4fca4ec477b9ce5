"""Sharded DCP checkpoints written in the background by NVRx, with an atomic commit protocol.

Layout under ``<out>/checkpoints/``::

    step_000000100/   __<rank>_<i>.distcp   shards (written and fsynced by each rank's NVRx worker)
                      .rank<r>.sums          rank r's checksums of the items it staged (integrity)
                      .rank<r>.done          rank r's write results, written when its worker finished
                      .metadata              DCP metadata (rank 0, once every rank is done)
                      COMMITTED              JSON marker, written last through a rename

A directory is a checkpoint only once ``COMMITTED`` exists. Anything else (a crash mid-write, a rank
that died) is torn: never loaded, and deleted at the next start.

The package, one concern a module:

    checkpointer  ``Checkpointer``, the façade the Trainer uses: ``load``, ``step`` (what to save at each
                  step, the final saves), ``close``
    policy        ``IntervalPolicy``: when a checkpoint (every N steps, ``auto``: Young-Daly, every S
                  seconds) and a memory snapshot are due
    manager       ``CheckpointManager``: how a save, a memory snapshot and a restore run
    commit        the commit protocol, retention, torn-step clean-up
    writer        NVRx's writer process and its helpers: start, watch, end with the rank
    staging       the staging copy a save writes from, its kept DCP plan, the background copy
    replica       memory snapshots in node-local shared memory (they survive the rank)
    integrity     checksums of every copy as staged, verified before any restore uses it

and ``trainer.mirror``, the S3 mirror of committed checkpoints.
"""

from ..layout import COMMITTED, committed_steps, step_dir
from .checkpointer import Checkpointer, Decision, Saved, StepSignals
from .commit import delete_checkpoint
from .manager import CheckpointManager
from .policy import AUTO, IntervalPolicy
from .writer import fork_write_results_queue

__all__ = ["AUTO", "COMMITTED", "Checkpointer", "CheckpointManager", "Decision", "IntervalPolicy", "Saved",
           "StepSignals", "committed_steps", "delete_checkpoint", "fork_write_results_queue", "step_dir"]
