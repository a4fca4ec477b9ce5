"""``images/``: the trainer and component Dockerfiles, checked without Docker.

Pinned bases, a non-root user, the package and its entry points installed, requirement pins that satisfy
``pyproject.toml``, KFP's artifact mount points writable, and the light image's promise (no torch) checked by
importing what it imports with torch made unimportable. The component images come from parameters with
defaults (``GOODPUT_COMPONENT_IMAGE``, ``GOODPUT_EVALUATE_IMAGE``, the pipeline's ``trainer_image``).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TRAINER_ONLY = {"torch", "nvidia-resiliency-ext", "kubeflow"}
NVRX = "nvidia-resiliency-ext"


def constraints() -> dict[str, str]:
    """What the tests install (constraints.txt): name -> exact version."""
    return pins(ROOT / "constraints.txt")


def check_deps_fact(name: str) -> str:
    """A ``NAME=value`` fact of images/check_deps.sh about the base images."""
    (value,) = re.findall(rf'(?:^|; ){name}="?([^";\n]*)"?', (IMAGES / "check_deps.sh").read_text(), re.M)
    return value


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def pins(path: Path) -> dict[str, str]:
    """name -> exact version of a requirements file, following ``-r`` includes."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            out.update(pins(path.parent / line[3:].strip()))
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: {line} is not pinned with =="
        out[_canonical(req.name)] = spec.version
    return out


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_arg(path: Path, name: str) -> str:
    """The default of a Dockerfile's ``ARG name=default``."""
    (value,) = [args.partition("=")[2] for op, args in instructions(path) if op == "ARG" and
                args.partition("=")[0] == name]
    return value


def trainer_pins() -> dict[str, str]:
    """The trainer image's pins: its requirements and NVRx at the NVRX_RELEASE build arg's default."""
    return {**pins(IMAGES / "requirements-trainer.txt"),
            "nvidia-resiliency-ext": build_arg(IMAGES / "trainer.Dockerfile", "NVRX_RELEASE")}


@pytest.fixture(params=["trainer", "components"])
def image(request):
    return request.param, instructions(IMAGES / f"{request.param}.Dockerfile")


