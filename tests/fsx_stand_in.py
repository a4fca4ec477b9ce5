"""A loopback stand-in for the Amazon FSx API (moto has no data repository associations).

It speaks the service's JSON protocol (``POST /``, ``X-Amz-Target: AWSSimbaAPIService_v20180301.<Op>``,
``application/x-amz-json-1.1``) for the operations ``pipelines.fsx`` uses, records every request, and
answers like FSx: an association starts ``CREATING`` and becomes ``AVAILABLE`` (or ``final``) on a later
describe; a repeated client token returns the first association.

    with FsxStandIn() as fsx:
        client = fsx.client()                  # boto3 FSx client on http://127.0.0.1:<port>
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler

from tests.loopback import LoopbackServer

TARGET_PREFIX = "AWSSimbaAPIService_v20180301."
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-west-2"}


class FsxStandIn(LoopbackServer):
    def __init__(self, *, final: str = "AVAILABLE", creating_polls: int = 2, refuse: str | None = None,
                 page_size: int = 2, failure_message: str = ""):
        self.final, self.creating_polls, self.refuse = final, creating_polls, refuse
        self.page_size, self.failure_message = page_size, failure_message
        self.requests: list[dict] = []         # {"op", "headers", "body"}
        self.associations: dict[str, dict] = {}
        self.polls: dict[str, int] = {}
        self.by_token: dict[str, str] = {}
        self._ids = itertools.count(1)
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                target = self.headers.get("X-Amz-Target", "")
                op = target[len(TARGET_PREFIX):] if target.startswith(TARGET_PREFIX) else ""
                with stand_in.lock:
                    stand_in.requests.append({"op": op, "headers": dict(self.headers), "body": body})
                    status, reply = stand_in._answer(op, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("x-amzn-RequestId", "00000000-0000-0000-0000-000000000000")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.serve(Handler)

    def client(self):
        import boto3

        return boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                     region_name="us-west-2").client("fsx", endpoint_url=self.url)

    def ops(self) -> list[str]:
        return [r["op"] for r in self.requests]

    def _answer(self, op: str, body: dict) -> tuple[int, dict]:
        if op == "CreateDataRepositoryAssociation":
            if self.refuse:
                return 400, {"__type": "BadRequest", "Message": self.refuse}
            token = body.get("ClientRequestToken")
            if token in self.by_token:
                return 200, {"Association": self.associations[self.by_token[token]]}
            assoc_id = f"dra-{next(self._ids):017x}"
            fs = body["FileSystemId"]
            assoc = {"AssociationId": assoc_id, "FileSystemId": fs, "Lifecycle": "CREATING",
                     "ResourceARN": f"arn:aws:fsx:us-west-2:123456789012:association/{fs}/{assoc_id}",
                     "FileSystemPath": body["FileSystemPath"], "DataRepositoryPath": body["DataRepositoryPath"],
                     "BatchImportMetaDataOnCreate": body.get("BatchImportMetaDataOnCreate", False),
                     "ImportedFileChunkSize": body.get("ImportedFileChunkSize", 1024), "S3": body.get("S3", {}),
                     "Tags": body.get("Tags", []), "CreationTime": 1.7e9}
            self.associations[assoc_id] = assoc
            self.by_token[token] = assoc_id
            self.polls[assoc_id] = 0
            return 200, {"Association": assoc}
        if op == "DescribeDataRepositoryAssociations":
            if "AssociationIds" in body:
                out = []
                for assoc_id in body["AssociationIds"]:
                    assoc = self.associations.get(assoc_id)
                    if assoc is None:
                        return 400, {"__type": "DataRepositoryAssociationNotFound", "Message": assoc_id}
                    self.polls[assoc_id] += 1
                    if self.polls[assoc_id] > self.creating_polls:
                        assoc["Lifecycle"] = self.final
                        if self.failure_message:
                            assoc["FailureDetails"] = {"Message": self.failure_message}
                    out.append(assoc)
                return 200, {"Associations": out}
            (fs,) = [f["Values"][0] for f in body.get("Filters", []) if f["Name"] == "file-system-id"]
            every = [a for a in self.associations.values() if a["FileSystemId"] == fs]
            start = int(body.get("NextToken") or 0)
            page = every[start:start + self.page_size]
            reply = {"Associations": page}
            if start + self.page_size < len(every):
                reply["NextToken"] = str(start + self.page_size)
            return 200, reply
        return 400, {"__type": "InvalidAction", "Message": f"unknown operation {op!r}"}
