"""Peer memory snapshots: each node's memory snapshots (``trainer/replica.py``) also kept by another node, so
that a node loss costs the snapshot interval instead of everything since the last committed checkpoint.

In a ring, node i's ``PeerSender`` ships every new complete snapshot of its ranks over TCP to node
``holder_of(i, N)`` = i+1 mod N, whose ``PeerStore`` keeps it; any single node loss leaves every node's
newest snapshot on a live node. A replacement node's ranks, at their restore, fetch the step the job
resumes from with ``restore_from_peer`` and write it into their own snapshot directory as the replica files
the trainer reads, which then reads them as its own memory (``CheckpointManager.restore``).

Who runs what: each node's janitor (``trainer.warmstart``, one per node, outliving in-job restarts) starts
``python -m trainer.peer`` (``start_daemon``: niced, no torch, dying with the janitor) with the store's
socket bound beforehand, and gives its address to the ranks (``ENV``). Node indices are known only after the
rendezvous: at every restore the ranks gather (node, store address), and local rank 0 writes the node's
index and its holder's address to ``layout.peer_file``, which the daemon's sender follows.

Nothing torn is ever used, on either side:

- the sender reads a rank's marker, then the slot it names, then the marker again: unchanged means the
  trainer did not start a copy into that slot meanwhile (it writes only into a slot the marker does not
  name, handing the marker to its other slot first when it must overwrite the newest, and names it only
  once the copy is complete), so the bytes are one whole snapshot;
- the holder keeps two slots per (node, rank) and an index of the complete ones, replaced atomically: a copy
  goes into the slot that does not hold the newest complete snapshot, which is struck from the index first,
  and is entered only once all of it arrived with the sender's checksum and its consistency verdict. A
  sender or holder killed mid-copy leaves the other slot whole, and two complete steps per rank;
- the restore checks the checksum of what it fetched, and writes each rank's marker last.

Every socket operation has a timeout: a peer that dies or stalls mid-copy costs that copy, never a hang.

Nothing from the network is trusted or unpickled. Markers are plain JSON (``checkpoint.replica``), and every
message, both ways, carries an HMAC-SHA256 under the job's secret (``SECRET_ENV``, hex: a Kubernetes Secret on
a cluster, one generated per run by ``goodput train``) over the message with the job's identity (``JOB_ENV``:
the rendezvous id), a fresh nonce and the time: a request whose MAC does not verify (forged, or another job's),
whose nonce the store has seen (a replay) or whose time is more than ``REPLAY_WINDOW_S`` away is refused,
logged and counted (``peer_refused`` events); a reply must answer the request's own nonce. The snapshot bytes
are covered through their sha256, which the authenticated trailer (a put) or header (a get) carries.

    store = PeerStore(directory).start()                       # on every node: keeps its ring predecessor's
    PeerSender(replica_dir, node=i, peer=address_of_holder).send_once()   # the daemon's loop (serve_node)
    ...
    restore_from_peer(address_of_holder, node=i, ranks=[...], dest=replica_dir)   # on a replacement node
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .events import Event, EventLog
from .digests import path_digest
from .durable import write_bytes
from .errors import ChecksumMismatch
from .layout import peer_file, replica_marker, replica_previous, replica_ranks, replica_slot
from .signals import parent_death_preexec

log = logging.getLogger(__name__)

# The janitor's daemon's store address (host:port), in the ranks' environment: the restore gathers them.
ENV = "GOODPUT_PEER_STORE"
# The job's peer secret (hex, at least 16 bytes) and identity (the rendezvous id), in every rank's and peer
# daemon's environment.
SECRET_ENV = "GOODPUT_PEER_SECRET"
JOB_ENV = "GOODPUT_PEER_JOB"
# A request older or newer than this is refused; the store remembers the nonces it accepted for as long.
REPLAY_WINDOW_S = 300.0
CHUNK = 4 << 20
# Where a node's daemon keeps its ring predecessor's copies: in the node's snapshot directory, lost with it.
STORE_DIR = "peer-store"
TIMEOUT_S = 10.0
# Without a wake-up from a rank, the daemon looks for new snapshots this often. The ranks wake it once per
# snapshot: polling for the copy's lag instead (0.1 s) made their steps 1.2-1.5x slower on a loaded 2-core machine.
POLL_S = 2.0
_LEN = struct.Struct("!I")
# What a peer that died, stalled or sent nonsense raises here: it costs that request, nothing else.
_BAD_PEER = (OSError, ValueError, KeyError, TypeError, EOFError)


class PeerRefused(ValueError):
    """A peer message that is not authenticated: forged, replayed, another job's, or not answering our request."""