def test_base_images_are_pinned(image):
    name, ins = image
    froms = [args.split()[0] for op, args in ins if op == "FROM"]
    assert len(froms) == 1
    base = froms[0]
    repo, _, tag = base.partition("@")[0].rpartition(":")
    assert ":" in base.partition("@")[0] and tag and tag != "latest" and re.search(r"\d", tag), base
    if name == "trainer":
        # A CUDA PyTorch base: NGC's PyTorch image (torch built for CUDA, NCCL, cuDNN).
        assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base) or re.fullmatch(
            r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", base), base
    else:
        assert repo == "python" and "slim" in tag


def test_images_run_as_the_same_non_root_user(image):
    name, ins = image
    users = [args for op, args in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0") and users[-1].isdigit()
    assert users[-1] == [a for op, a in instructions(IMAGES / "components.Dockerfile") if op == "USER"][-1]
    run = " ".join(args for op, args in ins if op == "RUN")
    assert f"useradd --uid {users[-1]}" in run
    # KFP writes artifacts below these prefixes (kfp.dsl.types.artifact_types); as non-root they must exist.
    from kfp.dsl.types import artifact_types as a

    prefixes = {p.strip("/") for p in (a._GCS_LOCAL_MOUNT_PREFIX, a._MINIO_LOCAL_MOUNT_PREFIX,
                                       a._S3_LOCAL_MOUNT_PREFIX, a._OCI_LOCAL_MOUNT_PREFIX)}
    (mkdir,) = re.findall(r"mkdir -p ((?:/\w+ ?)+)", run)
    (chown,) = re.findall(r"chown goodput ((?:/\w+ ?)+)", run)
    assert {d.strip("/") for d in mkdir.split()} >= prefixes and {d.strip("/") for d in chown.split()} >= prefixes


def test_the_package_is_installed_with_its_code(image):
    name, ins = image
    copied = {args.split()[0] for op, args in ins if op == "COPY"} | {
        src for op, args in ins if op == "COPY" for src in args.split()[:-1]}
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        assert pkg.rstrip("*") in copied, pkg
    assert {"pyproject.toml", "README.md"} <= copied
    run = " && ".join(args for op, args in ins if op == "RUN")
    assert "pip install --no-deps ." in run
    req = "images/requirements-trainer.txt" if name == "trainer" else "images/requirements-components.txt"
    assert f"-r {req}" in run
    # The build fails if the installed package cannot do its job: these run at build time.
    if name == "trainer":
        assert "ft_launcher --help" in run and "python -m trainer --help" in run
        # NGC's pre-release torch is held at its own version while requirements install.
        assert "grep -E '^torch=='" in run and "-c /tmp/base-constraints.txt" in run
    else:
        assert "goodput --help" in run and "sys.exit('torch' in sys.modules)" in run


def test_entrypoints_exist(image):
    name, ins = image
    (cmd,) = [shlex.split(args.replace('"', "").strip("[]").replace(",", " ")) for op, args in ins if op == "CMD"]
    if cmd[0] == "goodput":
        assert PYPROJECT["project"]["scripts"]["goodput"] == "pipelines.cli:main"
    else:
        assert cmd[:3] == ["python", "-m", "trainer"] and (ROOT / "trainer" / "__main__.py").is_file()
    if name == "trainer":
        # The PyTorchJob's command is ft_launcher (the console script of the pinned NVRx) behind the image's
        # python running trainer.warmstart.
        dist = importlib.metadata.distribution(NVRX)          # the tests' (constraints.txt), as the image's has
        assert dist.version == constraints()[NVRX]
        assert any(e.name == "ft_launcher" for e in dist.entry_points if e.group == "console_scripts")
        from components.train.pytorchjob import JobSpec

        assert JobSpec(image="x").pod_command()[:4] == ["python", "-m", "trainer.warmstart", "ft_launcher"]
        assert (ROOT / "trainer" / "warmstart.py").is_file()


def test_requirement_pins_satisfy_pyproject():
    deps = [Requirement(d) for d in PYPROJECT["project"]["dependencies"]]
    light, trainer = pins(IMAGES / "requirements-components.txt"), trainer_pins()
    assert not {_canonical(n) for n in light} & TRAINER_ONLY                 # the light image has no torch/NVRx
    for dep in deps:
        name = _canonical(dep.name)
        if name == "torch":
            assert name not in trainer                                       # the base image's CUDA build
            continue
        pinned = trainer if name in TRAINER_ONLY else light
        assert name in pinned, f"{dep} is not pinned for the images"
        assert dep.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} vs {dep}"
    # And the pins are what these tests run with, but NVRx: the tests run on constraints.txt's release.
    for name, version in trainer.items():
        if name != NVRX:
            assert importlib.metadata.version(name) == version, name


def test_the_declared_python_versions_are_those_tested_and_those_of_the_images():
    """requires-python and the classifiers name exactly the Pythons the tests and the images run."""
    from packaging.specifiers import SpecifierSet

    prefix = "Programming Language :: Python :: "
    versions = [c[len(prefix):] for c in PYPROJECT["project"]["classifiers"] if c.startswith(prefix)]
    declared = {v for v in versions if re.fullmatch(r"3\.\d+", v)}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert declared == {here, check_deps_fact("TRAINER_PYTHON"), check_deps_fact("COMPONENTS_PYTHON")}
    lowest = min(declared, key=lambda v: tuple(map(int, v.split("."))))
    below = f"3.{int(lowest.split('.')[1]) - 1}"
    assert [v in SpecifierSet(PYPROJECT["project"]["requires-python"]) for v in (below, *sorted(declared))] == \
        [False] + [True] * len(declared)


def test_the_trainer_image_pins_and_labels_the_nvrx_release_the_launch_commands_default_to():
    """One pin: trainer/compat.py's IMAGE_RELEASE is the NVRX_RELEASE build arg's default, the image installs
    NVRx at that arg and nowhere else, carries it as a label, and the tests here run on it."""
    from trainer import compat

    dockerfile = IMAGES / "trainer.Dockerfile"
    ins = instructions(dockerfile)
    assert build_arg(dockerfile, "NVRX_RELEASE") == compat.IMAGE_RELEASE
    assert ("LABEL", f'{compat.IMAGE_RELEASE_LABEL}="${{NVRX_RELEASE}}"') in ins
    # The ARG is declared after FROM (so RUN and LABEL see it) and before the install that uses it.
    ops = [op for op, _ in ins]
    (install,) = [i for i, (op, a) in enumerate(ins) if op == "RUN" and "requirements-trainer.txt" in a]
    assert ops.index("FROM") < [i for i, (op, a) in enumerate(ins) if a.startswith("NVRX_RELEASE=")][0] < install
    assert '"nvidia-resiliency-ext==${NVRX_RELEASE}"' in ins[install][1]
    pinned = [p.name for p in IMAGES.iterdir() for line in p.read_text().splitlines()
              if re.match(r"\s*nvidia[-_]resiliency[-_]ext\s*[=<>~]", line)]
    assert pinned == [], f"NVRx pinned outside the build arg: {pinned}"
    from components.train.pytorchjob import JobSpec

    assert JobSpec(image="x").release == compat.release(compat.IMAGE_RELEASE)     # what pods are built for
    assert compat.IMAGE_RELEASE in compat.CHECKED
    assert compat.IMAGE_RELEASE not in check_deps_fact("NVRX_NOT_ON_TRAINER_PYTHON").split(), \
        "the image's default NVRx has no wheel for the image's Python"


def test_the_tests_nvrx_release_is_the_projects_choice():
    """constraints.txt pins the release the tests run on (a checked one), and CI and the README install with it."""
    from trainer import compat

    pinned = constraints()[NVRX]
    assert pinned in compat.CHECKED and str(compat.installed_version()) == pinned, \
        f"the tests run on {compat.installed_version()}, constraints.txt pins {pinned}: pip install -c constraints.txt"
    command = "python -m pip install -c constraints.txt torch==2.13.0 -e '.[test]'"
    assert command in (ROOT / "README.md").read_text() and command in (ROOT / ".ci" / "run").read_text()


def test_the_dependency_check_covers_both_images_as_their_dockerfiles_are():
    """images/check_deps.sh resolves for each base's Python and glibc: its facts name the Dockerfiles' bases (a
    changed FROM stops it before any resolution), and CI runs it."""
    for image in ("trainer", "components"):
        (base,) = [a.split()[0] for op, a in instructions(IMAGES / f"{image}.Dockerfile") if op == "FROM"]
        assert check_deps_fact(f"{image.upper()}_BASE") == base
    assert "bash images/check_deps.sh" in (ROOT / ".ci" / "run").read_text()
    # The trainer image's Python and the pins of what PyPI has only as sdists.
    assert check_deps_fact("TRAINER_PYTHON") == "3.12"
    for name in check_deps_fact("SDIST_ONLY").split():
        assert _canonical(name) in trainer_pins(), f"{name} is built by check_deps.sh from its pin; pin it"


def test_the_dependency_check_refuses_a_base_it_does_not_know(tmp_path):
    """The guard of images/check_deps.sh, run on a copy whose trainer image moved to another base."""
    copy = tmp_path / "repo"
    (copy / "images").mkdir(parents=True)
    for f in IMAGES.iterdir():
        (copy / "images" / f.name).write_text(f.read_text())
    dockerfile = copy / "images" / "trainer.Dockerfile"
    dockerfile.write_text(re.sub(r"^FROM \S+", "FROM nvcr.io/nvidia/pytorch:27.01-py3", dockerfile.read_text(),
                                 flags=re.M))
    res = subprocess.run(["bash", str(copy / "images" / "check_deps.sh")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "27.01-py3" in res.stderr and "update this script" in res.stderr, res.stderr


def _installed_and_another() -> list[tuple[str, bool]]:
    from trainer import compat

    installed = str(compat.installed_version())
    other = next(v for v in reversed(compat.CHECKED) if v != installed)
    return [(installed, True), (other, False), ("0.8.0", False), ("0.3.0", False)]


@pytest.mark.parametrize("release, ok", _installed_and_another())
def test_the_trainer_image_build_refuses_an_nvrx_it_did_not_install_or_the_gate_does_not_know(release, ok):
    """The build's own check, run here (with the NVRx installed here) with the build arg set to ``release``: an
    image whose installed NVRx is not the labelled one, or one the launch command is not checked for, fails to
    build."""
    (run,) = [a for op, a in instructions(IMAGES / "trainer.Dockerfile")
              if op == "RUN" and "compat.installed_release()" in a]
    (code,) = [c for c in re.findall(r'python -c "([^"]*)"', run) if "installed_release" in c]
    res = subprocess.run([sys.executable, "-c", code.replace("${NVRX_RELEASE}", release)], cwd=ROOT,
                         capture_output=True, text=True)
    assert (res.returncode == 0) == ok, res.stderr[-2000:]


def test_dockerignore_keeps_the_context_small_but_complete():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", "fsx"} <= ignored
    assert not ignored & {"trainer", "components", "pipelines", "images", "pyproject.toml", "README.md"}


_BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'nvidia_resiliency_ext'):
            raise ImportError('not in the component image: ' + name)
sys.meta_path.insert(0, Block())
import importlib.metadata
_version = importlib.metadata.version
def version(dist):   # the component image has no NVRx distribution either
    if dist == 'nvidia-resiliency-ext':
        raise importlib.metadata.PackageNotFoundError(dist)
    return _version(dist)
importlib.metadata.version = version
"""


def test_the_light_image_s_modules_work_without_torch(tmp_path):
    """What the component image imports at build time, and the cluster launch path (JobSpec -> manifest,
    trainer argument checks) and a local stage, all with torch and NVRx unimportable."""
    (check,) = [a for op, a in instructions(IMAGES / "components.Dockerfile") if op == "RUN" and "torch" in a]
    modules = re.search(r'import sys, ([\w., ]+);', check).group(1)
    src = tmp_path / "texts"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.txt").write_text(f"some text {i} " * 200)
    code = _BLOCK_TORCH + f"""
import {modules}
from components.train.pytorchjob import JobSpec, job_manifest
from components.stage.dataset import stage_dataset
m = job_manifest(JobSpec(image='x', nodes=2, trainer=dict(run=dict(max_steps=10))))
assert m['kind'] == 'PyTorchJob'
from components.train.trainjob import trainjob_manifest
assert trainjob_manifest(JobSpec(image='x', nodes=2, nvrx_release='0.7.0'))['kind'] == 'TrainJob'
r = stage_dataset({str(src)!r}, {str(tmp_path / 'fsx')!r}, 'd', '1', val_percent=50)
assert r.files == 8, r
import components.stage.model  # the init_from stage runs on the component image
assert 'torch' not in sys.modules
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]


def test_component_images_come_from_parameters_with_defaults():
    ops = {"stage_op": "components.stage.dataset_op", "stage_model_op": "components.stage.model_op",
           "train_config_op": "components.train.settings_op",
           "train_op": "components.train.launch", "register_op": "components.evaluate.register_op",
           "cleanup_op": "components.train.cleanup_op", "evaluate_op": "components.evaluate.evaluate_op"}
    code = ("import importlib, json\nout = {}\n"
            f"for name, mod in {ops!r}.items():\n"
            "    spec = getattr(importlib.import_module(mod), name).component_spec\n"
            "    out[name] = spec.implementation.container.image\n"
            "print(json.dumps(out))")

    def images(**env) -> dict:
        e = {k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_")} | env
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=e)
        assert res.returncode == 0, res.stderr[-2000:]
        import json

        return json.loads(res.stdout.splitlines()[-1])

    from components.train.launch import TRAINER_IMAGE

    on_trainer = {"evaluate_op", "train_config_op"}     # evaluation and the model check need torch
    defaults = images()
    assert {defaults[k] for k in on_trainer} == {TRAINER_IMAGE}
    assert {v for k, v in defaults.items() if k not in on_trainer} == {"ghcr.io/goodput-pipelines/goodput:0.1.0"}
    built = images(GOODPUT_COMPONENT_IMAGE="123.dkr.ecr.us-west-2.amazonaws.com/goodput-components:0.1.0",
                   GOODPUT_EVALUATE_IMAGE="123.dkr.ecr.us-west-2.amazonaws.com/goodput-trainer:0.1.0",
                   GOODPUT_TRAINER_IMAGE="123.dkr.ecr.us-west-2.amazonaws.com/goodput-trainer:0.1.0")
    assert all(built[k].endswith("goodput-trainer:0.1.0") for k in on_trainer)
    assert {v for k, v in built.items() if k not in on_trainer} == {
        "123.dkr.ecr.us-west-2.amazonaws.com/goodput-components:0.1.0"}
    # The trainer pods' image is a pipeline parameter whose default is the same trainer image.
    from components.train.parameters import PARAMETERS

    assert PARAMETERS["trainer_image"].default == TRAINER_IMAGE
