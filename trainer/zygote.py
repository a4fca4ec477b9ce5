"""The warm-start zygote's process (``trainer.warmstart``): import what a rank imports, then fork ranks.

Started by ``trainer.warmstart.run_with_zygote``, never by hand:

    python -m trainer.zygote --listen-fd FD --alive-fd FD [--cold] [--remove-at-end DIR ...]

``--cold``: a janitor only, which imports nothing and forks nothing. The mechanism (fork safety, stdio and
signal hand-over, clean-up) is ``trainer.warmstart``; this module is what it runs: ``python -m trainer``.
"""

import argparse
import gc
import os
import sys
import warnings

from . import warmstart


def preload() -> None:
    """Import what a rank imports, including what torch and NVRx import lazily on first use."""
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    import multiprocessing.managers  # noqa: F401  NVRx's write-results queue (a Manager)
    import multiprocessing.shared_memory  # noqa: F401  checkpoint staging

    import nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async  # noqa: F401
    import nvidia_resiliency_ext.inprocess  # noqa: F401

    from . import compat
    from . import train  # noqa: F401

    compat.preload_compiler()

    # What was imported lives as long as every child: out of the collector's sight, a child's collections
    # neither scan it (see train.run) nor write to its pages, which stay shared with the zygote.
    gc.freeze()


def before_threads() -> None:
    """In a forked rank, while it runs one thread."""
    import torch

    from .checkpoint import fork_write_results_queue

    fork_write_results_queue()
    if "OMP_NUM_THREADS" in os.environ:   # read by OpenMP when the zygote imported torch, not since
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def run_rank(argv: list[str]) -> int:
    from .__main__ import main

    return main(argv)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.zygote", description="The warm-start zygote (started by "
                                "trainer.warmstart, never by hand: trainer.warmstart.zygote_command).")
    p.add_argument("--listen-fd", type=int, required=True, help="the listening socket ranks' proxies connect to")
    p.add_argument("--alive-fd", type=int, required=True, help="a pipe whose end means the launch wrapper is gone")
    p.add_argument("--cold", action="store_true", help="a janitor only: import nothing, fork nothing")
    p.add_argument("--remove-at-end", action="append", default=[], metavar="DIR",
                   help="what the run keeps outside its run directory (its memory snapshots, the wrapper's socket), "
                        "removed at its end")
    a = p.parse_args(argv)
    if not a.cold:
        preload()
    warmstart.serve(a.listen_fd, a.alive_fd, None if a.cold else warmstart.ChildRun(before_threads, run_rank),
                    tuple(a.remove_at_end))
    # The run is over and cleaned up: skip the interpreter's teardown of torch and NVRx (most of a second),
    # which would keep the run's last process alive that much longer.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