def secret_from_env(env=os.environ) -> bytes:
    """The job's peer secret; ValueError (one line, what to set) when it is missing or not hex of 16+ bytes."""
    raw = env.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ValueError(f"{SECRET_ENV} must hold the job's peer secret, at least 32 hex digits "
                         f"({'unset' if not raw else 'not that'}): peer memory snapshots never run unauthenticated")
    return secret


class Auth:
    """Seals and opens the peer messages of one job (``secret``, ``job``): see the module docstring."""

    def __init__(self, secret: bytes, job: str):
        self.secret, self.job = secret, job
        self._seen: dict[str, float] = {}   # nonce -> time of the requests accepted within the window
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env=os.environ) -> "Auth":
        return cls(secret_from_env(env), env.get(JOB_ENV, ""))

    def _mac(self, body: dict) -> str:
        return hmac.new(self.secret, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    def seal(self, message: dict, reply_to: str | None = None) -> dict:
        """``message`` with the job, a fresh nonce, the time, the request it answers, and their MAC."""
        body = {**message, "job": self.job, "nonce": secrets.token_hex(16), "time": time.time(),
                **({"re": reply_to} if reply_to is not None else {})}
        return {**body, "mac": self._mac(body)}

    def open(self, message: dict, reply_to: str | None = None) -> dict:
        """``message`` if authentic (a request: fresh and not seen before; a reply: to ``reply_to``), else
        ``PeerRefused``."""
        body = {k: v for k, v in message.items() if k != "mac"}
        if not hmac.compare_digest(str(message.get("mac", "")), self._mac(body)):
            raise PeerRefused("its MAC does not verify (forged, or sealed with another secret)")
        if body.get("job") != self.job:
            raise PeerRefused(f"it is job {body.get('job')!r}'s, not {self.job!r}'s")
        if reply_to is not None:
            if body.get("re") != reply_to:
                raise PeerRefused("it answers another request (a replayed reply)")
            return body
        now, nonce = time.time(), str(body.get("nonce"))
        if not isinstance(body.get("time"), (int, float)) or abs(now - body["time"]) > REPLAY_WINDOW_S:
            raise PeerRefused("its time is outside the replay window")
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * REPLAY_WINDOW_S}
            if nonce in self._seen:
                raise PeerRefused("its nonce was seen before (a replayed request)")
            self._seen[nonce] = now
        return body


def holder_of(node: int, nnodes: int) -> int:
    """The node that keeps ``node``'s snapshots: the next one in the ring."""
    return (node + 1) % nnodes


# ---- framing ---------------------------------------------------------------------------------------------

_MAX_MESSAGE = 1 << 24   # a header, trailer or reply; anything longer is not one of ours


