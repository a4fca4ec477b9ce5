"""Write the ``ft_launcher`` argument table of one nvidia-resiliency-ext release, from the release itself.

The release's own ``get_args_parser()`` is run, not a reading of its source: later releases build part of
the parser in helpers (``fault_tolerance/cli_args.py``), and the defaults of torch's ``env`` action come
from the environment, which is emptied of ``PET_*`` first. The wheel's pure-Python tree is put first on
``sys.path`` of a child interpreter (this one's torch serves); third-party modules the release imports but
that cannot be found even in ``--deps`` (optional extras such as nv_one_logger.wandb) are replaced with
placeholders, listed in the provenance. A default or choice that comes from a placeholder is refused, so
the table never holds an invented value.

Next to the arguments the file records ``facts`` (what ``trainer/compat.py`` decides by release, read from
the release's modules: straggler package, Wrapper, health checks, the async queue's parameters) and
``internals``: ``compat.check_internals()`` run against the release, i.e. whether every private API the
trainer touches exists there.

    pip download nvidia-resiliency-ext==0.7.0 --no-deps --only-binary=:all: \\
        --python-version 3.12 --platform manylinux_2_39_x86_64 -d wheels/
    pip install --target deps/ grpcio grpcio-tools httpx fastapi slowapi uvicorn \\
        nv-one-logger-core nv-one-logger-training-telemetry
    python tests/data/nvrx/extract.py wheels/*.whl --deps deps/ --git-dir NVRX_CLONE/.git

``--git-dir`` (a clone of NVIDIA/nvidia-resiliency-ext) adds the release tag and whether its
``launcher.py`` is byte-identical to the wheel's (else the commit that is, if any).
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LAUNCHER = "nvidia_resiliency_ext/fault_tolerance/launcher.py"
REPO_PREFIX = "src/"        # where the package lives in the repository
ROOT = Path(__file__).resolve().parents[3]

# Runs in the child: the release's tree first on sys.path, placeholders for what cannot be imported.
_CHILD = r"""
import argparse, importlib.abc, importlib.machinery, json, sys, types
tree = sys.argv[1]
sys.path[:0] = [tree, *sys.argv[2:-1]]
stubbed = []

class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (Placeholder,), {})

class Placeholder(metaclass=_Meta):
    # Whatever the launcher's imports do with it at import time (subclass, call, read) still works.
    def __init__(self, *args, **kwargs):
        pass
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (Placeholder,), {})()
    def __call__(self, *args, **kwargs):
        return self
    def __iter__(self):
        return iter(())

class _Stub(importlib.abc.Loader):
    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__version__ = "999.0.0"       # newer than any version check asks for
        m.__getattr__ = lambda name: getattr(Placeholder, name)
        return m
    def exec_module(self, module):
        pass

def _imported_by_release():
    # The first frame outside the import machinery is the importer; the standard library's own probes
    # (copy.py tries org.python.core) must keep failing as they expect.
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith("<frozen"):
        f = f.f_back
    return f is not None and f.f_code.co_filename.startswith(tree)

class _Finder(importlib.abc.MetaPathFinder):
    # Last on sys.meta_path: consulted only for modules nothing else can import.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("nvidia_resiliency_ext", "torch") or not _imported_by_release():
            return None          # a missing module of the release (or torch) must fail loudly
        stubbed.append(name)
        return importlib.machinery.ModuleSpec(name, _Stub(), is_package=True)

sys.meta_path.append(_Finder())
import nvidia_resiliency_ext
assert nvidia_resiliency_ext.__path__[0].startswith(tree), nvidia_resiliency_ext.__path__
from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

def plain(v, what):
    if isinstance(v, (Placeholder, _Meta)):
        raise SystemExit(f"{what} comes from a placeholder module: {v!r}")
    return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)

parser = get_args_parser()
rows = []
for a in parser._actions:
    if isinstance(a, argparse._HelpAction):
        continue
    takes_value = a.nargs != 0
    rows.append({
        "options": list(a.option_strings),
        "dest": a.dest,
        "default": plain(a.default, a.dest),
        "takes_value": takes_value,
        "nargs": a.nargs,
        "type": getattr(a.type, "__name__", None) if a.type is not None else None,
        "choices": [plain(c, a.dest) for c in a.choices] if a.choices is not None else None,
        "action": type(a).__name__,
        "help": a.help,
    })
