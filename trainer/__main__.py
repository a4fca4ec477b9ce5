"""``python -m trainer``: parse the config, train, exit. See ``trainer.train`` for launch commands."""

import logging
import os
import sys
import warnings
from pathlib import Path

from . import warmstart
from .config import check_run_directory, parse_config
from .signals import die_with_parent


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(name)s] %(message)s", stream=sys.stdout)
    if argv is None:
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # Started by a launcher (ft_launcher, torchrun), which puts every worker in a session of its own:
            # a launcher killed outright (SIGKILL) must not leave its workers running.
            die_with_parent()
        # Under ``trainer.warmstart``: run in a fork of the zygote and exit. Before the arguments are parsed:
        # checking the model imports torch, which the fork has already; the fork parses and checks them itself.
        warmstart.delegate(sys.argv[1:])
    try:
        cfg = parse_config(argv)
        check_run_directory(Path(cfg.run.out), cfg)   # another run's directory: refused before anything is written
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .train import run   # torch is imported only once the arguments are known to be good

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
