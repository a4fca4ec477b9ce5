"""What the hold drill's ``sitecustomize`` and ``tests/test_copy_race.py``'s share: a patch run on a module right
after it is imported, the writer holding saves while its worker boots, and the tensors of a state or a write
with their CRC-32s."""

import importlib.abc
import importlib.util
import sys
import zlib


def tensors(obj, out: list | None = None) -> list:
    """Every tensor in nested lists, tuples and dicts, in order."""
    import torch

    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors(x, out)
    return out


def crc32s(ts: list) -> list[int]:
    import torch

    return [zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()) for t in ts]


def live_storages(optimizers) -> set[int]:
    """The storages of the optimizers' parameters and state: the live state a write must not share."""
    live = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    live += [s for o in optimizers for s in o.state.values()]
    return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors(live)}


def hold_while_booting(module) -> None:
    """trainer.checkpoint.writer: every writer holds a save while its worker boots, on every NVRx release."""
    init = module.Writer.__init__

    def __init__(writer, *args, **kwargs):
        init(writer, *args, **kwargs)
        writer.holds_while_booting = True

    module.Writer.__init__ = __init__


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        spec.loader_state = (spec.loader, self.patches[name])
        spec.loader = self
        return spec

    def create_module(self, spec):
        return spec.loader_state[0].create_module(spec)

    def exec_module(self, module):
        loader, patch = module.__spec__.loader_state
        loader.exec_module(module)
        patch(module)


def patch_on_import(patches: dict) -> None:
    """Run ``patches[name](module)`` on each named module right after it is imported."""
    if patches:
        sys.meta_path.insert(0, _Patcher(patches))
