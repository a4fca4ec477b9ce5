"""Run arguments: ``-p key=value`` and ``--params-file``, checked against the compiled pipeline's inputs.

Everything here happens before a request is sent: a typo in a parameter name or a value of the wrong
type fails on the user's machine, not minutes later in a pipeline pod. Precedence is ``-p`` over the
file over the pipeline's defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

# parameterType in the compiled PipelineSpec -> a readable name.
_TYPE_NAMES = {
    "STRING": "string", "NUMBER_INTEGER": "integer", "NUMBER_DOUBLE": "float", "BOOLEAN": "boolean",
    "LIST": "list", "STRUCT": "dict",
}


class ParamError(ValueError):
    """A run argument that the pipeline would not accept."""


def pipeline_parameters(spec: dict) -> dict[str, dict]:
    """``root.inputDefinitions.parameters`` of a compiled pipeline (the first YAML document)."""
    return dict(spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {}))


def load_pipeline_spec(package: Path) -> dict:
    """The PipelineSpec document of a compiled pipeline YAML (the platform spec follows it, if any)."""
    with open(package) as f:
        docs = list(yaml.safe_load_all(f))
    if not docs or not isinstance(docs[0], dict) or "root" not in docs[0]:
        raise ParamError(f"{package} is not a compiled KFP pipeline (no 'root' in its first document)")
    return docs[0]


def parse_pairs(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["steps=200", "model=a=b"]`` -> ``{"steps": "200", "model": "a=b"}``; raw strings, typed later."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key or not key.replace("_", "a").isalnum():
            raise ParamError(f"malformed parameter {pair!r}: expected key=value with a parameter name as key")
        if key in out:
            raise ParamError(f"parameter {key!r} given twice")
        out[key] = value
    return out


def load_params_file(path: Path) -> dict:
    """A YAML (or JSON) mapping of parameter name to value."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ParamError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ParamError(f"{path}: expected a mapping of parameter name to value")
    return data


def _coerce(name: str, value, ptype: str):
    """Type a value as the pipeline declares it; strings from ``-p`` are parsed, typed file values checked."""
    want = _TYPE_NAMES.get(ptype, ptype)
    bad = ParamError(f"parameter {name!r} expects {want}, got {value!r}")
    if ptype == "STRING":
        if isinstance(value, (dict, list)):
            raise bad
        # YAML reads `true`/`1.0` as typed values; a string parameter gets the text the user wrote.
        return str(value).lower() if isinstance(value, bool) else str(value)
    if ptype == "BOOLEAN":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise bad
    if ptype == "NUMBER_INTEGER":
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        try:
            return int(str(value).strip())
        except ValueError:
            raise bad from None
    if ptype == "NUMBER_DOUBLE":
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            raise bad from None
    if ptype in ("LIST", "STRUCT"):
        kind = list if ptype == "LIST" else dict
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad from None
        if not isinstance(value, kind):
            raise bad
        return value
    return value


def merge_values(pairs: tuple[str, ...] | list[str] = (), params_file: Path | None = None) -> dict:
    """The file's values overridden by ``-p`` (raw strings), not yet checked against a pipeline."""
    merged: dict = dict(load_params_file(params_file)) if params_file else {}
    merged.update(parse_pairs(pairs))
    return merged


def check_arguments(spec: dict, values: dict, *, require: bool = True) -> dict:
    """``values`` with names checked and types coerced as ``spec`` declares them.

    Args:
        spec: the compiled PipelineSpec.
        values: parameter name -> value (strings from ``-p`` are parsed, typed values checked).
        require: whether parameters without a default must be present.

    Raises:
        ParamError: unknown name, missing required parameter, or a value of the wrong type.
    """
    declared = pipeline_parameters(spec)
    unknown = sorted(set(values) - set(declared))
    if unknown:
        raise ParamError(f"unknown parameter(s) {', '.join(unknown)}; "
                         f"the pipeline takes: {', '.join(sorted(declared))}")
    missing = sorted(n for n, d in declared.items()
                     if n not in values and "defaultValue" not in d and not d.get("isOptional"))
    if missing and require:
        raise ParamError(f"missing required parameter(s): {', '.join(missing)}")
    return {name: _coerce(name, value, declared[name].get("parameterType", "STRING"))
            for name, value in sorted(values.items())}


def resolve_arguments(spec: dict, pairs: tuple[str, ...] | list[str] = (), params_file: Path | None = None) -> dict:
    """Arguments for a run: file values overridden by ``-p``, names and types checked against ``spec``.

    Only the arguments given are returned; the pipeline's defaults apply to the rest on the server.

    Raises:
        ParamError: malformed pair, unknown name, missing required parameter, or a value of the wrong type.
    """
    return check_arguments(spec, merge_values(pairs, params_file))


SETTINGS_COMPONENT = "comp-train-config-op"
"""The pipeline's check-settings step; ``check_settings`` runs its function here, before a run is sent."""


def _settings_inputs(spec: dict, values: dict) -> dict | None:
    """The check-settings task's inputs as the compiled pipeline binds them, for these run values.

    Follows each input through the DAGs it is passed down (``componentInputParameter``) to the
    pipeline's parameters; constants are taken as compiled. None when the pipeline has no such task.
    """
    components = spec.get("components", {})

    def walk(dag: dict, env: dict) -> dict | None:
        for task in dag.get("tasks", {}).values():
            inputs = {}
            for name, binding in task.get("inputs", {}).get("parameters", {}).items():
                if "componentInputParameter" in binding and binding["componentInputParameter"] in env:
                    inputs[name] = env[binding["componentInputParameter"]]
                elif "constant" in binding.get("runtimeValue", {}):
                    inputs[name] = binding["runtimeValue"]["constant"]
            ref = task.get("componentRef", {}).get("name", "")
            if ref == SETTINGS_COMPONENT:
                return inputs
            found = walk(components.get(ref, {}).get("dag", {}), inputs)
            if found is not None:
                return found
        return None

    defaults = {name: d["defaultValue"] for name, d in pipeline_parameters(spec).items() if "defaultValue" in d}
    return walk(spec.get("root", {}).get("dag", {}), {**defaults, **values})


def check_settings(spec: dict, arguments: dict, *, reachable: bool = False) -> None:
    """Check a run's settings as the pipeline's check-settings step will, before anything is sent.

    ``arguments`` are checked values (``check_arguments``); the rest take the pipeline's defaults. A
    pipeline without that step (or a parameter without a value yet, such as a required one left to
    the server) is not checked here. ``reachable``: the run's FSx, registry and S3 are readable here
    (``goodput run --local``), so ``init_from`` and the tokenizer are looked up too; for a cluster run
    they are the step's to check, as is a model whose package only the trainer image has.

    Raises:
        ParamError: a setting the trainer or the job builder would reject, e.g. ``-p max_steps=-5``.
    """
    from components.train.parameters import CHECKED, STEP_INPUTS
    from components.train.settings import build_train_config

    inputs = _settings_inputs(spec, arguments)
    if inputs is None:
        return
    if set(inputs) != {p.name for p in (*STEP_INPUTS, *CHECKED)}:
        return      # an uploaded version of the step with other inputs: the server's step checks it
    if "{{$" in str(inputs.get("run_id", "")):
        inputs["run_id"] = "check-settings"      # the server fills in the run's id
    try:
        build_train_config(**inputs, reachable=reachable, record=False)
    except ValueError as e:
        raise ParamError(str(e)) from None
