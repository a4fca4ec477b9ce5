"""``deploy/iam``: valid IAM policies, least privilege, and enough for what the code really does.

The grammar is checked statically (no wildcard actions, no resource beyond the named buckets, prefixes and
file system). Then the real S3 traffic of the stage step and of the model registry (evaluate/register),
recorded on its way to moto, and the real FSx requests of ``goodput fsx link`` are each checked against the
policy that should allow them, request by request.
"""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from tests.deploy_checks import DEPLOY, allows, placeholders, policy_grammar_problems, render
from tests.fsx_stand_in import FsxStandIn
from tests.s3_stand_in import CREDENTIALS, FaultProxy, MotoS3

VALUES = dict(DATASET_BUCKET="goodput-datasets", DATASET_PREFIX="corpus", REGISTRY_BUCKET="goodput-models",
              REGISTRY_PREFIX="registry", CHECKPOINT_BUCKET="goodput-checkpoints", CHECKPOINT_PREFIX="runs",
              AWS_REGION="us-west-2", AWS_ACCOUNT_ID="123456789012", FSX_FILE_SYSTEM_ID="fs-0123456789abcdef0")
BUCKETS = {"pipeline": {"goodput-datasets", "goodput-models"}, "trainer": {"goodput-checkpoints"},
           "fsx-link": set()}


def policy(name: str) -> dict:
    path = DEPLOY / "iam" / f"{name}-policy.json"
    return json.loads(render(path, **{k: v for k, v in VALUES.items() if k in placeholders(path.read_text())}))


@pytest.mark.parametrize("name", sorted(BUCKETS))
def test_policies_are_valid_and_name_every_resource(name):
    p = policy(name)
    assert policy_grammar_problems(p) == []
    for s in p["Statement"]:
        for r in s["Resource"]:
            if r.startswith("arn:aws:s3:::"):
                bucket, _, key = r[len("arn:aws:s3:::"):].partition("/")
                assert bucket in BUCKETS[name] and "*" not in bucket and "?" not in bucket
                # Objects: a wildcard only as the tail of a named, non-empty prefix.
                assert not key or (key.endswith("/*") and "*" not in key[:-2] and key[:-2]), r
                if not key:                                    # bucket-level: listing only, and only the prefix
                    assert s["Action"] == ["s3:ListBucket"] and "s3:prefix" in s["Condition"]["StringLike"]
            elif r.startswith("arn:aws:fsx:"):
                assert r.startswith("arn:aws:fsx:us-west-2:123456789012:")
                assert r.endswith(("file-system/fs-0123456789abcdef0", "association/fs-0123456789abcdef0/*"))
            else:
                # The one IAM resource: FSx's service-linked role for S3 access, which creating a DRA sets up.
                assert r == ("arn:aws:iam::123456789012:role/aws-service-role/"
                             "s3.data-source.lustre.fsx.amazonaws.com/*"), r


def test_the_grammar_check_and_the_evaluator_are_strict():
    p = policy("pipeline")
    bad = json.loads(json.dumps(p))
    bad["Statement"][0]["Action"] = ["s3:*"]
    bad["Statement"][1]["Resource"] = "*"
    bad["Statement"][2]["NotAction"] = ["s3:DeleteBucket"]
    problems = "\n".join(policy_grammar_problems(bad))
    assert "s3:*" in problems and "'*'" in problems and "NotAction" in problems
    # Allowed: reading the dataset prefix; denied: another prefix, writing it, listing the whole bucket.
    assert allows(p, "s3:GetObject", "arn:aws:s3:::goodput-datasets/corpus/a.txt")
    assert not allows(p, "s3:GetObject", "arn:aws:s3:::goodput-datasets/secret/a.txt")
    assert not allows(p, "s3:PutObject", "arn:aws:s3:::goodput-datasets/corpus/a.txt")
    assert not allows(p, "s3:ListBucket", "arn:aws:s3:::goodput-datasets", {"s3:prefix": ""})
    assert not allows(p, "s3:DeleteObject", "arn:aws:s3:::goodput-models/registry/m/production.json")