# What trainer/compat.py decides by release, read from the release's own modules.
import importlib, inspect
def has(module, attr):
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False
A = "nvidia_resiliency_ext.checkpointing.async_ckpt."
from nvidia_resiliency_ext.checkpointing.async_ckpt import core
from nvidia_resiliency_ext.inprocess import health_check
facts = {
    "straggler_modules": [m for m in ("nvidia_resiliency_ext.straggler", "nvidia_resiliency_ext.attribution.straggler")
                          if has(m, "Detector")],
    "inprocess_wrapper": has("nvidia_resiliency_ext.inprocess", "Wrapper"),
    "inprocess_health_checks": sorted(n for n in dir(health_check) if n.endswith("HealthCheck") and n != "HealthCheck"),
    "public_write_results_queue": has(A + "filesystem_async", "get_write_results_queue"),
    "async_calls_queue_params": list(inspect.signature(core.AsyncCallsQueue.__init__).parameters)[1:],
    "persistent_worker_handles_sigterm": "signal.signal(signal.SIGTERM" in inspect.getsource(core),
    # From 0.6 the save arguments carry None where the write buckets were; the preload function builds them.
    "preload_builds_buckets": "get_rank(), None, self.results_queue" in inspect.getsource(
        importlib.import_module(A + "filesystem_async").FileSystemWriterAsync.get_save_function_and_args),
    # From 0.5 sections without a configured timeout (None: "all") are filtered out before they are sent.
    "end_all_sections_is_noop": hasattr(importlib.import_module(
        "nvidia_resiliency_ext.fault_tolerance.rank_monitor_client").RankMonitorClient, "_should_monitor_section"),
    # 0.7 clones each CPU tensor when the write is planned (0.6 only non-contiguous views).
    "plan_copies_cpu_tensors": 'if ten.device.type == "cpu" and not self.use_cpu_shm_for_gpu_tensors:' in
    inspect.getsource(importlib.import_module(A + "filesystem_async").FileSystemWriterAsync.prepare_write_data),
    "wrapper_adds_device_checks": hasattr(importlib.import_module("nvidia_resiliency_ext.inprocess").Wrapper,
                                          "_construct_restart_health_check"),
    # From 0.6 the agent derives its remaining restarts from the rendezvous round, shared by every node.
    "max_restarts_count_job_cycles": "max_restarts - self._get_global_cycle_number()" in inspect.getsource(
        sys.modules["nvidia_resiliency_ext.fault_tolerance.launcher"]),
}
sys.path.append(sys.argv[-1])          # the project: its list of internals, resolved against this release
from trainer import compat
try:
    internals = {"resolved": compat.check_internals(), "broken": []}
except compat.NVRxCompatError as e:
    internals = {"resolved": [], "broken": str(e).splitlines()[1:]}
print(json.dumps({"parser": {"allow_abbrev": parser.allow_abbrev, "prefix_chars": parser.prefix_chars},
                  "arguments": rows, "stubbed_modules": sorted(set(stubbed)), "facts": facts,
                  "internals": internals}))
"""


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _matching_git(git_dir: str, version: str, blob: str) -> dict:
    """The release tag, and whether its launcher.py is the wheel's; else the newest commit that has it."""
    path = REPO_PREFIX + LAUNCHER
    out: dict = {"tag": None, "commit": None, "launcher_matches_tag": False}
    tag = f"v{version}"
    try:
        out["tag"], out["commit"] = tag, _git(git_dir, "rev-list", "-n1", tag)
        out["launcher_matches_tag"] = _git(git_dir, "rev-parse", f"{tag}:{path}") == blob
    except subprocess.CalledProcessError:
        out["tag"] = None        # no such tag in the clone (0.7.0 was published from a commit not tagged there)
    if not out["launcher_matches_tag"]:
        for commit in _git(git_dir, "rev-list", "--all", "--", path).split():
            if _git(git_dir, "rev-parse", f"{commit}:{path}") == blob:
                out["commit"], out["launcher_matches_commit"] = commit, True
                break
    return out


def extract(wheel: Path, git_dir: str | None, deps: list[str]) -> dict:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with tempfile.TemporaryDirectory() as tree:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tree)
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            version = email.parser.Parser().parsestr(z.read(meta).decode())["Version"]
            launcher = z.read(LAUNCHER)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
        env.pop("PYTHONPATH", None)
        result = subprocess.run([sys.executable, "-c", _CHILD, tree, *deps, str(ROOT)], env=env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{wheel.name}: the launcher's parser could not be built:\n{result.stderr[-4000:]}")
        parsed = json.loads(result.stdout.strip().splitlines()[-1])
    blob = subprocess.run(["git", "hash-object", "--stdin"], input=launcher, capture_output=True,
                          check=True).stdout.decode().strip()
    provenance = {
        "package": "nvidia-resiliency-ext",
        "version": version,
        "wheel": wheel.name,
        "wheel_sha256": digest,
        "file": LAUNCHER,
        "repository_path": REPO_PREFIX + LAUNCHER,
        "launcher_git_blob": blob,
        "function": "get_args_parser",
        "stubbed_modules": parsed["stubbed_modules"],
        "extracted_with": "tests/data/nvrx/extract.py",
    }
    if git_dir:
        provenance["git"] = _matching_git(git_dir, version, blob)
    return {"provenance": provenance, "parser": parsed["parser"], "arguments": parsed["arguments"],
            "facts": parsed["facts"], "internals": parsed["internals"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheels", nargs="+", type=Path, help="nvidia-resiliency-ext wheel files")
    p.add_argument("--git-dir", help="git directory of a NVIDIA/nvidia-resiliency-ext clone, for provenance")
    p.add_argument("--deps", action="append", default=[],
                   help="a directory of the release's third-party requirements (pip install --target DIR ...)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent, help="where launcher-<version>.json go")
    args = p.parse_args(argv)
    for wheel in args.wheels:
        table = extract(wheel, args.git_dir, args.deps)
        path = args.out / f"launcher-{table['provenance']['version']}.json"
        path.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
        print(f"{path}: {len(table['arguments'])} arguments, placeholders for "
              f"{table['provenance']['stubbed_modules'] or 'nothing'}")


if __name__ == "__main__":
    main()
