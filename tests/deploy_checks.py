"""Checks shared by the deploy-kit tests: templates, Kubernetes models, CRD schemas, scheduling, IAM policies.

Nothing here talks to a cluster or to AWS. Kubernetes objects go through the official client's models (a
round trip that drops nothing: an unknown or misspelt field would be dropped by the model, so it fails here),
custom resources through their CRD's schema made strict the way the API server prunes, and IAM policies
through a small evaluator of the policy grammar this project uses.
"""

from __future__ import annotations

import os
import fnmatch
import re
import string
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# CI clones shared/ beside the repository; GOODPUT_SHARED points elsewhere (a worktree, a dev checkout).
SHARED_SCHEMAS = Path(os.environ.get("GOODPUT_SHARED") or ROOT.parent / "shared") / "schemas"

# ${NAME} placeholders (envsubst syntax); any other "$" in a template would be eaten by envsubst.
_PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


def render(path: Path, **values: str) -> str:
    """The template with its placeholders filled as envsubst would; every placeholder must be given and every
    ``$`` must belong to one."""
    text = path.read_text()
    stray = [m.start() for m in re.finditer(r"\$", text) if not _PLACEHOLDER.match(text, m.start())]
    assert not stray, f"{path}: '$' outside a ${{NAME}} placeholder at offsets {stray}"
    missing = placeholders(text) - set(values)
    assert not missing, f"{path}: no value for {sorted(missing)}"
    return string.Template(text).substitute(values)


def load_all(path: Path, **values: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(path, **values)) if d is not None]


# Kubernetes objects through the official models --------------------------------------------------------