def _send_json(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), CHUNK))
        if not part:
            raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def _recv_json(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_MESSAGE:
        raise ValueError(f"a message of {n} bytes")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("a message that is not a JSON object")
    return obj


def _stream(sock: socket.socket, src, size: int, h=None) -> str:
    """Send ``size`` bytes of the open file ``src``; return their sha256 (continuing ``h``, if given)."""
    h, left = h or hashlib.sha256(), size
    while left:
        chunk = src.read(min(left, CHUNK))
        if not chunk:
            raise OSError(f"{src.name} ended {left} bytes early")
        h.update(chunk)
        sock.sendall(chunk)
        left -= len(chunk)
    return h.hexdigest()


def _receive(sock: socket.socket, dst, size: int, h=None) -> str:
    """Receive ``size`` bytes into the open file ``dst``; return their sha256 (continuing ``h``, if given)."""
    h, left = h or hashlib.sha256(), size
    while left:
        chunk = sock.recv(min(left, CHUNK))
        if not chunk:
            raise ConnectionError(f"peer closed the connection {left} bytes before the end of the copy")
        h.update(chunk)
        dst.write(chunk)
        left -= len(chunk)
    return h.hexdigest()


# ---- the holder ------------------------------------------------------------------------------------------

@dataclass
class _Slots:
    """What the holder keeps of one (node, rank): two slot files and the index of the complete ones."""

    dir: Path
    rank: int

    def path(self, slot: int) -> Path:
        return self.dir / f"rank{self.rank}.slot{slot}"

    @property
    def index_path(self) -> Path:
        return self.dir / f"rank{self.rank}.index"

    def index(self) -> dict[int, dict]:
        """slot -> {step, sha256, marker (hex)} of each complete slot."""
        try:
            return {int(k): v for k, v in json.loads(self.index_path.read_text()).items()}
        except (OSError, ValueError):
            return {}

    def write_index(self, index: dict[int, dict]) -> None:
        write_bytes(self.index_path, json.dumps(index).encode())


class PeerStore:
    """Keeps the snapshots other nodes send (``PeerSender``) under ``directory``/node<i>/ and serves them
    back (``restore_from_peer``), on ``host``:``port`` (0: a free port; see ``address``), to the messages
    ``auth`` opens; the others are refused and counted (``refused``; a ``peer_refused`` event in ``events``)."""

    def __init__(self, directory: Path, auth: Auth | None = None, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = TIMEOUT_S, listener: socket.socket | None = None, events: EventLog | None = None):
        """``listener``: a socket already bound and listening (``start_daemon``'s) instead of ``host``:``port``;
        ``auth``: the job's (default: from the environment)."""
        self.dir, self.timeout_s, self.events = Path(directory), timeout_s, events
        self.auth = auth or Auth.from_env()
        self._lock = threading.Lock()   # one copy at a time per (node, rank); copies of different ranks overlap
        self._busy: set[tuple[int, int]] = set()
        self.refused = 0
        store = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(store.timeout_s)
                try:
                    store._handle(self.request)
                except PeerRefused as e:
                    store._refuse(self.client_address, e)
                except _BAD_PEER as e:   # a peer gone, stalled or confused: its copy only
                    log.warning("peer snapshot: a request from %s failed: %s", self.client_address, e)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler, bind_and_activate=listener is None)
        if listener is not None:
            self._server.socket.close()
            self._server.socket, self._server.server_address = listener, listener.getsockname()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def start(self) -> "PeerStore":
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.5,), name="peer-store",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def slots(self, node: int, rank: int) -> _Slots:
        return _Slots(self.dir / f"node{node}", rank)

    def steps(self, node: int, run: str | None = None) -> dict[int, list[int]]:
        """rank -> steps of the complete snapshots kept for ``node`` (``run``: made by that run only), newest
        first."""
        d = self.dir / f"node{node}"
        ranks = sorted(int(p.name[4:-6]) for p in d.glob("rank*.index")) if d.is_dir() else []
        return {r: sorted((e["step"] for e in self.slots(node, r).index().values()
                           if run is None or e.get("run") == run), reverse=True) for r in ranks}

    def _refuse(self, client, e: PeerRefused) -> None:
        with self._lock:
            self.refused += 1
        log.warning("peer snapshot: refused a message from %s: %s", client, e)
        if self.events is not None:
            self.events.emit(Event.PEER_REFUSED, role="store", peer=str(client[0]), reason=str(e))

    def _handle(self, sock: socket.socket) -> None:
        request = self.auth.open(_recv_json(sock))
        nonce = request["nonce"]

        def reply(obj: dict) -> None:
            _send_json(sock, self.auth.seal(obj, reply_to=nonce))

        if request["op"] == "put":
            reply(self._put(sock, request))
        elif request["op"] == "steps":
            reply({"ranks": self.steps(int(request["node"]), request.get("run"))})
        elif request["op"] == "get":
            self._get(reply, sock, int(request["node"]), int(request["rank"]), int(request["step"]))
        else:
            reply({"error": f"unknown op {request['op']!r}"})

    def _put(self, sock: socket.socket, req: dict) -> dict:
        key = (int(req["node"]), int(req["rank"]))
        with self._lock:
            if key in self._busy:
                return {"error": f"a copy of node {key[0]} rank {key[1]} is already arriving"}
            self._busy.add(key)
        try:
            slots = self.slots(*key)
            slots.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            index = slots.index()
            newest = max(index, key=lambda s: index[s]["step"], default=1)
            target = 1 - newest
            # Struck from the index before a byte of it is overwritten: a copy cut short is never listed.
            if index.pop(target, None) is not None:
                slots.write_index(index)
            marker = _recv_exact(sock, int(req["marker_len"]))
            head = _marker_head(marker)
            if head["step"] != int(req["step"]):
                return {"error": f"the marker says step {head['step']}, the request {req['step']}"}
            with open(slots.path(target), "wb") as f:
                digest = _receive(sock, f, int(req["size"]), hashlib.sha256(marker))
            trailer = self.auth.open(_recv_json(sock), reply_to=req["nonce"])
            if not trailer.get("consistent"):
                return {"error": "the sender's snapshot changed while it was read; dropped"}
            if trailer.get("sha256") != digest:
                return {"error": "checksum mismatch; dropped"}
            index[target] = {"step": int(req["step"]), "run": head["run"], "sha256": digest, "marker": marker.hex()}
            slots.write_index(index)
            return {"ok": True, "slot": target}
        finally:
            with self._lock:
                self._busy.discard(key)

    def _get(self, reply, sock: socket.socket, node: int, rank: int, step: int) -> None:
        slots = self.slots(node, rank)
        entry = next(((s, e) for s, e in slots.index().items() if e["step"] == step), None)
        if entry is None:
            reply({"error": f"no complete snapshot of node {node} rank {rank} at step {step}"})
            return
        slot, e = entry
        with open(slots.path(slot), "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            reply({"size": size, "sha256": e["sha256"], "marker": e["marker"]})
            _stream(sock, f, size)


# ---- the sender ------------------------------------------------------------------------------------------

def _read_marker(path: Path) -> tuple[bytes, dict] | None:
    """The marker's bytes and its step, slot and run; None if there is none."""
    try:
        raw = path.read_bytes()
        return raw, _marker_head(raw)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _marker_head(raw: bytes) -> dict:
    """Step, slot and run of a replica marker (plain JSON, ``checkpoint.replica``); ValueError if it is not one."""
    try:
        head = json.loads(raw)
        out = {"step": int(head["step"]), "slot": int(head["slot"]), "run": head.get("run")}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a replica marker: {e}") from e
    if out["slot"] not in (0, 1) or not (out["run"] is None or isinstance(out["run"], str)):
        raise ValueError("not a replica marker: bad slot or run")
    return out


class PeerSender:
    """Ships each new complete snapshot of the ranks in ``replica_dir`` (one node's ``NodeReplica`` files)
    to the holder at ``peer``, at each ``send_once`` (the node daemon's loop, ``serve_node``)."""

    def __init__(self, replica_dir: Path, node: int, peer: tuple[str, int], auth: Auth | None = None,
                 timeout_s: float = TIMEOUT_S):
        """``auth``: the job's (default: from the environment)."""
        self.dir, self.node, self.peer, self.timeout_s = Path(replica_dir), node, peer, timeout_s
        self.auth = auth or Auth.from_env()
        self.sent: dict[int, int] = {}       # rank -> newest step the holder confirmed
        self._failing: set[int] = set()      # ranks whose last copy failed

    def ranks(self) -> list[int]:
        return replica_ranks(self.dir)

    def retarget(self, node: int, peer: tuple[str, int]) -> None:
        """Ship to ``peer`` as ``node`` from now on (a new holder has none of what the old one kept)."""
        if (node, peer) != (self.node, self.peer):
            self.node, self.peer, self.sent = node, peer, {}

    def send_once(self) -> list[tuple[int, int]]:
        """Send what is new; return the (rank, step) pairs the holder kept. A failed copy is tried again at the
        next call (a newer snapshot by then, most likely); it is logged once until a copy gets through (a
        holder being replaced refuses every one)."""
        kept = []
        for rank in self.ranks():
            try:
                step = self._send(rank)
            except (OSError, ValueError) as e:
                if rank not in self._failing:
                    log.warning("peer snapshot of rank %d to %s:%d failed (retrying quietly): %s", rank, *self.peer, e)
                self._failing.add(rank)
                continue
            self._failing.discard(rank)
            if step is not None:
                self.sent[rank] = step
                kept.append((rank, step))
        return kept

    def _send(self, rank: int) -> int | None:
        first = _read_marker(replica_marker(self.dir, rank))
        if first is None or first[1]["step"] == self.sent.get(rank):
            return None
        raw, marker = first
        with socket.create_connection(self.peer, timeout=self.timeout_s) as sock, \
                open(replica_slot(self.dir, rank, marker["slot"]), "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            request = self.auth.seal({"op": "put", "node": self.node, "rank": rank, "step": marker["step"],
                                      "size": size, "marker_len": len(raw)})
            _send_json(sock, request)
            sock.sendall(raw)
            digest = _stream(sock, f, size, hashlib.sha256(raw))
            # Unchanged marker: no copy into this slot began while it was read (see the module docstring).
            again = _read_marker(replica_marker(self.dir, rank))
            _send_json(sock, self.auth.seal({"sha256": digest, "consistent": again is not None and again[0] == raw},
                                            reply_to=request["nonce"]))
            reply = self.auth.open(_recv_json(sock), reply_to=request["nonce"])
        if not reply.get("ok"):
            log.info("peer snapshot of rank %d step %d not kept: %s", rank, marker["step"], reply.get("error"))
            return None
        return marker["step"]


