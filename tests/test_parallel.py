"""The device mesh (``dp_replicate`` x ``dp_shard`` x ``tp``) and tensor parallelism on real gloo ranks: a model
split over 2 ranks computes what it computes whole, trains to the same weights, and a model without a plan,
or a mesh that does not fit the ranks, is refused with one line before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer.models import ParallelPlan, build_local, build_model, resolve_model
from trainer.models.parallelize import clip_grad_norm_
from trainer.mesh import MeshShape, resolve_mesh
from trainer.parallel import Dist, with_mesh

from tests.test_llama import spawn_ranks
from tests.test_models_registry import EXAMPLES

STEPS = 3
LR = 1e-2
MODELS = {"llama": ("llama", "debug", {"n_layers": 2}),
          "llama-tied": ("llama", "debug", {"n_layers": 2, "tie_embeddings": True}),     # llama3-1b and 3b
          "convlm": ("convlm:model_spec", "tiny", {})}


@pytest.fixture
def convlm_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "convlm"))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 33), generator=g) for _ in range(STEPS)]


def _train(model, spec, batches) -> tuple[torch.Tensor, float]:
    """Logits and loss of the first batch, then ``STEPS`` AdamW steps with the trainer's gradient clipping."""
    x = batches[0]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)   # before the first forward, as the trainer builds it
    with torch.no_grad():
        logits, loss = model(x[:, :-1]), spec.loss(model, x[:, :-1], x[:, 1:]).item()
    for b in batches:
        spec.loss(model, b[:, :-1], b[:, 1:]).backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    return logits, loss


def _train_on_mesh(d, out: Path, model_key: str, shape: MeshShape, syspath: list[str]) -> None:
    import sys
    sys.path[:0] = syspath                  # the example package, in the spawned ranks too
    d = with_mesh(d, shape)
    name, flavor, overrides = MODELS[model_key]
    spec = resolve_model(name, flavor, overrides)
    model = build_model(spec, ParallelPlan(mode="fsdp"), d, seed=3)
    logits, loss = _train(model, spec, _batches())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if d.rank == 0:
        torch.save({"logits": logits, "loss": loss, "weights": full}, out)


@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_tp2_computes_and_trains_like_one_process(tmp_path, process_group, convlm_importable, model_key):
    """Split over 2 ranks by the model's tensor-parallel plan (llama: sequence-parallel norms, attention by
    heads, SwiGLU by width; convlm: its MLPs), the logits and the loss of a batch are those of the whole
    model on one process within 1e-5, and after 3 AdamW steps with gradient clipping so are the weights."""
    dist.destroy_process_group()    # the fixture's 1-rank group: the spawned ranks make their own
    out = tmp_path / "tp2.pt"
    try:
        spawn_ranks(_train_on_mesh, 2, out, model_key, MeshShape(1, 1, 2), [str(EXAMPLES / "convlm")])
    finally:
        dist.init_process_group("gloo")
    name, flavor, overrides = MODELS[model_key]
    spec = resolve_model(name, flavor, overrides)
    whole = build_local(spec, seed=3)
    logits, loss = _train(whole, spec, _batches())
    got = torch.load(out)
    torch.testing.assert_close(got["logits"], logits, rtol=0, atol=1e-5)
    assert abs(got["loss"] - loss) <= 1e-5
    weights = dict(whole.named_parameters())
    assert set(got["weights"]) == set(weights)
    init = build_local(spec, seed=3)
    for fqn, w in weights.items():
        update = w.detach() - init.get_parameter(fqn).detach()
        assert update.norm() > 0, fqn   # every weight trained: the comparison is of updates, not of the init
        # Compared as a whole: AdamW turns a rounding-sized difference in a near-zero gradient into a visible
        # difference of that one element (up to 1.8e-4 seen, where the whole updates differ by 6e-5 of their
        # norm); a wrong split or reduction changes the update itself.
        error = (got["weights"][fqn] - init.get_parameter(fqn).detach() - update).norm() / update.norm()
        assert error <= 1e-3, (fqn, error.item())


