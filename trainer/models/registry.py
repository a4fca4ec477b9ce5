"""Resolve ``--model``, ``--model-flavor`` and ``--model-config`` to a ``ModelSpec``.

    resolve_model("llama", "llama3-8b", '{"max_seq_len": 8192}')
    resolve_model("mypkg.models:build_spec", "", "overrides.toml")

``--model`` is a built-in (``bytegpt``, ``llama``) or ``package.module:function``, the user's code
installed in the trainer image: ``function(flavor, overrides) -> ModelSpec``. ``--model-config`` is
inline JSON, or a ``.json`` / ``.toml`` file, of fields that override the flavor's. Every mistake is a
``ModelError`` that says what to fix, raised before anything is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Callable

from .spec import ModelSpec

BUILTINS = {
    "bytegpt": "trainer.models.bytegpt:model_spec",
    "llama": "trainer.models.llama:model_spec",
}
_USER_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class ModelError(ValueError):
    """A model name, flavor or config that cannot be used; the message says what to change."""


def load_model_config(value: str | dict | None) -> dict:
    """``--model-config``: inline JSON (an object), a ``.json`` or ``.toml`` file, or a dict."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    text = value.strip()
    if text.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ModelError(f"--model-config is not valid JSON ({e.msg} at column {e.colno}): {text[:80]!r}") from None
    else:
        path = Path(text)
        if not path.is_file():
            raise ModelError(f"--model-config {text!r}: no such file (give inline JSON like '{{\"dim\": 256}}' "
                             f"or a .json/.toml file)")
        try:
            if path.suffix == ".toml":
                data = tomllib.loads(path.read_text())
            elif path.suffix == ".json":
                data = json.loads(path.read_text())
            else:
                raise ModelError(f"--model-config {path}: expected a .json or .toml file")
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise ModelError(f"--model-config {path} cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"--model-config must be a JSON object / TOML table of fields, got {type(data).__name__}")
    return data


def _type_ok(value: Any, annotation: Any) -> bool:
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, annotation)


def apply_overrides(config: Any, overrides: dict, what: str) -> Any:
    """A copy of the dataclass ``config`` with ``overrides`` applied, every key and type checked.

    Args:
        config: the flavor's configuration (a dataclass instance).
        overrides: field name -> value, from ``--model-config``.
        what: the model's name, for error messages.
    """
    hints = typing.get_type_hints(type(config))
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ModelError(f"--model-config: {what} has no field(s) {', '.join(unknown)}; its fields are "
                         f"{', '.join(sorted(known))}")
    bad = [f"{k}={v!r} (expected {getattr(hints[k], '__name__', hints[k])})" for k, v in overrides.items()
           if not _type_ok(v, hints[k])]
    if bad:
        raise ModelError(f"--model-config: wrong type for {what}: {'; '.join(bad)}")
    # JSON has one number type: an integer given for a float field becomes a float.
    fixed = {k: float(v) if hints[k] is float else v for k, v in overrides.items()}
    return dataclasses.replace(config, **fixed)


def pick_flavor(flavors: dict[str, Any], flavor: str, default: str, what: str) -> tuple[str, Any]:
    """(name, config) of ``flavor`` (``default`` when empty) or a ModelError listing the flavors."""
    name = flavor or default
    if name not in flavors:
        raise ModelError(f"--model-flavor {name!r}: {what} has the flavors {', '.join(flavors)}")
    return name, flavors[name]


def _import_factory(target: str, name: str) -> Callable[..., ModelSpec]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelError(f"--model {name}: cannot import {module_name!r} ({e}); is the package installed in the "
                         f"trainer image (or on PYTHONPATH)?") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ModelError(f"--model {name}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ModelError(f"--model {name}: {target} is a {type(fn).__name__}, not a function")
    return fn


def resolve_model(name: str, flavor: str = "", config: str | dict | None = None) -> ModelSpec:
    """The ``ModelSpec`` for ``--model NAME --model-flavor FLAVOR --model-config CONFIG``.

    Args:
        name: ``bytegpt``, ``llama`` or ``package.module:function``.
        flavor: a named size of that model ("" = its default).
        config: field overrides: inline JSON, a .json/.toml path, or a dict (a run's saved config).

    Raises:
        ModelError: unknown name or flavor, unimportable code, a bad override, or a factory that does not
            return a ModelSpec.
    """
    if name in BUILTINS:
        target = BUILTINS[name]
    elif _USER_NAME.match(name):
        target = name
    else:
        raise ModelError(f"--model {name!r}: expected a built-in ({', '.join(BUILTINS)}) or "
                         f"package.module:function naming your own model factory")
    overrides = load_model_config(config)
    fn = _import_factory(target, name)
    try:
        spec = fn(flavor, overrides)
    except ModelError:
        raise
    except (TypeError, ValueError) as e:
        raise ModelError(f"--model {name}: {e}") from e
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"--model {name}: {target} returned a {type(spec).__name__}, not a "
                         f"trainer.models.ModelSpec (see docs/models.md)")
    return dataclasses.replace(spec, name=name)


def spec_from_run_config(run_config: dict) -> ModelSpec:
    """The spec of a run from its saved ``config.json``: ``model`` holds ``name``, ``flavor`` and the
    resolved ``config``; a run from before model plug-ins holds ByteGPT's fields there."""
    model = run_config.get("model", {})
    if "name" in model:
        return resolve_model(model["name"], model.get("flavor", ""), model.get("config") or {})
    return resolve_model("bytegpt", "", model)