# ---- the restore -----------------------------------------------------------------------------------------

def _ask(sock: socket.socket, auth: Auth, request: dict) -> tuple[dict, dict]:
    """Send ``request`` sealed; return (the sealed request, the authenticated reply)."""
    sealed = auth.seal(request)
    _send_json(sock, sealed)
    return sealed, auth.open(_recv_json(sock), reply_to=sealed["nonce"])


def peer_steps(peer: tuple[str, int], node: int, timeout_s: float = TIMEOUT_S,
               run: str | None = None, auth: Auth | None = None) -> dict[int, list[int]]:
    """rank -> the complete steps the holder at ``peer`` keeps for ``node`` (``run``: of that run only).
    ``auth``: the job's (default: from the environment)."""
    auth = auth or Auth.from_env()
    with socket.create_connection(peer, timeout=timeout_s) as sock:
        _, reply = _ask(sock, auth, {"op": "steps", "node": node, **({"run": run} if run is not None else {})})
        return {int(r): [int(s) for s in steps] for r, steps in reply["ranks"].items()}


def restore_from_peer(peer: tuple[str, int], node: int, ranks: list[int], dest: Path,
                      timeout_s: float = TIMEOUT_S, among: set[int] | None = None,
                      run: str | None = None, auth: Auth | None = None) -> int | None:
    """Copy node ``node``'s newest snapshot that every rank of ``ranks`` has at the holder ``peer`` into
    ``dest`` as replica files (``NodeReplica`` reads them); return its step, or None when there is none (no
    holder reachable, no common step, a copy cut short): the restart then falls back to the committed
    checkpoint. A copy whose bytes are not the ones the holder was sent raises ``ChecksumMismatch``. Each rank's
    marker is written last, so a restore cut short or corrupt leaves nothing usable.

    ``among``: only these steps (the ones the other nodes' ranks hold: a step some rank lacks is no use).
    ``run``: only copies that run made (the replica's tag: run and world size). ``auth``: the job's (default:
    from the environment); a reply it does not open raises ``PeerRefused``.
    """
    auth = auth or Auth.from_env()
    try:
        held = peer_steps(peer, node, timeout_s, run, auth)
        common = set.intersection(*(set(held.get(r, ())) for r in ranks)) if ranks else set()
        common &= among if among is not None else common
        if not common:
            log.info("peer restore: %s:%d holds no step common to ranks %s of node %d (%s)", *peer, ranks, node,
                     held)
            return None
        step = max(common)
        for rank in ranks:
            _fetch(peer, node, rank, step, Path(dest), timeout_s, auth)
    except PeerRefused:
        raise
    except _BAD_PEER as e:
        log.warning("peer restore of node %d from %s:%d failed: %s", node, *peer, e)
        return None
    log.info("peer restore: node %d's ranks %s restored at step %d from %s:%d", node, ranks, step, *peer)
    return step