def test_a_model_without_a_tensor_parallel_plan_refuses_tp_above_1():
    spec = dataclasses.replace(resolve_model("llama", "debug"), tensor_parallel=None)
    assert spec.tp_problems(1, 128) == []
    (problem,) = spec.tp_problems(2, 128)
    assert "has no tensor-parallel plan" in problem and "--tp 1" in problem


@pytest.mark.parametrize("overrides, seq_len, expected", [
    ({"n_kv_heads": 1, "n_heads": 4}, 64, "n_kv_heads (1) must be a multiple of --tp 2"),
    ({}, 63, "--seq-len (63) must be a multiple of --tp 2"),
])
def test_llama_says_why_it_cannot_split(overrides, seq_len, expected):
    (problem,) = resolve_model("llama", "debug", overrides).tp_problems(2, seq_len)
    assert expected in problem


@pytest.mark.parametrize("args, shape", [
    (("fsdp", 4, 4), MeshShape(1, 4, 1)),                 # one node: one shard group
    (("fsdp", 4, 2), MeshShape(2, 2, 1)),                 # 2 nodes x 2: HSDP, shard within a node
    (("fsdp", 2, 1), MeshShape(1, 2, 1)),                 # 2 nodes x 1: nothing to shard within a node
    (("fsdp", 4, 2, 0, 0, 2), MeshShape(1, 2, 2)),        # 2 nodes x 2 with tp 2: one rank of dp per node
    (("fsdp", 8, 4, 0, 0, 2), MeshShape(2, 2, 2)),
    (("fsdp", 4, 2, 1, 0), MeshShape(1, 4, 1)),           # --dp-replicate 1: FSDP over every rank
    (("fsdp", 4, 4, 0, 2), MeshShape(2, 2, 1)),
    (("ddp", 4, 2), MeshShape(4, 1, 1)),
])
def test_the_mesh_follows_the_nodes_unless_set(args, shape):
    assert resolve_mesh(*args) == shape


@pytest.mark.parametrize("args, expected", [
    (("fsdp", 4, 4, 0, 0, 3), "--tp 3 must divide the ranks of a node (4)"),
    (("fsdp", 8, 4, 0, 0, 8), "--tp 8 must divide the ranks of a node (4)"),
    (("fsdp", 4, 2, 3, 0), "must be the 4 ranks (2 node(s) x 2)"),
    (("fsdp", 4, 2, 2, 1), "must be the 4 ranks"),
    (("ddp", 4, 4, 0, 0, 2), "--parallel ddp replicates the whole model"),
    (("ddp", 4, 4, 2), "--dp-replicate 2 x --dp-shard 1 x --tp 1 must be the 4 ranks"),
])
def test_a_mesh_that_does_not_fit_the_ranks_is_refused_in_one_line(args, expected):
    with pytest.raises(ValueError, match=None) as e:
        resolve_mesh(*args)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra, expected", [
    ({"model_config": '{"dim": 256, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 512}', "tp": 16},
     "--tp 16 must divide the ranks of a node (8)"),
    ({"dp_replicate": 3}, "must be the 16 ranks (2 node(s) x 8)"),
    ({"model": "bytegpt", "model_flavor": "", "tp": 2}, "--model bytegpt has no tensor-parallel plan"),
])
def test_the_pipeline_settings_check_refuses_a_mesh_that_does_not_fit_the_job(extra, expected):
    from components.train.settings import build_train_config

    with pytest.raises(ValueError, match=None) as e:
        build_train_config(**{**dict(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r",
                                     trainer_image="x/y:1", model="llama", model_flavor="debug", nodes=2), **extra})
    assert expected in str(e.value)


