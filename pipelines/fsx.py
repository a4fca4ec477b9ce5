"""Link the FSx for Lustre file system to the dataset bucket: a data repository association (DRA).

With the link, ``s3://BUCKET/PREFIX/`` appears as a directory of the file system whose file contents load
from S3 on first read (and, with auto-import, follow changes in the bucket). Linked at a dataset's
``raw/`` directory, the stage step preloads the files in place (``goodput stage --fsx-dra``, the stage
component's ``fsx_dra``) instead of copying them over S3::

    goodput fsx link --file-system-id fs-0123456789abcdef0 --fsx-path /datasets/corpus/1/raw \\
        --s3 s3://my-datasets/corpus/ --wait
    goodput stage s3://my-datasets/corpus/ --fsx-root /fsx --name corpus --version 1 --fsx-dra

The file system's root is the FSx mount (``/fsx`` in the pods), so ``--fsx-path`` is the path below it.

DRAs exist only on ``PERSISTENT_2`` file systems (the dynamic StorageClass in ``deploy/fsx`` makes those).
The caller needs ``deploy/iam/fsx-link-policy.json``. ``CreateDataRepositoryAssociation`` is idempotent
here: the request token is derived from the file system, path and bucket, so running the command again
does not queue a second association.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Callable, Iterable

from trainer.s3url import parse_s3_url

__all__ = ["LinkError", "link_data_repository", "wait_for_link", "list_links", "fsx_client", "EVENTS"]

EVENTS = ("NEW", "CHANGED", "DELETED")
_FS_ID = re.compile(r"^fs-[0-9a-f]{8,21}$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")      # S3's bucket naming rules


class LinkError(RuntimeError):
    """The association could not be created or did not become AVAILABLE."""


def fsx_client(region: str | None = None, endpoint_url: str | None = None):
    import boto3
    from botocore.config import Config

    return boto3.client("fsx", region_name=region, endpoint_url=endpoint_url,
                        config=Config(retries={"mode": "standard", "max_attempts": 5}))


def _problems(file_system_id: str, fsx_path: str, s3_uri: str, import_events: Iterable[str],
              export_events: Iterable[str], chunk_mib: int | None) -> list[str]:
    p = []
    if not _FS_ID.match(file_system_id):
        p.append(f"file system id {file_system_id!r} does not look like fs-0123456789abcdef0")
    if not fsx_path.startswith("/") or len(fsx_path) > 4096 or any(c in fsx_path for c in "\r\n\0"):
        p.append(f"--fsx-path {fsx_path!r} must be an absolute path on the file system, e.g. /datasets/corpus/1/raw")
    try:
        bucket = parse_s3_url(s3_uri, "--s3").bucket
    except ValueError:
        bucket = ""
    if not _BUCKET.match(bucket):
        p.append(f"--s3 {s3_uri!r} must look like s3://BUCKET[/PREFIX/]")
    for what, events in (("import", import_events), ("export", export_events)):
        bad = sorted(set(events) - set(EVENTS))
        if bad:
            p.append(f"auto-{what} events {bad} are not among {list(EVENTS)}")
    if chunk_mib is not None and not 1 <= chunk_mib <= 512000:
        p.append(f"chunk size {chunk_mib} MiB must be in [1, 512000]")
    return p


def link_data_repository(file_system_id: str, fsx_path: str, s3_uri: str, *,
                         import_events: Iterable[str] = EVENTS, export_events: Iterable[str] = (),
                         batch_import: bool = True, chunk_mib: int | None = None,
                         tags: dict[str, str] | None = None, client=None) -> dict:
    """Create the association of ``fsx_path`` on ``file_system_id`` with ``s3_uri``; return its description.

    Args:
        file_system_id: the PERSISTENT_2 file system (``fs-...``).
        fsx_path: directory on the file system, below the mount: ``/datasets/corpus/1/raw`` is
            ``/fsx/datasets/corpus/1/raw`` in the pods.
        s3_uri: ``s3://BUCKET/PREFIX/``; a trailing slash is added.
        import_events: bucket changes imported automatically (NEW, CHANGED, DELETED); empty = none.
        export_events: file system changes exported to the bucket automatically; empty (default) = read-only use.
        batch_import: load the metadata of the whole prefix right after creation.
        chunk_mib: stripe size of imported files in MiB (None = the FSx default, 1024).
        tags: tags of the association (``app.kubernetes.io/part-of=goodput-pipelines`` is always added).
        client: a boto3 FSx client (default: ``fsx_client()``).

    Raises:
        ValueError: bad arguments (all of them listed).
        LinkError: FSx refused the request.
    """
    import_events, export_events = list(import_events), list(export_events)
    problems = _problems(file_system_id, fsx_path, s3_uri, import_events, export_events, chunk_mib)
    if problems:
        raise ValueError("invalid FSx link:\n  " + "\n  ".join(problems))
    s3_uri = s3_uri if s3_uri.endswith("/") else s3_uri + "/"
    s3: dict = {}
    if import_events:
        s3["AutoImportPolicy"] = {"Events": import_events}
    if export_events:
        s3["AutoExportPolicy"] = {"Events": export_events}
    all_tags = {"app.kubernetes.io/part-of": "goodput-pipelines", **(tags or {})}
    request = {
        "FileSystemId": file_system_id,
        "FileSystemPath": fsx_path,
        "DataRepositoryPath": s3_uri,
        "BatchImportMetaDataOnCreate": batch_import,
        # Same link, same token: a repeated command is answered with the first association, not a second one.
        "ClientRequestToken": hashlib.sha256(f"{file_system_id}|{fsx_path}|{s3_uri}".encode()).hexdigest()[:32],
        "Tags": [{"Key": k, "Value": v} for k, v in all_tags.items()],
    }
    if s3:
        request["S3"] = s3
    if chunk_mib is not None:
        request["ImportedFileChunkSize"] = chunk_mib
    client = client or fsx_client()
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return client.create_data_repository_association(**request)["Association"]
    except ClientError as e:
        err = e.response.get("Error", {})
        raise LinkError(f"FSx refused the link {fsx_path} -> {s3_uri}: {err.get('Code')}: {err.get('Message')}") \
            from None
    except BotoCoreError as e:
        raise LinkError(f"FSx request failed: {e}") from None


def wait_for_link(association_id: str, *, client=None, timeout_s: float = 1800.0, poll_s: float = 15.0,
                  log: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> dict:
    """Poll until the association is AVAILABLE; raise ``LinkError`` when it fails, is misconfigured or times out."""
    client = client or fsx_client()
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        (assoc,) = client.describe_data_repository_associations(AssociationIds=[association_id])["Associations"]
        state = assoc["Lifecycle"]
        if state != last:
            log(f"{association_id}: {state}")
            last = state
        if state == "AVAILABLE":
            return assoc
        if state in ("FAILED", "MISCONFIGURED", "DELETING"):
            detail = (assoc.get("FailureDetails") or {}).get("Message", "")
            raise LinkError(f"{association_id} is {state}{': ' + detail if detail else ''}")
        if time.monotonic() + poll_s > deadline:
            raise LinkError(f"{association_id} still {state} after {timeout_s:.0f}s")
        sleep(poll_s)


def list_links(file_system_id: str, *, client=None) -> list[dict]:
    """Every data repository association of ``file_system_id``."""
    client = client or fsx_client()
    out, token = [], None
    while True:
        kw = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]}
        if token:
            kw["NextToken"] = token
        page = client.describe_data_repository_associations(**kw)
        out += page.get("Associations", [])
        token = page.get("NextToken")
        if not token:
            return out
