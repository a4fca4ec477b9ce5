"""Spot interruption notice: poll the instance metadata service and checkpoint as soon as one appears.

EC2 announces the reclaim of a spot instance two minutes ahead at ``/latest/meta-data/spot/instance-action``
(404 until then, afterwards ``{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}``). With
``--spot-watch`` a daemon thread on each node's local rank 0 (one per instance: the notice is per instance)
polls it every ``--spot-poll-s`` seconds over IMDSv2 (PUT ``/latest/api/token`` with a TTL header, then GETs
carrying the token; a 401 means the token expired and a new one is fetched).

Once a notice is seen, ``maybe_due`` answers True at the next step; the training loop adds that to the
checkpoint-due flag of its per-step all-reduce, so every rank checkpoints at the same step (a collective
decision even when the notice reached only one node). The checkpoint is committed, mirrored ahead of older
ones (the mirror uploads the newest first), and training goes on until SIGTERM arrives, which commits a
final checkpoint as usual: the notice period is spent training, not waiting.

Events: ``spot_notice`` (action, notice time, seconds left) and ``spot_checkpoint`` (step, seconds since the
notice). Try it against a loopback server (the tests' ``ImdsServer``)::

    python -m trainer --data DATASET --out RUN --spot-watch --spot-metadata-url http://127.0.0.1:8111
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime

from .config import SpotConfig
from .events import Event, EventLog

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_S = 21600             # the IMDSv2 maximum
_REQUEST_TIMEOUT_S = 1.0        # IMDS answers in milliseconds; a hung request must not delay the next poll much


class ImdsClient:
    """Minimal IMDSv2 client (urllib, never through an HTTP proxy)."""

    def __init__(self, base_url: str, timeout_s: float = _REQUEST_TIMEOUT_S):
        self.base = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        req = urllib.request.Request(self.base + TOKEN_PATH, method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        with self._opener.open(req, timeout=self.timeout_s) as resp:
            self._token = resp.read().decode().strip()
        # Renewed a minute early, so a poll never carries a token about to expire.
        self._token_expires = time.monotonic() + TOKEN_TTL_S - 60
        return self._token

    def get(self, path: str) -> str | None:
        """Body of a metadata path, or None if it does not exist (404)."""
        for attempt in range(2):
            token = self._token if self._token and time.monotonic() < self._token_expires else self._fetch_token()
            req = urllib.request.Request(self.base + path, headers={"X-aws-ec2-metadata-token": token})
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    return resp.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:
                    self._token = None      # expired or revoked: one new token, then give up this poll
                    continue
                raise
        return None

    def instance_action(self) -> dict | None:
        """The pending spot interruption (``{"action", "time"}``), or None."""
        body = self.get(ACTION_PATH)
        return json.loads(body) if body else None


class SpotWatcher:
    """Polls for a spot interruption notice in a daemon thread; ``maybe_due`` turns it into one checkpoint.

    Args:
        cfg: the spot section.
        events: the run's event log.
        enabled: whether this process polls (``--spot-watch`` on the node's local rank 0).
    """

    def __init__(self, cfg: SpotConfig, events: EventLog, enabled: bool):
        self.cfg, self.events = cfg, events
        self.enabled = enabled
        self.notice: dict | None = None
        self.noticed_at: float | None = None    # monotonic time the notice was seen
        self._taken = False
        self._seen = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled:
            self.client = ImdsClient(cfg.metadata_url)
            self._thread = threading.Thread(target=self._run, daemon=True, name="spot-watch")
            self._thread.start()

    def maybe_due(self, step: int, max_steps: int) -> bool:
        """True once, at the first step after a notice was seen (never at the last step: teardown saves it)."""
        if not self._seen.is_set() or self._taken or step >= max_steps:
            return False
        self._taken = True
        age = time.monotonic() - self.noticed_at
        self.events.emit(Event.SPOT_CHECKPOINT, step=step, since_notice_s=round(age, 4))
        log.warning("spot interruption notice %.1fs ago: checkpoint at step %d, then training on until SIGTERM",
                    age, step)
        return True

    def check(self) -> dict | None:
        """One poll; records and returns the notice if there is one."""
        action = self.client.instance_action()
        if action is None or self._seen.is_set():
            return action
        self.notice, self.noticed_at = action, time.monotonic()
        left = _seconds_until(action.get("time"))
        self.events.emit(Event.SPOT_NOTICE, action=action.get("action"), notice_time=action.get("time"),
                         seconds_left=None if left is None else round(left, 1))
        log.warning("spot interruption notice: %s at %s (%s s left)", action.get("action"), action.get("time"),
                    "?" if left is None else f"{left:.0f}")
        self._seen.set()
        return action

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set() and not self._seen.is_set():
            try:
                self.check()
                failing = False
            except (OSError, ValueError) as e:   # URLError, timeouts, HTTP errors, bad JSON
                if not failing:   # once per outage, not once per poll
                    log.warning("spot watch: instance metadata at %s not answering: %s", self.cfg.metadata_url, e)
                    self.events.emit(Event.SPOT_WATCH_ERROR, error=str(e)[:200])
                failing = True
            self._stop.wait(self.cfg.poll_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.poll_s + 2 * _REQUEST_TIMEOUT_S)


def _seconds_until(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - time.time()
    except ValueError:
        return None


def build_spot_watcher(cfg: SpotConfig, events: EventLog) -> SpotWatcher:
    """The watcher for this process: polling only on each node's local rank 0 with ``--spot-watch``."""
    return SpotWatcher(cfg, events, enabled=cfg.watch and int(os.environ.get("LOCAL_RANK", "0")) == 0)
