"""The model and optimizer state dicts that checkpoints save: built once, then only refreshed.

``get_state_dict`` walks every module, parameter and optimizer state to build FQN-keyed dicts: about
20 ms for a FSDP2 model of a few hundred tensors, paid by the loop at every checkpoint and every
in-memory snapshot. The tensors it returns are the live parameters and optimizer state, which the
optimizer updates in place, so the dicts stay valid: only the param groups' hyperparameters (the
scheduled learning rate) are read again, as ``Optimizer.state_dict`` would. The dicts are built anew
whenever the optimizer's state or the parameters' memory is no longer what they were built from: a
load (``set_state_dict``) replaces the optimizer's state, and FSDP2 may re-point a parameter's shard
at its first forward pass.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from . import compat


class LiveStateDict:
    """``get_state_dict(model, optimizer)``, built once per set of live tensors."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._model_sd: dict | None = None
        self._optim_sd: dict | None = None
        self._built_from: tuple | None = None

    def _live(self) -> tuple:
        """What the dicts refer to: the optimizer's state (a load replaces it) and the memory of every
        parameter (the dicts hold detached views of it, which FSDP2 can re-point at first use)."""
        state = self.optimizer.state
        memory = tuple((compat.local_tensor(p).data_ptr(), p.shape) for p in self.model.parameters())
        return state, len(state), memory

    def __call__(self) -> tuple[dict, dict]:
        live = self._live()
        if self._built_from is None or self._built_from[0] is not live[0] or self._built_from[1:] != live[1:]:
            self._model_sd, self._optim_sd = get_state_dict(self.model, self.optimizer)
            # get_state_dict creates the optimizer's state on first use: record what it refers to now.
            self._built_from = self._live()
            return self._model_sd, self._optim_sd
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": built_group["params"]}
                  for group, built_group in zip(self.optimizer.param_groups, self._optim_sd["param_groups"])]
        return self._model_sd, {"state": self._optim_sd["state"], "param_groups": groups}
