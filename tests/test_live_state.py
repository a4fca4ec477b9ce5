"""LiveStateDict: the reused model and optimizer state dicts are what get_state_dict would build now."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.compat import local_tensor as _local
from trainer.config import parse_config
from trainer.live_state import LiveStateDict
from trainer.models import ParallelPlan, build_model
from trainer.train import build_optimizer, get_lr

from .conftest import TINY


def _setup(mode: str, d, dataset):
    cfg = parse_config(["--data", str(dataset), "--out", "unused", *TINY, "--warmup-steps", "3", "--max-steps", "10"])
    spec = cfg.model.spec(cfg.data.data)
    model = build_model(spec, ParallelPlan(mode=mode), d, seed=0)   # as the trainer builds it
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: get_lr(s, cfg.optim, cfg.run.max_steps))
    x = torch.randint(0, 256, (2, cfg.model.seq_len))

    def step():
        spec.loss(model, x, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    return model, optimizer, step


def _same(reused, fresh) -> None:
    """Equal structure and values; tensors are the live ones get_state_dict returns (the same memory)."""
    if isinstance(fresh, torch.Tensor):
        assert _local(reused).data_ptr() == _local(fresh).data_ptr() and reused.shape == fresh.shape
        assert torch.equal(_local(reused), _local(fresh))
    elif isinstance(fresh, dict):
        assert reused.keys() == fresh.keys()
        for k in fresh:
            _same(reused[k], fresh[k])
    elif isinstance(fresh, (list, tuple)):
        assert len(reused) == len(fresh)
        for a, b in zip(reused, fresh):
            _same(a, b)
    else:
        assert reused == fresh


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_reused_dicts_follow_the_training_and_are_rebuilt_after_a_load(process_group, dataset, mode):
    model, optimizer, step = _setup(mode, process_group, dataset)
    live = LiveStateDict(model, optimizer)
    first = live()                       # builds, creating the optimizer's state
    lrs = set()
    for _ in range(4):                   # warmup, then cosine decay: the learning rate changes
        step()
        reused, fresh = live(), get_state_dict(model, optimizer)
        _same(reused, fresh)
        assert reused[0] is first[0] and reused[1]["state"] is first[1]["state"]    # not rebuilt
        lrs.add(reused[1]["param_groups"][0]["lr"])
    assert len(lrs) == 3                 # 2/3, 1 (twice: end of warmup, start of decay), then below 1

    # A load (here of a copy, as from a checkpoint) replaces the optimizer's state: the dicts are built
    # again and refer to the new tensors.
    old_exp_avg = {k: v["exp_avg"] for k, v in first[1]["state"].items()}
    set_state_dict(model, optimizer, model_state_dict=copy.deepcopy(fresh[0]),
                   optim_state_dict=copy.deepcopy(fresh[1]))
    rebuilt = live()
    assert rebuilt[1]["state"] is not first[1]["state"]
    _same(rebuilt, get_state_dict(model, optimizer))
    assert all(v["exp_avg"] is not old_exp_avg[k] for k, v in rebuilt[1]["state"].items())
