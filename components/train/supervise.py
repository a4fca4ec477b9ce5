"""Create (or re-attach to) a training job and supervise it to the end, never waiting forever.

One supervisor for every job kind: a Training Operator ``PyTorchJob`` or a Kubeflow Trainer v2 ``TrainJob``
(the manifest's kind picks the adapter in ``components.train.job_kinds``; what differs between them lives there).

What the launcher does, in order:
  1. POST the job's peer secret (``components.train.peer_secret``: ``<job>-peer``, for a job whose pods read it),
     then the job under its deterministic name, and make the job the Secret's owner. 409 means a launcher
     before us (a restarted pod, a KFP retry) already created it: re-attach instead of creating a duplicate.
     A job of another run under that name is an error; a job that already failed is deleted and created
     again (the trainer resumes from its last committed checkpoint) once per launcher.
     A job queued by Kueue (``kueue.x-k8s.io/queue-name``; created suspended) waits for admission: the
     launcher says why, from its Workload ("waiting for admission in queue X: ..."), fails it if it is not
     admitted within ``admission_timeout_s``, and starts the overall deadline when Kueue admits it.
  2. Watch the job with ``kubernetes.watch.Watch`` (it resumes from the last resourceVersion when the
     server closes a watch). A 410 or a dropped stream re-lists the job and watches from the list's
     resourceVersion (never the object's own: a restarted API server's watch cache has no version older
     than its start, so that one is 410 again, forever). Every retry backs off (tenacity's waits), so a
     misbehaving server costs a few requests a minute. It reports phase changes, replica counts,
     per-replica restarts (a TrainJob's also from its JobSet) and pod waiting reasons, and streams the
     master pod's log (a TrainJob's node 0).
  3. End on Succeeded; on Failed raise ``JobFailed`` saying why (conditions, container termination
     reasons, recent events, the log's tail; a TrainJob's JobSet conditions and the pod failure policy rule
     that failed its node Job); past the overall deadline delete the job and raise
     ``JobTimeout`` (not admitted in time: ``NotAdmitted``); on SIGTERM/SIGINT (run cancelled) delete the job
     and raise ``JobCancelled``. Deleting a job deletes its peer secret too; its Workload goes with it (the
     garbage collector, by the Workload's ownerReference, once Kueue has dropped its finalizer).

The kubernetes client is pointed at the cluster (in-cluster service account) or at any URL::

    from components.train.supervise import SuperviseConfig, api_client, run_job
    run_job(manifest, namespace="team-a", client=api_client("http://127.0.0.1:8001"))  # kubectl proxy

This module imports neither torch nor kfp.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import tenacity
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from components.train import peer_secret
from components.train.job_kinds import PYTORCHJOB, JobKind, kind_of, unreadable
from components.train.kueue import NO_WORKLOAD, NO_WORKLOAD_HINT_S, queue_of, workload_state
from components.train.progress import ProgressLog
from trainer.signals import handlers

__all__ = ["SuperviseConfig", "JobOutcome", "JobFailed", "JobTimeout", "NotAdmitted", "JobCancelled", "api_client",
           "current_namespace", "run_job", "delete_job"]

RUN_ID_LABEL = "goodput.dev/kfp-run-id"
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
T = TypeVar("T")
Log = Callable[[str], None]


@dataclass
class SuperviseConfig:
    """How long to wait and how hard to retry. All times in seconds."""

    timeout_s: float = 7 * 86400          # overall deadline (Kueue: from admission); past it the job is deleted
    admission_timeout_s: float = 86400.0  # Kueue: how long the job may wait in its queue; past it the job is deleted
    # End of each watch (timeoutSeconds); 0 = the server decides (--min-request-timeout) and a silent
    # watch is renewed after 300 s.
    watch_timeout_s: int = 30
    # Re-read the pods (restart counts) at most this often, unless the job's phase or replicas change.
    pods_every_s: float = 30.0
    request_timeout_s: float = 30.0       # connect/read limit of one plain API call
    backoff_s: float = 1.0                # first wait after an API error, doubled up to backoff_max_s
    backoff_max_s: float = 30.0
    delete_wait_s: float = 20.0           # how long deletion waits for the job to be gone (fits pod grace)
    stream_logs: bool = True              # follow the master pod's log into this process's stdout
    # First wait before reopening a log stream, doubled while the stream fails or ends with nothing new.
    log_poll_s: float = 2.0
    log_backoff_max_s: float = 30.0
    log_idle_s: float = 60.0              # reconnect a log stream silent this long (drops go unnoticed)
    log_drain_s: float = 10.0             # at the end, how long to wait for the rest of the log
    log_tail_lines: int = 40              # log lines kept for the failure message
    reattach_tail_lines: int = 200        # on re-attach, start the log this many lines back
    events_limit: int = 15                # events in the failure message
    recreate_failed: bool = True          # a re-attached job that already failed is created afresh
    # 401/403 in a row, from a server that allowed the same calls before, taken for a restarting API server
    # whose authorizer has not loaded its RBAC yet; more are an RBAC error.
    denied_retries: int = 5


class JobFailed(RuntimeError):
    """The job failed; the message says why."""


class JobTimeout(TimeoutError):
    """The overall deadline passed; the job was deleted."""


class NotAdmitted(JobTimeout):
    """Kueue did not admit the job within ``admission_timeout_s``; the job was deleted."""


class JobCancelled(RuntimeError):
    """SIGTERM/SIGINT reached the launcher; the job was deleted."""


class _Terminated(BaseException):
    # BaseException so no ``except Exception`` inside the client swallows it.
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass
class JobOutcome:
    name: str
    namespace: str
    phase: str
    created: bool                          # False: re-attached to an existing job
    restarts: dict[str, int] = field(default_factory=dict)   # per replica type (container + pod restarts)
    kind: str = "PyTorchJob"
    wall_s: float = 0.0
    conditions: list[dict] = field(default_factory=list)
    queued_s: float = 0.0                  # Kueue: how long the job waited for admission


def _print(line: str) -> None:
    print(line, flush=True)


def api_client(host: str = "") -> k8s.ApiClient:
    """A client for ``host`` (tests, ``kubectl proxy``), else in-cluster config, else ~/.kube/config."""
    from kubernetes import config

    if host:
        return k8s.ApiClient(k8s.Configuration(host=host))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # $KUBECONFIG as it is now: the client library reads it once, when it is imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return k8s.ApiClient()


def current_namespace() -> str:
    """The launcher pod's namespace, else the kubeconfig context's, else ``default``."""
    if SA_NAMESPACE.is_file():
        return SA_NAMESPACE.read_text().strip()
    with contextlib.suppress(Exception):
        from kubernetes import config

        _, ctx = config.list_kube_config_contexts(config_file=os.environ.get("KUBECONFIG") or None)
        return ctx["context"].get("namespace") or "default"
    return "default"


def run_job(manifest: dict, *, namespace: str, client: k8s.ApiClient, cfg: SuperviseConfig | None = None,
            log: Log = _print) -> JobOutcome:
    """Create or re-attach to the job in ``manifest`` and wait for it to succeed.

    Raises:
        JobFailed: the job failed (message with conditions, pod reasons, events, log tail).
        JobTimeout: ``cfg.timeout_s`` passed; the job was deleted.
        JobCancelled: SIGTERM or SIGINT; the job was deleted.
        PermissionError: the API refused (RBAC).
        ValueError: the API server rejected the manifest.
    """
    sup = _Supervisor(manifest, namespace, client, cfg or SuperviseConfig(), log)
    with sup.terminate_raises():
        try:
            sup.create_or_attach()
            return sup.wait()
        except (_Terminated, KeyboardInterrupt) as e:
            what = f"signal {e.signum}" if isinstance(e, _Terminated) else "interrupt"
            sup.cleanup(f"launcher stopped ({what})")
            raise JobCancelled(f"{sup.what} {sup.ref} cancelled ({what}); it was deleted") from None
        except JobTimeout as e:
            sup.cleanup("not admitted in time" if isinstance(e, NotAdmitted) else "overall timeout")
            raise type(e)(f"{e}\nthe job was deleted") from None
        finally:
            sup.stop_logs()


def delete_job(name: str, namespace: str, client: k8s.ApiClient, *, kind: JobKind = PYTORCHJOB,
               wait_s: float = 20.0, log: Log = _print) -> bool:
    """Delete the job and its pods (foreground) and its peer secret, wait up to ``wait_s`` until the job is gone;
    True if gone. (Its Kueue Workload is the garbage collector's: the job owns it.)"""
    co = k8s.CustomObjectsApi(k8s.ApiClient(client.configuration))
    gvp = (kind.group, kind.version, namespace, kind.plural, name)
    ref = f"{kind.kind} {namespace}/{name}"
    try:
        co.delete_namespaced_custom_object(*gvp, body=k8s.V1DeleteOptions(propagation_policy="Foreground"),
                                           _request_timeout=10)
        log(f"deleting {ref} and its pods")
    except ApiException as e:
        if e.status != 404:
            log(f"could not delete {ref}: {e.status} {e.reason}")
            return False
    peer_secret.delete(k8s.CoreV1Api(co.api_client), namespace, name, log)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            co.get_namespaced_custom_object(*gvp, _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                log(f"{ref} is gone")
                return True
        except Exception:  # noqa: BLE001 - a flaky API must not stop the cleanup loop
            pass
        if time.monotonic() >= deadline:
            log(f"{ref} is still terminating; the API server finishes the deletion")
            return False
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# The supervisor ---------------------------------------------------------------------------------

def _transient(e: BaseException) -> bool:
    """Worth retrying: connection trouble, timeouts, 429 and 5xx."""
    if isinstance(e, ApiException):
        return e.status in (0, 408, 429) or e.status >= 500
    import urllib3

    return isinstance(e, (urllib3.exceptions.HTTPError, OSError))


class _Backoff:
    """Consecutive failures wait tenacity's exponential backoff (``first`` doubled up to ``most``) plus up to
    ``first`` of jitter, so many launchers do not hammer a recovering API server in step; a success resets it."""

    def __init__(self, first: float, most: float) -> None:
        self.strategy = tenacity.wait_exponential(multiplier=first, max=most) + tenacity.wait_random(0, first)
        self.failures = 0

    def pause(self) -> float:
        self.failures += 1
        return self.strategy(_Attempt(self.failures))

    def wait(self, deadline: float, event: threading.Event | None = None) -> None:
        pause = min(self.pause(), max(0.0, deadline - time.monotonic()))
        if event is None:
            time.sleep(pause)
        else:
            event.wait(pause)

    def reset(self) -> None:
        self.failures = 0


@dataclass
class _Attempt:
    """What tenacity's wait strategies read of a retry: the attempt number."""
    attempt_number: int


class _Supervisor:
    def __init__(self, manifest: dict, namespace: str, client: k8s.ApiClient, cfg: SuperviseConfig,
                 log: Log) -> None:
        self.manifest = manifest
        self.kind = kind_of(manifest)
        self.what = self.kind.kind
        self.gvp = (self.kind.group, self.kind.version, namespace, self.kind.plural)
        self.name = manifest["metadata"]["name"]
        self.ns = namespace
        self.ref = f"{namespace}/{self.name}"
        self.client, self.cfg, self.log = client, cfg, log
        self.co = k8s.CustomObjectsApi(client)
        self.core = k8s.CoreV1Api(client)
        self.start = time.monotonic()
        # Kueue: the job waits in this LocalQueue until admitted; the overall deadline starts then.
        self.queue = queue_of(manifest)
        self.admitted_at: float | None = None if self.queue else self.start
        self.deadline = self.start + (cfg.admission_timeout_s if self.queue else cfg.timeout_s)
        self._waiting = ""                # the last reason given for waiting
        self._workload_read = -math.inf
        self._uid = ""
        self.peer_secret = peer_secret.uses_peer_secret(manifest)
        self._made_secret = False         # this launcher created it (and deletes it if it adopts no job)
        self.created = False
        self._cleaning = False
        self._phase = ""
        self._replicas = ""
        self._pod_states: dict[str, str] = {}
        self._pods_read = -math.inf
        self._pod_uids: dict[tuple[str, str], set[str]] = {}
        self._container_restarts: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        self._unread: set[tuple[str, str, str]] = set()   # what could not be read beside the job, and why: said once
        self._logs: _LogFollower | None = None
        self.tail: deque[str] = deque(maxlen=cfg.log_tail_lines)   # the master's last log lines
        self.related: dict = {}           # what the kind's controller made of the job (a TrainJob's JobSet)
        self.progress = ProgressLog(log)  # the trainer's figures: a TrainJob's status, or its pods' annotation

    # Signals ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def terminate_raises(self):
        """SIGTERM raises ``_Terminated`` in the main thread, even inside a blocking read."""
        def handler(signum, _frame):
            if self._cleaning:      # already deleting: finish that first
                return
            raise _Terminated(signum)

        with handlers({signal.SIGTERM: handler}):
            yield

    def cleanup(self, why: str) -> None:
        self._cleaning = True
        self.log(f"{why}: deleting {self.what} {self.ref}")
        self.stop_logs(drain=False)
        delete_job(self.name, self.ns, self.client, kind=self.kind, wait_s=self.cfg.delete_wait_s, log=self.log)

    # API calls --------------------------------------------------------------------------------

    def _call(self, fn, *args, **kw):
        kw.setdefault("_request_timeout", self.cfg.request_timeout_s)
        kw.setdefault("_preload_content", False)
        resp = fn(*args, **kw)
        return json.loads(resp.data or b"{}")

    def _get_job(self) -> dict | None:
        try:
            return self._call(self.co.get_namespaced_custom_object, *self.gvp, self.name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 and self.admitted_at is None:
            with contextlib.suppress(Exception):
                self._read_workload(force=True)
            raise NotAdmitted(f"{self.what} {self.ref} was not admitted by Kueue within "
                              f"{self.cfg.admission_timeout_s:g} s in queue {self.queue}: "
                              f"{self._waiting or 'no reason known'}")
        if left <= 0:
            raise JobTimeout(f"{self.what} {self.ref} did not finish within {self.cfg.timeout_s:g} s "
                             f"(phase {self._phase or 'unknown'})\n{self.diagnose(self._get_quietly())}")
        return left

    def _get_quietly(self) -> dict:
        with contextlib.suppress(Exception):
            return self._get_job() or {}
        return {}

    def _fatal(self, e: ApiException, doing: str) -> Exception:
        if e.status in (401, 403):
            return PermissionError(f"{doing} {self.what} {self.ref}: {e.status} {e.reason}: {self.kind.rbac_hint}")
        return RuntimeError(f"{doing} {self.what} {self.ref}: {e.status} {e.reason} {e.body or ''}".strip())

    # 1. Create or re-attach -------------------------------------------------------------------

    def create_or_attach(self) -> None:
        backoff = _Backoff(self.cfg.backoff_s, self.cfg.backoff_max_s)
        recreated = False
        while True:
            self._remaining()
            try:
                self._create_secret()
                job = self._call(self.co.create_namespaced_custom_object, *self.gvp, body=self.manifest)
                self.created = True
                self.log(f"created {self.what} {self.ref}" + (f", queued in {self.queue}" if self.queue else ""))
                self._own_secret(job)
                return
            except ApiException as e:
                if e.status in (400, 422):
                    raise ValueError(f"the API server rejected {self.what} {self.ref}: {_status_message(e)}") from None
                if e.status != 409:
                    if not _transient(e):
                        raise self._fatal(e, "creating") from None
                    self.log(f"creating {self.what} {self.ref}: {e.status} {e.reason}; retrying")
                    backoff.wait(self.deadline)
                    continue
            except Exception as e:  # noqa: BLE001 - classified right below
                if not _transient(e):
                    raise
                # The POST may have landed: the retry then gets a 409 and re-attaches.
                self.log(f"creating {self.what} {self.ref}: {type(e).__name__}; retrying")
                backoff.wait(self.deadline)
                continue
            # 409: it exists.
            existing = self._get_job()
            if existing is None:
                continue                      # deleted in between: create it
            self._check_ownership(existing)
            if existing.get("metadata", {}).get("deletionTimestamp"):
                self.log(f"{self.what} {self.ref} is being deleted; waiting to create it again")
                self._wait_gone()
                continue
            phase, cond = self.kind.phase(existing)
            if phase == "Failed" and self.cfg.recreate_failed and not recreated:
                self.log(f"{self.what} {self.ref} exists and failed ({cond.get('reason', '')}: "
                         f"{cond.get('message', '')}); creating it again, the trainer resumes from FSx")
                recreated = True
                delete_job(self.name, self.ns, self.client, kind=self.kind, wait_s=self.cfg.delete_wait_s,
                           log=self.log)
                self._wait_gone()
                continue
            self.log(f"re-attached to existing {self.what} {self.ref} (phase {phase}); not creating a duplicate")
            self._own_secret(existing)
            return

    def _create_secret(self) -> None:
        """The job's peer secret, before the job (its pods read it when they start)."""
        if self.peer_secret:
            core = k8s.CoreV1Api(self.client)
            if peer_secret.create(core, self.ns, self.name, self.manifest["metadata"].get("labels") or {},
                                  self.cfg.request_timeout_s):
                self._made_secret = True
                self.log(f"created Secret {self.ns}/{peer_secret.secret_name(self.name)} (the job's peer secret)")

    def _own_secret(self, job: dict) -> None:
        """The job owns its peer secret, so that the secret goes with it (also by its TTL)."""
        self._uid = job["metadata"]["uid"]
        if not self.peer_secret:
            return
        try:
            peer_secret.own(k8s.CoreV1Api(self.client), self.ns, job, self.cfg.request_timeout_s)
        except ApiException as e:
            if e.status != 404:
                raise self._fatal(e, "owning the peer secret of") from None
            # Gone with a job of this name deleted before (re-attaching to its successor): make it again.
            self._create_secret()
            peer_secret.own(k8s.CoreV1Api(self.client), self.ns, job, self.cfg.request_timeout_s)

    def _check_ownership(self, existing: dict) -> None:
        mine = self.manifest.get("metadata", {}).get("labels", {}).get(RUN_ID_LABEL)
        theirs = (existing.get("metadata", {}).get("labels") or {}).get(RUN_ID_LABEL)
        if mine and theirs != mine:
            if self._made_secret:
                peer_secret.delete(k8s.CoreV1Api(self.client), self.ns, self.name, self.log)
            raise RuntimeError(f"a {self.what} named {self.ref} already exists but belongs to "
                               f"{'run ' + theirs if theirs else 'no KFP run'} (this is run {mine}); "
                               "refusing to adopt it: delete it or choose another name")

    def _wait_gone(self) -> None:
        while self._get_job() is not None:
            self._remaining()
            time.sleep(min(1.0, self.cfg.backoff_s))

    # 2. Watch ---------------------------------------------------------------------------------

    def wait(self) -> JobOutcome:
        from kubernetes import watch

        if self.cfg.stream_logs:
            self._logs = _LogFollower(self, tail=None if self.created else self.cfg.reattach_tail_lines)
            self._logs.start()
        backoff = _Backoff(self.cfg.backoff_s, self.cfg.backoff_max_s)
        rv, expired = None, False           # expired: the last watch ended in 410 (said once per streak)
        allowed, denied = False, 0          # a list succeeded once; 401/403 since the last good watch
        while True:
            remaining = self._remaining()
            began, seen = time.monotonic(), 0
            try:
                if rv is None:        # (re)list: the current state and the version to watch from
                    job, rv = self._list_job()
                    allowed = True
                    if job is None:
                        raise JobFailed(f"{self.what} {self.ref} was deleted by someone else while running")
                    if self._observe(job):
                        return self._finish(job)
                w = watch.Watch()
                kw: dict = {"allow_watch_bookmarks": True}
                if self.cfg.watch_timeout_s:
                    seconds = max(1, int(min(self.cfg.watch_timeout_s, math.ceil(remaining))))
                    kw.update(timeout_seconds=seconds, _request_timeout=(10, seconds + 15))
                else:
                    # The server ends the watch (--min-request-timeout) and Watch resumes it from the last
                    # version seen; a read timeout hands control back to check the deadline and the pods.
                    kw.update(_request_timeout=(10, min(300.0, max(1.0, remaining))))
                for event in w.stream(self.co.list_namespaced_custom_object, *self.gvp,
                                      field_selector=f"metadata.name={self.name}", resource_version=rv, **kw):
                    obj = event["raw_object"]
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event["type"] == "BOOKMARK":       # only a newer version to resume from
                        continue
                    seen, expired, denied = seen + 1, False, 0
                    if event["type"] == "DELETED":
                        raise JobFailed(f"{self.what} {self.ref} was deleted by someone else while running\n"
                                        f"{self.diagnose(obj)}")
                    if self._observe(obj):
                        return self._finish(obj)
                    self._remaining()
                if not seen and time.monotonic() - began < 1.0:
                    # A watch the server ends at once is a failure too, or the loop would spin.
                    self.log(f"watch of {self.what} {self.ref} ended at once; watching again after a pause")
                    backoff.wait(self.deadline)
                else:
                    backoff.reset()
                    expired, denied = False, 0
            except ApiException as e:
                if e.status == 410:       # our resourceVersion is too old: re-list
                    if not expired:
                        self.log("watch expired (410); re-listing the job")
                    expired, rv = True, None
                    backoff.wait(self.deadline)
                    continue
                if e.status in (401, 403) and allowed and denied < self.cfg.denied_retries:
                    denied += 1
                    self.log(f"watching {self.what} {self.ref}: {e.status} {e.reason} from a server that allowed "
                             "it before (restarting, RBAC not loaded yet?); retrying")
                    rv = None
                    backoff.wait(self.deadline)
                    continue
                if not _transient(e):
                    raise self._fatal(e, "watching") from None
                self.log(f"watching {self.what} {self.ref}: {e.status} {e.reason}; resyncing")
                rv = None
                backoff.wait(self.deadline)
            except (JobFailed, JobTimeout, _Terminated, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - classified right below
                if not _transient(e):
                    raise
                if _read_timeout(e) and not self.cfg.watch_timeout_s:
                    backoff.reset()       # a silent watch renewed: nothing failed
                else:
                    self.log(f"watch of {self.what} {self.ref} dropped ({type(e).__name__}); resyncing")
                    rv = None
                    backoff.wait(self.deadline)
            # Kueue's reason changes on the Workload, and pod restarts do not always touch the job.
            self.read_aside("its Kueue Workload", "why Kueue holds it", self._read_workload)
            self.read_aside("its pods", "its restarts and pod states", self._refresh_pods)

    def _list_job(self) -> tuple[dict | None, str]:
        """The job and the list's resourceVersion: the server's current one, from which a watch is valid."""
        data = self._call(self.co.list_namespaced_custom_object, *self.gvp, field_selector=f"metadata.name={self.name}")
        items = [j for j in data.get("items") or [] if j.get("metadata", {}).get("name") == self.name]
        return (items[0] if items else None), (data.get("metadata") or {}).get("resourceVersion")

    def _observe(self, job: dict) -> bool:
        """Report what changed; True once the job is finished (succeeded or failed)."""
        self._admission(job)
        phase, cond = self.kind.phase(job)
        changed = phase != self._phase
        if changed:
            detail = f" ({cond.get('reason', '')}: {cond.get('message', '')})" if cond.get("message") else ""
            self.log(f"{self.what} {self.ref}: {phase}{detail}")
            self._phase = phase
        self.progress.observe_job(job)
        replicas = self.kind.replicas(job)
        if replicas and replicas != self._replicas:
            self.log(f"replicas: {replicas}")
            self._replicas = replicas
            changed = True
        self.read_aside("its pods", "its restarts and pod states", lambda: self._refresh_pods(force=changed))
        return phase in ("Succeeded", "Failed")

    def read_aside(self, what: str, lacking: str, read: Callable[[], T]) -> T | None:
        """``read()``: ``what`` the launcher reports beside the job, which never stops it following the job. On
        an error, None: a transient one passes (the next read retries), any other is said once per kind of
        error, with what the report then lacks (``lacking``)."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - said, not raised: the job is followed without it
            why = unreadable(e)
            if _transient(e) or (what, lacking, why) in self._unread:
                return None
            self._unread.add((what, lacking, why))
            self.log(f"cannot read {what} of {self.what} {self.ref} ({why}): this report may lack {lacking}; "
                     "the job itself is followed as before")
            return None

    # Kueue -------------------------------------------------------------------------------------------

    def _admission(self, job: dict) -> None:
        """A queued job: admitted once Kueue unsuspends it (the overall deadline starts then); until then, why not."""
        if self.admitted_at is not None:
            return
        self._uid = (job.get("metadata") or {}).get("uid") or self._uid
        if not self.kind.suspended(job):
            self.admitted_at = time.monotonic()
            self.deadline = self.admitted_at + self.cfg.timeout_s
            self.log(f"admitted by Kueue in queue {self.queue} after {self.admitted_at - self.start:.1f} s; the "
                     f"train timeout ({self.cfg.timeout_s:g} s) runs from now")
            return
        self._read_workload(force=not self._waiting)

    def _read_workload(self, force: bool = False) -> None:
        """Say why the job waits, from its Workload, when that changes; at most every ``pods_every_s``."""
        if self.admitted_at is not None or not self._uid:
            return
        if not force and time.monotonic() - self._workload_read < self.cfg.pods_every_s:
            return
        self._workload_read = time.monotonic()
        try:
            reason = workload_state(self._call, self.client, self.ns, self._uid).reason
            if reason == NO_WORKLOAD and time.monotonic() - self.start > NO_WORKLOAD_HINT_S:
                reason += (" (is Kueue running, with this job kind's integration on, and does the LocalQueue exist? "
                           "deploy/kueue/README.md)")
        except ApiException as e:
            if e.status not in (401, 403, 404):
                raise
            reason = (f"its Workload cannot be read ({e.status} {e.reason}: the launcher's Role grants list on "
                      "workloads.kueue.x-k8s.io; is Kueue installed?)")
        if reason != self._waiting:
            self._waiting = reason
            self.log(f"waiting for admission in queue {self.queue}: {reason}")

    def _list_pods(self) -> list[dict]:
        data = self._call(self.core.list_namespaced_pod, self.ns, label_selector=self.kind.pod_selector(self.name))
        return data.get("items") or []

    def _refresh_pods(self, force: bool = False) -> None:
        """Restart counts and pod states; at most every ``pods_every_s`` unless ``force``."""
        if not force and time.monotonic() - self._pods_read < self.cfg.pods_every_s:
            return
        self._pods_read = time.monotonic()
        pods = self._list_pods()
        self.progress.observe_job(pods=pods)
        for pod in pods:
            meta, status = pod.get("metadata", {}), pod.get("status") or {}
            rtype, index = self.kind.replica_of(pod)
            uid = meta.get("uid", meta.get("name", ""))
            self._pod_uids.setdefault((rtype, index), set()).add(uid)
            restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
            self._container_restarts[uid] = max(self._container_restarts.get(uid, 0), restarts)
            state = _pod_state(pod)
            name = meta.get("name", "?")
            if self._pod_states.get(name) != state:
                self._pod_states[name] = state
                self.log(f"pod {name}: {state}")
        per_replica = {key: len(uids) - 1 + sum(self._container_restarts.get(u, 0) for u in uids)
                       for key, uids in self._pod_uids.items()}
        # The kind's controller may count restarts this launcher saw no pods of (a JobSet's, across re-attaches).
        self.related = self.kind.related(self._call, self.client, self.ns, self.name)
        counts = self.kind.restarts(per_replica, self.related)
        if counts != self.restarts and any(counts.values()):
            self.log("restarts: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        self.restarts = counts

    # 3. The end -------------------------------------------------------------------------------

    def _finish(self, job: dict) -> JobOutcome:
        phase, _ = self.kind.phase(job)
        if phase == "Failed":
            self.stop_logs(drain=True)
            raise JobFailed(self.diagnose(job))
        self.stop_logs(drain=True)
        wall = time.monotonic() - self.start
        self.log(f"{self.what} {self.ref} succeeded after {wall:.1f} s (restarts: "
                 + (", ".join(f"{k}={v}" for k, v in sorted(self.restarts.items())) or "none") + ")")
        queued = (self.admitted_at or self.start) - self.start
        return JobOutcome(self.name, self.ns, phase, self.created, dict(self.restarts), self.what, round(wall, 3),
                          (job.get("status") or {}).get("conditions") or [], round(queued, 3))

    def stop_logs(self, drain: bool = False) -> None:
        if self._logs is None:
            return
        if drain:
            self._logs.finish.set()
            self._logs.join(self.cfg.log_drain_s)
        self._logs.stop.set()
        self._logs = None

    def diagnose(self, job: dict) -> str:
        """Why the job is where it is: conditions, pods, events, the log's tail."""
        phase, _ = self.kind.phase(job) if job else ("unknown", {})
        lines = [f"{self.what} {self.ref} {phase.lower()}:"]
        for c in (job.get("status") or {}).get("conditions") or []:
            if str(c.get("status")) == "True":
                lines.append(f"  condition {c.get('type')}: {c.get('reason', '')}: {c.get('message', '')}")
        # Best effort, as the job has ended or failed already, but a part that cannot be read says so.
        try:
            pods = self._list_pods()
        except Exception as e:  # noqa: BLE001 - said in the diagnosis
            pods = []
            lines.append(f"  its pods cannot be read ({unreadable(e)})")
        for pod in pods:
            for why in _pod_problems(pod):
                lines.append(f"  pod {pod['metadata']['name']}: {why}")
        try:
            self.related = self.kind.related(self._call, self.client, self.ns, self.name) or self.related
        except Exception as e:  # noqa: BLE001 - said in the diagnosis
            lines.append(f"  what its controller made of it cannot be read ({unreadable(e)})")
        try:
            lines += self.kind.explain(self._call, self.client, self.ns, self.name, self.related)
        except Exception as e:  # noqa: BLE001 - said in the diagnosis
            lines.append(f"  why its controller failed it cannot be read ({unreadable(e)})")
        # Events of the job, the master and the pods in trouble (not of every pod of a large job).
        names = [p["metadata"]["name"] for p in pods if _pod_problems(p) or self.kind.is_master(p)]
        events, unread = self._events([self.name] + names[:20])
        if unread:
            lines.append(f"  events cannot be read ({unread})")
        if events:
            lines.append("  recent events:")
            lines += [f"    {e}" for e in events]
        if self.tail:
            lines.append(f"  last {len(self.tail)} log lines of the master:")
            lines += [f"    {t}" for t in self.tail]
        return "\n".join(lines)

    def _events(self, names: list[str]) -> tuple[list[str], str]:
        """The recent events of the objects ``names``, and why some could not be read ("" if all were)."""
        found, unread = [], ""
        for name in names[:50]:
            try:
                data = self._call(self.core.list_namespaced_event, self.ns,
                                  field_selector=f"involvedObject.name={name}")
            except Exception as e:  # noqa: BLE001 - the diagnosis is best effort, and says what it lacks
                unread = unread or unreadable(e)
                continue
            found += data.get("items") or []

        def when(e: dict) -> str:
            return (e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp")
                    or e.get("metadata", {}).get("creationTimestamp") or "")

        found.sort(key=when)
        out = []
        for e in found[-self.cfg.events_limit:]:
            obj = e.get("involvedObject") or {}
            count = f" (x{e['count']})" if (e.get("count") or 1) > 1 else ""
            out.append(f"{when(e)} {e.get('type', '')} {e.get('reason', '')} "
                       f"{obj.get('kind', '').lower()}/{obj.get('name', '')}: {e.get('message', '')}{count}")
        return out, unread


def _read_timeout(e: BaseException) -> bool:
    import urllib3

    return isinstance(e, urllib3.exceptions.ReadTimeoutError) or (
        isinstance(e, urllib3.exceptions.ProtocolError) and "timed out" in str(e))


def _status_message(e: ApiException) -> str:
    with contextlib.suppress(Exception):
        return json.loads(e.body).get("message") or e.reason
    return f"{e.status} {e.reason}"


def _containers(pod: dict) -> list[dict]:
    status = pod.get("status") or {}
    return (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])


def _pod_state(pod: dict) -> str:
    status = pod.get("status") or {}
    phase = status.get("phase", "Unknown")
    if status.get("reason"):
        return f"{phase} ({status['reason']}: {status.get('message', '')})"
    for c in _containers(pod):
        waiting = (c.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return f"{phase}, {c.get('name')} waiting: {waiting.get('reason')} {waiting.get('message', '')}".rstrip()
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{phase} (unschedulable: {cond.get('message', cond.get('reason', ''))})"
    return phase


def _pod_problems(pod: dict) -> list[str]:
    out = []
    status = pod.get("status") or {}
    if status.get("reason"):
        out.append(f"{status.get('phase', '')} {status['reason']}: {status.get('message', '')}".strip())
    for c in _containers(pod):
        for when, state in (("", c.get("state") or {}), ("previously ", c.get("lastState") or {})):
            term = state.get("terminated")
            if term and (term.get("exitCode") or 0) != 0:
                msg = (term.get("message") or "").strip().replace("\n", " | ")[-500:]
                out.append(f"container {c.get('name')} {when}terminated: {term.get('reason', '')} "
                           f"(exit code {term.get('exitCode')}){': ' + msg if msg else ''}")
            waiting = state.get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                out.append(f"container {c.get('name')} waiting: {waiting.get('reason')}: "
                           f"{waiting.get('message', '')}")
        if c.get("restartCount"):
            out.append(f"container {c.get('name')} restarted {c['restartCount']} times")
    return out


# Log streaming ----------------------------------------------------------------------------------

def _parse_ts(text: str) -> tuple[int, int] | None:
    """RFC 3339 with nanoseconds ("2024-05-01T10:00:00.123456789Z") as (epoch seconds, nanoseconds)."""
    try:
        main, _, frac = text.rstrip("Z").partition(".")
        secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
        return secs, int((frac + "000000000")[:9]) if frac else 0
    except (ValueError, OverflowError):
        return None


class _LogFollower(threading.Thread):
    """Follow the master's (elastic: worker 0's) container log across restarts and dropped streams.

    A dropped or idle stream resumes with ``sinceSeconds`` and skips what it had shown: lines older than
    the last one shown, and as many lines of that last timestamp as it had shown (lines may share one).
    That position is kept across restarts of the container in the same pod: the kubelet serves the new
    container's log as soon as it runs, maybe before the pod's status counts the restart, so the follower
    may already be reading it under the old restart count. A new pod starts afresh. A stream that fails
    or ends with nothing new is reopened after a growing pause.
    """

    def __init__(self, sup: _Supervisor, tail: int | None) -> None:
        super().__init__(name=f"logs-{sup.name}", daemon=True)
        self.sup = sup
        self.stop = threading.Event()
        self.finish = threading.Event()     # the job ended: read what is left, then stop
        self.first_tail = tail
        # (timestamp of the last line shown, how many shown lines have it): where a resumed stream picks up
        self.last: tuple[tuple[int, int], int] | None = None
        self._resumed: tuple[tuple[int, int], int] | None = None     # still skipping lines shown before
        self._at_resume_ts = 0
        self.selector, self.prefix = sup.kind.master_selector(sup.name, sup.manifest)
        self.container = sup.kind.container
        self.backoff = _Backoff(sup.cfg.log_poll_s, sup.cfg.log_backoff_max_s)
        # Its own client: the main thread may be interrupted by SIGTERM in the middle of a request.
        self.core = k8s.CoreV1Api(k8s.ApiClient(sup.client.configuration))

    def run(self) -> None:
        done: set[tuple[str, int]] = set()
        uid = None
        while not self.stop.is_set():
            pod = self._pod()
            k = _instance(pod, self.container) if pod else None
            if k is None or k in done:
                if self.finish.is_set():
                    return
                self.stop.wait(self.sup.cfg.log_poll_s)
                continue
            if k[0] != uid:                 # a new pod: its log starts afresh
                uid, self.last = k[0], None
            shown = self.last
            try:
                self._stream(pod["metadata"]["name"])
            except Exception:  # noqa: BLE001 - not started yet, gone, dropped or idle: reopen after a pause
                self.backoff.wait(math.inf, self.stop)
                continue
            if self.last != shown:
                self.backoff.reset()
            # The stream ended: that instance is finished if its container is over or was replaced.
            now = self._pod()
            if now is None or _instance(now, self.container) != k or _terminated(now, self.container):
                done.add(k)
            elif self.last == shown and not self.finish.is_set():
                self.backoff.wait(math.inf, self.stop)     # ended at once, nothing new: do not spin

    def _pod(self) -> dict | None:
        def pods() -> list[dict]:
            resp = self.core.list_namespaced_pod(self.sup.ns, label_selector=self.selector,
                                                 _preload_content=False, _request_timeout=10)
            return json.loads(resp.data or b"{}").get("items") or []

        items = self.sup.read_aside("its pods", "the master's log", pods) or []   # retried at the next poll
        live = [p for p in items if not p.get("metadata", {}).get("deletionTimestamp")] or items
        return live[-1] if live else None

    def _stream(self, pod: str) -> None:
        kw: dict = {}
        if self.last is not None:
            # Resume a little before the last line seen; the timestamps drop the overlap.
            kw["since_seconds"] = max(1, int(time.time() - self.last[0][0]) + 5)
        elif self.first_tail is not None:
            kw["tail_lines"] = self.first_tail      # re-attached: not the whole history again
        self.first_tail = None
        self._resumed, self._at_resume_ts = self.last, 0
        resp = self.core.read_namespaced_pod_log(pod, self.sup.ns, container=self.container, follow=True,
                                                 timestamps=True, _preload_content=False,
                                                 _request_timeout=(10, self.sup.cfg.log_idle_s), **kw)
        try:
            buf = b""
            for chunk in resp.stream(amt=None, decode_content=False):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    self._emit(raw.decode("utf-8", "replace"))
                if self.stop.is_set():
                    return
            if buf:
                self._emit(buf.decode("utf-8", "replace"))
        finally:
            resp.release_conn()

    def _emit(self, line: str) -> None:
        stamp, _, text = line.partition(" ")
        ts = _parse_ts(stamp)
        if ts is None:
            text = line
        else:
            if self._resumed is not None:    # drop what was shown before the stream was resumed
                (seen_ts, seen_n) = self._resumed
                self._at_resume_ts += ts == seen_ts
                if ts < seen_ts or (ts == seen_ts and self._at_resume_ts <= seen_n):
                    return
                self._resumed = None
            same = self.last is not None and self.last[0] == ts
            self.last = (ts, self.last[1] + 1 if same else 1)
        self.sup.tail.append(text)
        self.sup.log(f"{self.prefix} {text}")


def _instance(pod: dict, container: str) -> tuple[str, int] | None:
    """(pod uid, restart count) of the trainer container once it has started, else None."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        if c.get("name") == container:
            state = c.get("state") or {}
            if "running" in state or "terminated" in state:
                return pod["metadata"].get("uid", pod["metadata"]["name"]), int(c.get("restartCount") or 0)
    return None


def _terminated(pod: dict, container: str) -> bool:
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        if c.get("name") == container:
            return "terminated" in (c.get("state") or {})
    return False


if __name__ == "__main__":     # pragma: no cover - a debugging aid: supervise a manifest file
    import yaml

    _manifest = yaml.safe_load(open(sys.argv[1]))
    run_job(_manifest, namespace=sys.argv[2] if len(sys.argv) > 2 else current_namespace(),
            client=api_client(sys.argv[3] if len(sys.argv) > 3 else ""))