def test_the_pipeline_settings_check_takes_a_mesh_that_fits():
    from components.train.settings import build_train_config

    args = build_train_config(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r", trainer_image="x/y:1",
                              model="llama", model_flavor="debug", nodes=2, dp_replicate=2, tp=2).trainer_config
    assert args["parallel"] == {"dp_replicate": 2, "tp": 2}


def test_goodput_train_refuses_a_mesh_before_any_rank_starts(tmp_path):
    from click.testing import CliRunner

    from pipelines.cli import main

    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--nodes", "1:2", "--nproc", "2", "--dp-replicate", "2",
                                       "--dp-shard", "2", "--out", str(out), "--fsx-root", str(tmp_path)])
    assert result.exit_code == 2 and "must be the 2 ranks (1 node(s) x 2)" in result.output, result.output
    assert not out.exists()


def test_the_pipelines_mesh_parameters_reach_the_trainer_and_are_checked():
    from components.train.settings import build_train_config, check_run_parameters

    job = dict(fsx_root="/fsx", dataset_name="d", dataset_version="1", trainer_image="x/y:1", model="llama",
               model_flavor="debug", nodes=2)
    args = build_train_config(run_id="r", dp_replicate=2, tp=2, **job).trainer_config
    assert args["parallel"] == {"dp_replicate": 2, "tp": 2}
    assert "parallel" not in build_train_config(run_id="r", **job).trainer_config
    renamed = {"trainer_image" if k == "image" else k: v for k, v in job.items()}
    with pytest.raises(ValueError, match=r"--dp-replicate 3 x --dp-shard \? x --tp 2 must be the 16 ranks"):
        check_run_parameters({**renamed, "dp_replicate": 3, "tp": 2})


def test_memory_snapshots_are_tagged_with_the_mesh(tmp_path):
    """The run id the trainer gives its checkpoint manager, which tags memory snapshots and peer copies, names
    the mesh: two meshes of one world size (FSDP 1x2x1, TP 1x1x2) shard the state differently, and a snapshot
    of one must never be restored into the other."""
    from trainer.config import TrainConfig
    from trainer.events import EventLog
    from trainer.faults import FaultInjector
    from trainer.session import Session

    tags = []
    for shape in (MeshShape(1, 2, 1), MeshShape(1, 1, 2)):
        session = Session.__new__(Session)    # only what ``checkpoints`` reads: no launcher, no agents
        session.cfg, session.out, session.run_id, session.ckpt = TrainConfig(), tmp_path, "run1", None
        session.events = EventLog(tmp_path / "events.jsonl", 0)
        session.faults = FaultInjector([], 0, 2, session.events, tmp_path / "events.jsonl")
        manager = session.checkpoints(with_mesh(Dist(0, 2, 0, torch.device("cpu")), shape, form=False))
        tags.append(manager.run_id)
        manager.close()
        session.events.close()
    assert tags == ["run1/1x2x1", "run1/1x1x2"]


def test_a_mesh_given_whole_sizes_the_job():
    from components.train.pytorchjob import JobSpec, job_manifest
    from components.train.settings import build_train_config

    kw = dict(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r", trainer_image="x/y:1", model="llama",
              model_flavor="debug", instance_type="p5.48xlarge")
    s = build_train_config(**kw, nodes=2, dp_replicate=2, dp_shard=2, tp=2)
    assert s.job_options["gpus_per_node"] == 4, "2 x 2 x 2 ranks over 2 nodes"
    m = job_manifest(JobSpec.from_dict({**s.job_options, "image": "x/y:1", "nodes": 2, "trainer": s.trainer_config}))
    pod = m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert pod["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert build_train_config(**kw, nodes=2).job_options["gpus_per_node"] == 8, "no mesh: the node's GPUs"
    with pytest.raises(ValueError, match="does not split evenly over 2 node"):
        build_train_config(**kw, nodes=2, dp_replicate=3, dp_shard=1, tp=1)
    with pytest.raises(ValueError, match="of at most 8 GPUs"):
        build_train_config(**kw, nodes=1, dp_replicate=2, dp_shard=4, tp=2)