class RecordingProxy(FaultProxy):
    """FaultProxy that records every request it forwards: (method, path, query)."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.seen: list[tuple[str, str, dict]] = []

    def _handle(self, h) -> None:
        parts = urlsplit(h.path)
        with self.lock:
            self.seen.append((h.command, unquote(parts.path), parse_qs(parts.query, keep_blank_values=True)))
        super()._handle(h)


def s3_permission(method: str, path: str, query: dict) -> tuple[str, str, dict]:
    """The IAM action, resource ARN and condition keys of one path-style S3 REST request."""
    bucket, _, key = path.lstrip("/").partition("/")
    if not key:
        if method == "GET" and ("list-type" in query or "prefix" in query or not query):
            return "s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": query.get("prefix", [""])[0]}
        if method == "POST" and "delete" in query:
            return "s3:DeleteObject", f"arn:aws:s3:::{bucket}/<keys in body>", {}
        raise AssertionError(f"unexpected bucket request {method} {path} {query}")
    arn = f"arn:aws:s3:::{bucket}/{key}"
    if method in ("GET", "HEAD"):
        return "s3:GetObject", arn, {}
    if method in ("PUT", "POST"):                    # PutObject, and every step of a multipart upload
        return "s3:PutObject", arn, {}
    if method == "DELETE":
        return ("s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject"), arn, {}
    raise AssertionError(f"unexpected request {method} {path}")


@pytest.fixture
def s3(monkeypatch):
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    with MotoS3() as server:
        yield server


def test_pipeline_policy_allows_every_request_of_stage_and_the_registry(s3, tmp_path):
    from components.evaluate.evaluate import Registry
    from components.stage.dataset import stage_dataset

    client = s3.client()
    for bucket in ("goodput-datasets", "goodput-models"):
        client.create_bucket(Bucket=bucket)
    for i in range(12):
        client.put_object(Bucket="goodput-datasets", Key=f"corpus/d{i % 3}/f{i}.txt", Body=f"text {i} " * 300)
    model = tmp_path / "model.pt"
    model.write_bytes(b"\0" * (9 * 2**20))          # above s3transfer's 8 MiB threshold: a multipart upload
    with RecordingProxy(s3.url) as proxy:
        stage_dataset("s3://goodput-datasets/corpus", tmp_path / "fsx", "c", "1", proxy.url, max_concurrency=4,
                      val_percent=50)
        registry = Registry("s3://goodput-models/registry", endpoint_url=proxy.url)
        assert registry.read_json("bytegpt/production.json") is None       # not there yet: a 404, not a 403
        registry.put_file(model, "bytegpt/v1/model.pt")
        registry.put_json({"version": "v1"}, "bytegpt/production.json")
        registry.fetch("bytegpt/v1/model.pt", tmp_path / "back.pt")
        seen = list(proxy.seen)
    p = policy("pipeline")
    needed = {s3_permission(*req)[:2] + (tuple(sorted(s3_permission(*req)[2].items())),) for req in seen}
    actions = {a for a, _, _ in needed}
    assert {"s3:ListBucket", "s3:GetObject", "s3:PutObject"} <= actions    # listing, reads, (multipart) writes
    for action, arn, context in sorted(needed):
        assert allows(p, action, arn, dict(context)), (action, arn, context)


def test_trainer_policy_covers_the_checkpoint_mirror_and_nothing_else():
    p = policy("trainer")
    root = "arn:aws:s3:::goodput-checkpoints/runs/run-1/checkpoints/step_000000100"
    # The mirror lists its prefix, uploads (multipart) shards and markers, downloads them to resume, deletes
    # old steps (trainer/mirror.py) and aborts a cancelled upload.
    assert allows(p, "s3:ListBucket", "arn:aws:s3:::goodput-checkpoints", {"s3:prefix": "runs/run-1/checkpoints/"})
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert allows(p, action, f"{root}/__0_0.distcp")
    assert not allows(p, "s3:GetObject", "arn:aws:s3:::goodput-datasets/corpus/a.txt")
    assert not allows(p, "s3:PutObject", "arn:aws:s3:::goodput-checkpoints/elsewhere/x")


def test_fsx_link_policy_allows_the_requests_goodput_fsx_link_makes(monkeypatch):
    from pipelines.fsx import link_data_repository, list_links, wait_for_link

    with FsxStandIn(creating_polls=1) as fsx:
        client = fsx.client()
        assoc = link_data_repository("fs-0123456789abcdef0", "/datasets/corpus/1/raw", "s3://goodput-datasets/corpus/",
                                     client=client)
        wait_for_link(assoc["AssociationId"], client=client, poll_s=0, log=lambda _: None)
        list_links("fs-0123456789abcdef0", client=client)
        requests = list(fsx.requests)
    p = policy("fsx-link")
    assoc_arn = f"arn:aws:fsx:us-west-2:123456789012:association/fs-0123456789abcdef0/{assoc['AssociationId']}"
    fs_arn = "arn:aws:fsx:us-west-2:123456789012:file-system/fs-0123456789abcdef0"
    for r in requests:
        assert re.fullmatch(r"[A-Z][A-Za-z]+", r["op"])
        assert allows(p, f"fsx:{r['op']}", fs_arn) and allows(p, f"fsx:{r['op']}", assoc_arn), r["op"]
    # Tags in the create request need fsx:TagResource on the new association.
    assert requests[0]["body"]["Tags"] and allows(p, "fsx:TagResource", assoc_arn)
    # Creating the first DRA sets up FSx's service-linked role for S3.
    slr = ("arn:aws:iam::123456789012:role/aws-service-role/s3.data-source.lustre.fsx.amazonaws.com/"
           "AWSServiceRoleForFSxS3Access_fs-0123456789abcdef0")
    for action in ("iam:CreateServiceLinkedRole", "iam:AttachRolePolicy", "iam:PutRolePolicy"):
        assert allows(p, action, slr)
    assert not allows(p, "fsx:DeleteFileSystem", fs_arn)
    assert not allows(p, "fsx:CreateDataRepositoryAssociation",
                      "arn:aws:fsx:us-west-2:123456789012:file-system/fs-0fffffffffffffff0")
