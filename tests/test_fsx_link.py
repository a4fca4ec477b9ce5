"""``goodput fsx link``: the FSx CreateDataRepositoryAssociation request, as it goes over the wire.

moto has no FSx data repository associations, so a loopback server speaking the FSx JSON protocol
(``tests/fsx_stand_in.py``) receives boto3's real, signed requests; the tests assert their bodies.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipelines.cli import main
from pipelines.fsx import LinkError, link_data_repository, list_links, wait_for_link

from tests.fsx_stand_in import CREDENTIALS, FsxStandIn

FS = "fs-0123456789abcdef0"


def _invoke(fsx: FsxStandIn, *args: str):
    return CliRunner().invoke(main, ["fsx", "--region", "us-west-2", "--endpoint-url", fsx.url, *args],
                              env=CREDENTIALS)


def test_link_sends_the_documented_request_and_waits_until_available():
    with FsxStandIn(creating_polls=2) as fsx:
        res = _invoke(fsx, "link", "--file-system-id", FS, "--fsx-path", "/datasets/corpus/1/raw", "--s3",
                      "s3://goodput-datasets/corpus", "--chunk-mib", "256", "--wait", "--poll-s", "0.01")
        assert res.exit_code == 0, res.output
        create = fsx.requests[0]
    h = create["headers"]
    assert h["X-Amz-Target"] == "AWSSimbaAPIService_v20180301.CreateDataRepositoryAssociation"
    assert h["Content-Type"] == "application/x-amz-json-1.1"
    # Signed for FSx in the chosen region (SigV4), with the caller's credentials.
    assert h["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=testing/")
    assert "/us-west-2/fsx/aws4_request" in h["Authorization"]
    body = create["body"]
    token = body.pop("ClientRequestToken")
    assert len(token) == 32 and token.isalnum()
    assert body == {
        "FileSystemId": FS,
        "FileSystemPath": "/datasets/corpus/1/raw",
        "DataRepositoryPath": "s3://goodput-datasets/corpus/",          # the trailing slash FSx expects
        "BatchImportMetaDataOnCreate": True,
        "ImportedFileChunkSize": 256,
        "S3": {"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}},   # import only: read-only use
        "Tags": [{"Key": "app.kubernetes.io/part-of", "Value": "goodput-pipelines"}],
    }
    # Created, then polled through CREATING to AVAILABLE.
    assert fsx.ops() == ["CreateDataRepositoryAssociation"] + ["DescribeDataRepositoryAssociations"] * 3
    assert [r["body"] for r in fsx.requests[1:]] == [{"AssociationIds": ["dra-00000000000000001"]}] * 3
    assert "dra-00000000000000001: CREATING" in res.output and "AVAILABLE" in res.output


def test_the_same_link_twice_is_one_association_and_export_is_opt_in():
    with FsxStandIn() as fsx:
        client = fsx.client()
        a = link_data_repository(FS, "/datasets/corpus/1/raw", "s3://goodput-datasets/corpus/", client=client)
        b = link_data_repository(FS, "/datasets/corpus/1/raw", "s3://goodput-datasets/corpus", client=client)
        c = link_data_repository(FS, "/s3/models", "s3://goodput-models/", import_events=[],
                                 export_events=["NEW", "CHANGED"], batch_import=False, client=client,
                                 tags={"team": "ml"})
        tokens = [r["body"]["ClientRequestToken"] for r in fsx.requests]
        third = fsx.requests[2]["body"]
    assert a["AssociationId"] == b["AssociationId"] != c["AssociationId"]
    assert tokens[0] == tokens[1] != tokens[2]
    assert third["S3"] == {"AutoExportPolicy": {"Events": ["NEW", "CHANGED"]}}
    assert third["BatchImportMetaDataOnCreate"] is False and "ImportedFileChunkSize" not in third
    assert {"Key": "team", "Value": "ml"} in third["Tags"]


def test_refusals_and_failed_links_are_errors_with_fsx_s_reason():
    with FsxStandIn(refuse="Data repository associations are not supported on SCRATCH_2 file systems") as fsx:
        res = _invoke(fsx, "link", "--file-system-id", FS, "--fsx-path", "/s3", "--s3", "s3://bucket-a/")
    assert res.exit_code == 1 and "BadRequest" in res.output and "SCRATCH_2" in res.output
    with FsxStandIn(final="MISCONFIGURED", creating_polls=0, failure_message="bucket policy denies FSx") as fsx:
        client = fsx.client()
        assoc = link_data_repository(FS, "/s3", "s3://bucket-a/", client=client)
        with pytest.raises(LinkError, match="MISCONFIGURED: bucket policy denies FSx"):
            wait_for_link(assoc["AssociationId"], client=client, poll_s=0, log=lambda _: None)
    with FsxStandIn(creating_polls=100) as fsx:
        client = fsx.client()
        assoc = link_data_repository(FS, "/s3", "s3://bucket-a/", client=client)
        with pytest.raises(LinkError, match="still CREATING"):
            wait_for_link(assoc["AssociationId"], client=client, timeout_s=0.05, poll_s=0.01, log=lambda _: None,
                          sleep=lambda s: None)


def test_bad_arguments_are_all_reported_before_any_request():
    with FsxStandIn() as fsx:
        res = _invoke(fsx, "link", "--file-system-id", "fsx-1", "--fsx-path", "s3/datasets", "--s3",
                      "https://bucket/x", "--auto-import", "NEW,RENAMED", "--chunk-mib", "0")
        assert fsx.requests == []
    assert res.exit_code == 2
    for fragment in ("fsx-1", "absolute path", "s3://BUCKET", "RENAMED", "chunk size"):
        assert fragment in res.output


def test_links_lists_every_page():
    with FsxStandIn(page_size=2) as fsx:
        client = fsx.client()
        for i in range(5):
            link_data_repository(FS, f"/s3/d{i}", f"s3://bucket-{i}/", client=client)
        link_data_repository("fs-0123456789abcdef1", "/other", "s3://bucket-x/", client=client)
        assert [a["FileSystemPath"] for a in list_links(FS, client=client)] == [f"/s3/d{i}" for i in range(5)]
        res = _invoke(fsx, "links", "--file-system-id", FS)
    assert res.exit_code == 0 and res.output.count("CREATING") == 5
