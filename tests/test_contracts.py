"""The contracts every room shares, each defined once: durable writes (``trainer.durable``), S3 URLs
(``trainer.s3url``), weight and path digests (``trainer.digests``), the FSx and run-directory layout
(``trainer.layout``). The last tests read the source and fail when one of them is written again elsewhere."""

from __future__ import annotations

import ast
import functools
import os
import selectors
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer import layout
from trainer.durable import staging_dir, write_bytes, write_json
from trainer.s3url import S3Url, parse_s3_url

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("trainer", "components", "pipelines", "bench") for p in sorted((REPO / d).rglob("*.py"))]


# ------------------------------------------------------------------------------ durable writes
def _killed_while_looping(body: str, tmp_path: Path) -> None:
    """Run ``body`` (a loop of writes; it prints ``ready`` once a few are done) in a child process and SIGKILL
    it at whatever moment it has reached then."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(body), str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(child.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=120), "the writer child printed nothing in 120 s"
        assert child.stdout.readline() == "ready\n", f"the writer child failed (exit {child.poll()})"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL


FILE_WRITER = """
    import sys
    from pathlib import Path
    from trainer.durable import write_bytes

    path, i = Path(sys.argv[1]) / "state.bin", 0
    while True:
        write_bytes(path, str(i % 10).encode() * (4 << 20))     # version i: 4 MiB of one digit
        i += 1
        if i == 3:
            print("ready", flush=True)
"""


@pytest.mark.parametrize("trial", range(3))
def test_a_write_killed_at_any_moment_leaves_a_whole_version(tmp_path, trial):
    _killed_while_looping(FILE_WRITER, tmp_path)
    data = (tmp_path / "state.bin").read_bytes()
    assert len(data) == 4 << 20 and len(set(data)) == 1, "the file holds a torn write"
    write_bytes(tmp_path / "state.bin", b"next")           # the temporary file the kill left is no obstacle
    assert (tmp_path / "state.bin").read_bytes() == b"next"


DIR_WRITER = """
    import sys
    from pathlib import Path
    from trainer.durable import staging_dir

    dest, i = Path(sys.argv[1]) / "model", 0
    while True:
        with staging_dir(dest) as tmp:
            for k in range(8):
                (tmp / f"shard{k}").write_bytes(str(i % 10).encode() * (512 << 10))
        i += 1
        if i == 3:
            print("ready", flush=True)
