"""The trainer's settings document from its command-line flags, read by the trainer's own parser."""

from trainer.config import parse_config


def settings(*flags: str) -> dict:
    """``settings("--max-steps", "50")`` -> ``{"run": {"max_steps": 50}}`` (``TrainConfig.document()``)."""
    return parse_config(list(flags), validate=False).document()


def flags(*argv: str):
    """The ``TrainConfig`` of trainer flags, not yet validated (as ``goodput train`` hands it to its launcher)."""
    return parse_config(list(argv), validate=False)
