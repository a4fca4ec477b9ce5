"""``python -m trainer``: parse the config, train, exit. See ``trainer.train`` for launch commands."""

import logging
import sys
import warnings

from . import warmstart
from .config import parse_config


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(name)s] %(message)s", stream=sys.stdout)
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if argv is None:
        warmstart.delegate(sys.argv[1:])   # under ``trainer.warmstart``: run in a fork of the zygote, exit
    from .train import run   # torch is imported only once the arguments are known to be good

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
