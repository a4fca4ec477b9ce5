"""Where things live, readable without torch (the launcher, the components and evaluate use it): the FSx
root's directories, a run directory's files, and its checkpoints.

    <fsx_root>/datasets/<name>/<version>/      a staged dataset (manifest.json + shards)
    <fsx_root>/sources/<name>/<version>/       the default dataset's source files (``goodput run --local``)
    <fsx_root>/pretrained/<bucket>/<prefix>/   a Hugging Face model directory staged from S3
    <fsx_root>/runs/<run id>/                  a run directory (``--out``):
        checkpoints/step_<N, 9 digits>/        a checkpoint once its ``COMMITTED`` marker exists
        config.json  events.jsonl  summary.json  progress.json  evaluation/  jobs/
    <fsx_root>/models/                         the local model registry

Durable writes are ``trainer.durable``'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .digests import path_digest

# A dataset's name and version, a run id: one plain path component each.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

DATASETS, SOURCES, PRETRAINED, RUNS, MODELS = "datasets", "sources", "pretrained", "runs", "models"


def _component(what: str, value: str) -> str:
    if not NAME_RE.match(value or ""):
        raise ValueError(f"{what} {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit")
    return value


MANIFEST = "manifest.json"      # a dataset directory is complete once its manifest exists


def dataset_dir(fsx_root: str | Path, name: str, version: str) -> Path:
    """``<fsx_root>/datasets/<name>/<version>``; name and version must be plain path components."""
    return Path(fsx_root) / DATASETS / _component("dataset name", name) / _component("dataset version", version)


def sources_dir(fsx_root: str | Path, name: str, version: str) -> Path:
    """Where a dataset's source files are copied when they do not come from S3 (the default dataset)."""
    return Path(fsx_root) / SOURCES / _component("dataset name", name) / _component("dataset version", version)


def pretrained_dir(fsx_root: str | Path, bucket: str = "", prefix: str = "") -> Path:
    """Where the model directory at ``s3://<bucket>/<prefix>`` is staged (the caller checks that the prefix is
    a safe relative path); without a bucket, the directory of all of them."""
    return Path(fsx_root) / PRETRAINED / bucket / prefix.strip("/")


def runs_dir(fsx_root: str | Path) -> Path:
    return Path(fsx_root) / RUNS


def run_dir(fsx_root: str | Path, run_id: str) -> Path:
    """The run directory of run ``run_id`` (a KFP run id, a job name)."""
    return runs_dir(fsx_root) / run_id


def models_dir(fsx_root: str | Path) -> Path:
    """The model registry on FSx, when the run names no other."""
    return Path(fsx_root) / MODELS


# A run directory's files: the trainer writes them; the launcher, evaluate, report and the CLI read them.

CHECKPOINTS = "checkpoints"      # also under the S3 mirror's prefix (``trainer.mirror``)


def checkpoints_dir(out: str | Path) -> Path:
    return Path(out) / CHECKPOINTS


def config_path(out: str | Path) -> Path:
    """The run's resolved config with its model spec, which evaluate and export rebuild the model from."""
    return Path(out) / "config.json"


def settings_path(out: str | Path) -> Path:
    """The run's settings, which every start of the run is held to (``trainer.config.record_settings``)."""
    return Path(out) / "settings.json"


def events_path(out: str | Path) -> Path:
    """One event per line (``trainer.events``)."""
    return Path(out) / "events.jsonl"


def jobs_dir(out: str | Path) -> Path:
    """A file per job training in the run directory, locked by its nodes (``trainer.runlock``)."""
    return Path(out) / "jobs"


def summary_path(out: str | Path) -> Path:
    """The finished run's figures (``trainer.summary``)."""
    return Path(out) / "summary.json"


def progress_path(out: str | Path) -> Path:
    """The live figures of a running run (``trainer.status_report``)."""
    return Path(out) / "progress.json"


def evaluation_dir(out: str | Path) -> Path:
    """Evaluate's default output directory (``EVALUATION_FILE``, ``REPORT_FILE``)."""
    return Path(out) / "evaluation"


EVALUATION_FILE, REPORT_FILE = "evaluation.json", "report.html"      # in evaluate's output directory


COMMITTED = "COMMITTED"
_STEP_PREFIX = "step_"


def step_dir(root: Path, step: int) -> Path:
    # Zero-padded so that lexical order is step order (NVRx convention).
    return root / f"{_STEP_PREFIX}{step:09d}"


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_STEP_PREFIX) or not name[len(_STEP_PREFIX):].isdigit():
        return None
    return int(name[len(_STEP_PREFIX):])


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    steps = [step_of(p) for p in root.iterdir() if (p / COMMITTED).is_file()]
    return sorted(s for s in steps if s is not None)


def read_marker(path: Path) -> dict:
    return json.loads((path / COMMITTED).read_text())


def replica_dir(root: Path, out: Path) -> Path:
    """A run's memory-snapshot directory under ``root`` (``trainer/checkpoint/replica.py``), named after its
    checkpoint directory ``out`` (several runs share a node)."""
    return root / f"goodput-{path_digest(out)}"


# A rank's memory snapshot in its replica directory (``trainer/checkpoint/replica.py`` writes them,
# ``trainer/peer.py`` ships them without torch): two slots, the marker naming the complete one, and the
# marker of the one before it.

def replica_marker(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.marker"


def replica_previous(directory: Path, rank: int) -> Path:
    """The marker of the snapshot before the marked one, while its slot is untouched."""
    return directory / f"rank{rank}.previous"


def replica_slot(directory: Path, rank: int, slot: int) -> Path:
    return directory / f"rank{rank}.slot{slot}"


def replica_ranks(directory: Path) -> list[int]:
    """The ranks with a marker in ``directory``."""
    return sorted(int(p.name[4:-7]) for p in directory.glob("rank*.marker"))


def peer_file(directory: Path) -> Path:
    """Where a node's ranks tell its janitor's peer sender (``trainer/peer.py``) which node it is and where
    that node's holder listens: learnt at each restore, after the rendezvous."""
    return directory / "peer.json"