def _fetch(peer: tuple[str, int], node: int, rank: int, step: int, dest: Path, timeout_s: float, auth: Auth) -> None:
    # Nothing of an earlier replica may be read next to this copy: its marker goes first.
    for path in (replica_marker(dest, rank), replica_previous(dest, rank), replica_slot(dest, rank, 0),
                 replica_slot(dest, rank, 1)):
        path.unlink(missing_ok=True)
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    with socket.create_connection(peer, timeout=timeout_s) as sock:
        _, head = _ask(sock, auth, {"op": "get", "node": node, "rank": rank, "step": step})
        if "error" in head:
            raise ValueError(head["error"])
        raw = bytes.fromhex(head["marker"])
        marker = _marker_head(raw)
        if marker["step"] != step:
            raise ValueError(f"rank {rank}: asked for step {step}, got a marker of step {marker['step']}")
        with open(replica_slot(dest, rank, marker["slot"]), "wb") as f:
            digest = _receive(sock, f, int(head["size"]), hashlib.sha256(raw))
    if digest != head["sha256"]:
        raise ChecksumMismatch(f"rank {rank} step {step}: the copy fetched from the holder is not the copy it was sent "
                               f"(sha256 {digest[:16]}, sent {str(head['sha256'])[:16]})")
    write_bytes(replica_marker(dest, rank), raw)