"""


@pytest.mark.parametrize("trial", range(3))
def test_a_directory_republished_when_killed_is_one_whole_version(tmp_path, trial):
    _killed_while_looping(DIR_WRITER, tmp_path)
    dest = tmp_path / "model"
    shards = sorted(dest.iterdir())         # published three times before the kill: never absent since
    assert [p.name for p in shards] == [f"shard{k}" for k in range(8)]
    data = b"".join(p.read_bytes() for p in shards)
    assert len(data) == 8 * (512 << 10) and len(set(data)) == 1, "the directory mixes versions or torn files"
    with staging_dir(dest) as tmp:                          # what the kill left beside it is no obstacle
        (tmp / "new").write_text("new")
    assert [p.name for p in dest.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_build_leaves_the_published_directory_alone(tmp_path):
    dest = tmp_path / "model"
    with staging_dir(dest) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(RuntimeError), staging_dir(dest) as tmp:
        (tmp / "weights").write_text("half of v2")
        raise RuntimeError("the export failed")
    assert (dest / "weights").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_write_json_replaces_the_whole_file(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"steps": 100, "losses": list(range(1000))})
    write_json(path, {"steps": 1}, indent=1)
    assert path.read_text() == '{\n "steps": 1\n}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# ------------------------------------------------------------------------------ S3 URLs
@pytest.mark.parametrize("url, bucket, key, prefix", [
    ("s3://b", "b", "", ""),
    ("s3://b/", "b", "", ""),
    ("s3://b/data", "b", "data", "data/"),
    ("s3://b/data/", "b", "data/", "data/"),
    ("s3://b//evals/mc.yaml", "b", "evals/mc.yaml", "evals/mc.yaml/"),
])
def test_an_s3_url_is_a_bucket_and_a_key(url, bucket, key, prefix):
    parsed = parse_s3_url(url)
    assert (parsed.bucket, parsed.key, parsed.prefix) == (bucket, key, prefix)
    assert parsed.join("x.json") == S3Url(bucket, f"{prefix}x.json")


@pytest.mark.parametrize("url, why", [("s3://", "no bucket name"), ("s3:///data", "no bucket name"),
                                      ("s3:// b/data", "no bucket name"), ("gs://b/data", "not an S3 URL"),
                                      ("/fsx/data", "not an S3 URL")])
def test_a_bad_s3_url_is_refused_naming_the_option(url, why):
    with pytest.raises(ValueError) as e:
        parse_s3_url(url, "--ckpt-mirror")
    assert str(e.value) == f"--ckpt-mirror {url!r}: {why}; expected s3://BUCKET[/PREFIX]"


def _mirror(url):
    from trainer.mirror import MirrorLayout
    MirrorLayout(url)


def _trainer_config(url):
    from trainer.config import parse_config
    parse_config(["--data", "-", "--ckpt-mirror", url])


def _registry(url):
    from components.evaluate.register import Registry
    Registry(url)


def _stage_source(url):
    from components.stage.dataset import parse_source
    parse_source(url)


def _init_from(url):
    from components.stage.model import staged_model_dir
    staged_model_dir("/fsx", url)


def _tokenizer(url):
    from components.stage.tokenizer import parse_tokenizer
    parse_tokenizer(url)


@pytest.mark.parametrize("use, option", [(_mirror, "--ckpt-mirror"), (_trainer_config, "--ckpt-mirror"),
                                         (_registry, "registry"), (_stage_source, "source"),
                                         (_init_from, "init_from"), (_tokenizer, "tokenizer")])
def test_every_s3_location_is_parsed_by_the_one_parser(use, option):
    with pytest.raises(ValueError, match=rf"{option} 's3:///x': no bucket name; expected s3://BUCKET\[/PREFIX\]"):
        use("s3:///x")


# ------------------------------------------------------------------------------ digests
def test_the_trainer_and_registration_compute_the_same_params_sha256():
    import torch
    import torch.distributed as dist

    from trainer.digests import params_sha256
    from trainer.train import params_sha256 as trainer_params_sha256

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        # What the trainer writes to summary.json and what evaluate/register compute from a checkpoint.
        assert trainer_params_sha256(model) == params_sha256(model.state_dict())
    finally:
        dist.destroy_process_group()
    # Registered versions keep the digest they were registered with: the definition must not drift.
    weights = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.tensor([1, 2])}
    assert params_sha256(weights) == "628835965109dad725d845e285882eee0acc46f7d5b5739bbfa68e9c14ee0685"
    weights["b"][0, 0] += 1
    assert params_sha256(weights) != "628835965109dad725d845e285882eee0acc46f7d5b5739bbfa68e9c14ee0685"


# ------------------------------------------------------------------------------ the layout
def test_the_components_place_things_where_the_layout_says(tmp_path):
    from components.stage.dataset import dataset_dir
    from components.stage.model import staged_model_dir
    from pipelines.local import default_source
    from trainer.data import DEFAULT_DATASET_NAME, default_dataset_dir, default_dataset_version

    version = default_dataset_version()
    assert default_dataset_dir(tmp_path) == layout.dataset_dir(tmp_path, DEFAULT_DATASET_NAME, version)
    assert dataset_dir(tmp_path, "corpus", "1") == tmp_path / "datasets" / "corpus" / "1"
    staged = staged_model_dir(str(tmp_path), "s3://models/meta/llama3-1b/")
    assert staged == str(layout.pretrained_dir(tmp_path, "models", "meta/llama3-1b"))
    assert staged == str(tmp_path / "pretrained" / "models" / "meta" / "llama3-1b")
    source = default_source(tmp_path)
    assert source == layout.sources_dir(tmp_path, DEFAULT_DATASET_NAME, version) and any(source.iterdir())


@pytest.mark.parametrize("name", ["", "../up", "a/b", ".hidden", "x" * 129])
def test_a_dataset_name_must_be_one_plain_path_component(tmp_path, name):
    with pytest.raises(ValueError, match="dataset name .* must be 1-128 characters"):
        layout.dataset_dir(tmp_path, name, "1")


# ------------------------------------------------------------------------------ written once
def _calls(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{node.lineno}"


@functools.cache
def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def test_only_the_durable_module_renames_or_fsyncs():
    found = []
    for path in SOURCES:
        if path == REPO / "trainer" / "durable.py":
            continue
        for call in _calls(_parse(path)):
            f = call.func
            module = f.value.id if isinstance(f.value, ast.Name) else None
            if (module, f.attr) in {("os", "replace"), ("os", "rename"), ("os", "fsync"), ("shutil", "move")} \
                    or f.attr == "rename" \
                    or (f.attr == "replace" and len(call.args) == 1 and not call.keywords):   # Path.replace
                found.append(f"{_where(path, call)} {ast.unparse(f)}")
    assert not found, f"use trainer.durable (write_bytes/write_json/publish_file/publish_dir/move): {found}"


def test_only_the_s3url_module_takes_an_s3_url_apart():
    found = []
    for path in SOURCES:
        if path == REPO / "trainer" / "s3url.py":
            continue
        tree = _parse(path)
        # "s3://" inside an f-string builds a URL for a message; on its own it is compared, measured or cut.
        formatted = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        found += [_where(path, n) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value == "s3://" and id(n) not in formatted]
    assert not found, f"use trainer.s3url (is_s3_url, parse_s3_url): {found}"


LAYOUT_NAMES = {"checkpoints", "events.jsonl", "summary.json", "progress.json", "manifest.json", "evaluation",
                "evaluation.json", "report.html", "datasets", "runs", "pretrained", "sources", "models"}


def test_only_the_layout_module_spells_out_the_layout():
    found = []
    for path in SOURCES:
        if path == REPO / "trainer" / "layout.py":
            continue
        for n in ast.walk(_parse(path)):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and isinstance(n.right, ast.Constant) \
                    and n.right.value in LAYOUT_NAMES:
                found.append(f"{_where(path, n)} / {n.right.value!r}")
            if isinstance(n, ast.JoinedStr):
                found += [f"{_where(path, n)} {v.value!r}" for v in n.values if isinstance(v, ast.Constant)
                          and v.value.endswith(("/datasets/", "/runs/", "/pretrained/", "/sources/"))]
    assert not found, f"use trainer.layout: {found}"


COMPAT = {REPO / "trainer" / "compat.py": ("torch", "nvidia_resiliency_ext"),
          REPO / "pipelines" / "kfp_compat.py": ("kfp",)}


def _private(dotted: str) -> str | None:
    """The library whose private API ``dotted`` names (a ``_name`` under it; for kfp, also ``kfp.local``'s insides
    beyond its ``__all__``), else None."""
    import kfp.local

    top, *rest = dotted.split(".")
    if top not in ("torch", "nvidia_resiliency_ext", "kfp"):
        return None
    if any(p.startswith("_") and not p.startswith("__") for p in rest) \
            or (rest[:1] == ["local"] and len(rest) > 1 and rest[1] not in kfp.local.__all__):
        return top
    return None


def _dotted_names(tree: ast.AST):
    """(node, the dotted name it reaches through imports) for every import and every attribute chain on an
    imported name."""
    imported = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                yield n, a.name
                imported[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                yield n, f"{n.module}.{a.name}"
                imported[a.asname or a.name] = f"{n.module}.{a.name}"
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            chain, base = [], n
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in imported:
                yield n, ".".join([imported[base.id], *reversed(chain)])


def test_only_the_compat_modules_use_private_apis_of_torch_nvrx_and_kfp():
    found = set()
    for path in SOURCES:
        for node, dotted in _dotted_names(_parse(path)):
            library = _private(dotted)
            if library is not None and library not in COMPAT.get(path, ()):
                found.add(f"{_where(path, node)} {dotted}")
    assert not found, f"reach private APIs through trainer/compat.py (torch, NVRx) or pipelines/kfp_compat.py: " \
                      f"{sorted(found)}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules that ``path`` imports, at its top or inside a function (a lazy import closes a
    circle as well: it only moves the failure to the first call)."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for n in ast.walk(_parse(path)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = ".".join([*package[:len(package) - n.level + 1], *([n.module] if n.module else [])]) \
                if n.level else n.module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in n.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            # A package's modules are not tied to the package by importing its other modules.
            if name and not ".".join(here).startswith(name + ".") and name != ".".join(here):
                found.add(name)
    return found


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules each importing the next and the last the first, if the graph has one."""
    state: dict[str, str] = {}

    def visit(m: str, trail: list[str]) -> list[str] | None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":     # on the path that led here
                return trail[trail.index(n):] + [m]
            if n not in state and (found := visit(n, trail + [m])):
                return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def test_no_modules_import_each_other_in_a_circle():
    """Data walks one way (S3 -> stage -> train -> trainer -> evaluate -> register), and so do the imports: a
    module never reaches, through any chain of imports, one that imports it."""
    modules = {_module_name(p): p for p in SOURCES}
    graph = {m: _imports(p, set(modules)) for m, p in modules.items()}
    circle = _circle(graph)
    assert circle is None, f"these modules import each other in a circle: {' -> '.join(circle + circle[:1])}"


def test_the_circle_finder_names_a_circle_and_finds_none_without_one():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