_MODELS = {("apps/v1", "DaemonSet"): "V1DaemonSet", ("apps/v1", "Deployment"): "V1Deployment",
           ("v1", "PersistentVolume"): "V1PersistentVolume",
           ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
           ("v1", "ConfigMap"): "V1ConfigMap", ("v1", "ServiceAccount"): "V1ServiceAccount",
           ("storage.k8s.io/v1", "StorageClass"): "V1StorageClass",
           ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
           ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
           ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
           ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding"}


def _normalized(obj):
    """YAML scalars as the API would echo them (quantities and int-or-strings are strings or numbers)."""
    if isinstance(obj, dict):
        return {k: _normalized(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_normalized(v) for v in obj]
    return obj


def model_roundtrip_problems(doc: dict) -> list[str]:
    """Deserialize ``doc`` into its ``kubernetes.client`` model and back; report what the model dropped or
    changed (unknown fields, wrong nesting) and the fields the model requires but ``doc`` lacks."""
    from kubernetes.client import ApiClient

    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in _MODELS:
        return [f"no model for {key}"]
    client = ApiClient()
    try:
        model = client._ApiClient__deserialize(doc, _MODELS[key])   # what ApiClient.deserialize does per object
    except ValueError as e:                                          # a required field is None
        return [f"{key[1]}: {e}"]
    back = client.sanitize_for_serialization(model)
    problems = []
    _diff(_normalized(doc), back, key[1], problems)
    return problems


def _diff(want, got, path: str, out: list[str]) -> None:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            out.append(f"{path}: became {type(got).__name__}")
            return
        for k, v in want.items():
            if k not in got:
                out.append(f"{path}.{k}: not a field of the model (dropped)")
            else:
                _diff(v, got[k], f"{path}.{k}", out)
    elif isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            out.append(f"{path}: list changed")
            return
        for i, (a, b) in enumerate(zip(want, got)):
            _diff(a, b, f"{path}[{i}]", out)
    elif str(want) != str(got):
        out.append(f"{path}: {want!r} became {got!r}")


# Custom resources through their CRD schema ----------------------------------------------------------------

def kubernetes_dialect(node):
    """A CRD's openAPIV3Schema as plain JSON Schema, strict like the API server's pruning: unknown fields are
    errors, int-or-string accepts both."""
    if isinstance(node, list):
        return [kubernetes_dialect(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: (v if k == "x-kubernetes-validations" else kubernetes_dialect(v)) for k, v in node.items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "type" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    return node


def crd_validator(path: Path, version: str):
    import jsonschema

    crd = next(d for d in yaml.safe_load_all(path.read_text()) if d)
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(kubernetes_dialect(v["schema"]["openAPIV3Schema"]),
                                      format_checker=jsonschema.FormatChecker())


def schema_errors(validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


# Scheduling, as the kube-scheduler decides it for taints, node selectors and resources -----------------------

def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' toleration semantics (k8s.io/api/core/v1 Toleration.ToleratesTaint)."""
    for t in tolerations or []:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t["key"] != taint["key"]:
            continue
        if op == "Exists" or (op == "Equal" and (t.get("value") or "") == (taint.get("value") or "")):
            return True
    return False


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SCALE = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40}


def quantity(q) -> float:
    m = _QUANTITY.match(str(q))
    assert m, f"not a quantity: {q!r}"
    return float(m.group(1)) * _SCALE[m.group(2)]


def fits(pod_spec: dict, node: dict) -> list[str]:
    """Why a pod cannot run on ``node`` ({labels, taints, allocatable}); empty = it can."""
    why = []
    for k, v in (pod_spec.get("nodeSelector") or {}).items():
        if node["labels"].get(k) != v:
            why.append(f"nodeSelector {k}={v}")
    for taint in node["taints"]:
        if taint["effect"] in ("NoSchedule", "NoExecute") and not tolerates(pod_spec.get("tolerations"), taint):
            why.append(f"taint {taint['key']}={taint.get('value')}:{taint['effect']}")
    requests: dict[str, float] = {}
    for c in pod_spec["containers"]:
        for r, q in ((c.get("resources") or {}).get("requests") or {}).items():
            requests[r] = requests.get(r, 0.0) + quantity(q)
    for r, q in requests.items():
        if q > quantity(node["allocatable"].get(r, 0)):
            why.append(f"{r} {q:g} > {node['allocatable'].get(r, 0)}")
    return why


# IAM policies ----------------------------------------------------------------------------------------------

POLICY_KEYS = {"Version", "Statement", "Id"}
STATEMENT_KEYS = {"Sid", "Effect", "Action", "Resource", "Condition"}
CONDITION_OPERATORS = {"StringEquals", "StringLike", "StringNotEquals", "StringNotLike", "ArnLike", "ArnEquals",
                       "Bool", "IpAddress", "NumericLessThanEquals"}
_ACTION = re.compile(r"^[a-z0-9-]+:[A-Z][A-Za-z0-9]+$")


def _listed(v) -> list:
    return v if isinstance(v, list) else [v]


def policy_grammar_problems(policy: dict) -> list[str]:
    """The IAM JSON policy grammar (identity policies), with this project's stricter rules: Allow only, every
    action named exactly (no wildcards, no NotAction), no NotResource, no bare ``*`` resource."""
    p = []
    if set(policy) - POLICY_KEYS:
        p.append(f"unknown policy keys {sorted(set(policy) - POLICY_KEYS)}")
    if policy.get("Version") != "2012-10-17":
        p.append("Version must be 2012-10-17")
    statements = policy.get("Statement")
    if not isinstance(statements, list) or not statements:
        return p + ["Statement must be a non-empty list"]
    sids = [s.get("Sid") for s in statements]
    if len(set(sids)) != len(sids) or not all(isinstance(s, str) and re.match(r"^[A-Za-z0-9]+$", s) for s in sids):
        p.append(f"every statement needs a unique alphanumeric Sid: {sids}")
    for s in statements:
        sid = s.get("Sid")
        if set(s) - STATEMENT_KEYS:
            p.append(f"{sid}: unknown or forbidden keys {sorted(set(s) - STATEMENT_KEYS)}")
        if s.get("Effect") != "Allow":
            p.append(f"{sid}: Effect must be Allow")
        for a in _listed(s.get("Action", [])):
            if not isinstance(a, str) or not _ACTION.match(a):
                p.append(f"{sid}: action {a!r} is not one named action (service:Operation, no wildcard)")
        resources = _listed(s.get("Resource", []))
        if not resources:
            p.append(f"{sid}: no Resource")
        for r in resources:
            if not isinstance(r, str) or not r.startswith("arn:aws:") or r.strip() == "*":
                p.append(f"{sid}: resource {r!r} is not an ARN")
        for op, conds in (s.get("Condition") or {}).items():
            if op not in CONDITION_OPERATORS:
                p.append(f"{sid}: unknown condition operator {op}")
            if not isinstance(conds, dict):
                p.append(f"{sid}: condition {op} must map keys to values")
    return p


def allows(policy: dict, action: str, resource: str, context: dict | None = None) -> bool:
    """Whether an Allow statement of ``policy`` grants ``action`` on ``resource`` (ARN) given the request
    ``context`` (condition keys such as ``s3:prefix``). Wildcards in resources and StringLike values follow
    IAM: ``*`` any run of characters, ``?`` one character; actions compare case-insensitively."""
    context = context or {}
    for s in policy["Statement"]:
        if s["Effect"] != "Allow":
            continue
        if not any(a.lower() == action.lower() for a in _listed(s["Action"])):
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in _listed(s["Resource"])):
            continue
        if _conditions_hold(s.get("Condition") or {}, context):
            return True
    return False


def _conditions_hold(conditions: dict, context: dict) -> bool:
    for op, pairs in conditions.items():
        for key, values in pairs.items():
            have = context.get(key)
            if have is None:
                return False
            if op == "StringLike" and not any(fnmatch.fnmatchcase(have, v) for v in _listed(values)):
                return False
            if op == "StringEquals" and have not in _listed(values):
                return False
    return True