# ---- one node's daemon, run by its janitor ---------------------------------------------------------------

def _target(replica_dir: Path) -> tuple[int, tuple[str, int]] | None:
    """(node, holder address) as the node's ranks last wrote them (``peer_file``), or None."""
    try:
        t = json.loads(peer_file(replica_dir).read_text())
        return int(t["node"]), (str(t["holder"][0]), int(t["holder"][1]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _wake_address(replica_dir: Path) -> bytes:
    """The node daemon's wake-up socket: in Linux's abstract namespace (no file, no path-length limit; the
    ranks and the daemon share the pod's network namespace), named after the node's snapshot directory."""
    return f"\0goodput-peer-{path_digest(replica_dir)}".encode()


def wake(replica_dir: Path) -> None:
    """Tell the node's daemon that a rank marked a new snapshot: it ships it now, not at its next look.
    Never blocks; nothing happens when no daemon listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        with contextlib.suppress(OSError):    # no daemon, or wake-ups already queued: it is awake anyway
            s.sendto(b"!", _wake_address(replica_dir))


def _wake_socket(replica_dir: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind(_wake_address(replica_dir))
    except OSError as e:       # another daemon of the same directory: this one only looks every poll
        log.warning("no wake-ups for %s (%s): looking for new snapshots every poll only", replica_dir, e)
        s.close()
        return None
    s.setblocking(False)
    return s


def serve_node(listener: socket.socket, replica_dir: Path, auth: Auth, poll_s: float = POLL_S,
               events: EventLog | None = None) -> None:
    """One node's part of the ring, until killed: keep what the predecessor sends (under ``replica_dir``, so
    it goes with the node's memory), and ship this node's snapshots to the holder its ranks named last, when
    a rank wakes it (``wake``) and every ``poll_s`` (the ranks' ``peer.json`` is read then). Messages are
    authenticated with ``auth``; refused ones go to ``events``."""
    store = PeerStore(replica_dir / STORE_DIR, auth, listener=listener, events=events).start()
    woken = _wake_socket(replica_dir)
    sender: PeerSender | None = None
    try:
        while True:
            while woken is not None:     # every wake-up queued so far is answered by this look
                try:
                    woken.recv(64)
                except BlockingIOError:
                    break
            target = _target(replica_dir)
            if target is not None:
                if sender is None:
                    sender = PeerSender(replica_dir, *target, auth)
                sender.retarget(*target)
                sender.send_once()
            if woken is not None:
                select.select([woken], [], [], poll_s)
            else:
                time.sleep(poll_s)
    finally:
        store.close()


def start_daemon(replica_dir: Path, host: str, poll_s: float = POLL_S, env: dict | None = None,
                 events: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start this node's peer daemon (``python -m trainer.peer``) as a child that dies with this process; return
    it and the ``host:port`` its store listens on (bound here, so it is known at once: connections queue
    until the daemon serves them; once it is gone they are refused). ``env``: its environment (the job's
    ``SECRET_ENV`` and ``JOB_ENV`` in it); ``events``: the run's event log (refused messages)."""
    secret_from_env(env if env is not None else os.environ)   # never a daemon that cannot authenticate
    listener = socket.create_server((host, 0), backlog=64)
    try:
        address = f"{advertised(host)}:{listener.getsockname()[1]}"
        proc = subprocess.Popen([sys.executable, "-m", "trainer.peer", "--listen-fd", str(listener.fileno()),
                                 "--replica-dir", str(replica_dir), "--poll-s", str(poll_s),
                                 *(["--events", str(events)] if events is not None else [])],
                                pass_fds=(listener.fileno(),), preexec_fn=parent_death_preexec(signal.SIGKILL),
                                env=env)
    finally:
        listener.close()
    return proc, address


def advertised(host: str) -> str:
    """The address other nodes reach a store bound to ``host`` at: this pod's own for all interfaces."""
    return socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0") else host


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    """One node's peer daemon (started by the node's janitor, ``trainer.warmstart``): keep the ring
    predecessor's memory snapshots, ship this node's to its holder. Niced: it takes CPU only when the ranks
    leave some."""
    p = argparse.ArgumentParser(prog="python -m trainer.peer", description=main.__doc__)
    p.add_argument("--listen-fd", type=int, required=True, help="the store's listening socket (inherited)")
    p.add_argument("--replica-dir", type=Path, required=True,
                   help="this node's memory snapshots (NodeReplica files) and its ranks' peer.json")
    p.add_argument("--poll-s", type=float, default=POLL_S,
                   help="how often to look for new snapshots and for the ranks' peer.json without a wake-up")
    p.add_argument("--events", type=Path, default=None, help="the run's events.jsonl (refused messages)")
    a = p.parse_args(argv)
    try:
        auth = Auth.from_env()
    except ValueError as e:
        raise SystemExit(f"python -m trainer.peer: {e}") from None
    os.nice(19)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [peer] %(message)s")
    events = EventLog(a.events, -1) if a.events is not None else None
    serve_node(socket.socket(fileno=a.listen_fd), a.replica_dir, auth, a.poll_s, events)


if __name__ == "__main__":
    main()
