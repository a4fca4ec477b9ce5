"""Peer memory snapshots (trainer/peer.py): a node's replica copied to another node over TCP and restored
from there by a replacement node, never torn, never waiting forever."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from trainer import peer
from trainer.checkpoint.integrity import state_digests
from trainer.checkpoint.replica import NodeReplica
from trainer.peer import PeerSender, PeerStore, holder_of, peer_steps, restore_from_peer

from tests.conftest import until


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value), "b": torch.arange(8.0) + value}, "step": int(value)}


def snapshot(replica: NodeReplica, step: int) -> None:
    """What the trainer does: copy the state into the slot the marker does not name, then mark it."""
    marked = replica.marked()
    slot = 1 - marked["slot"] if marked else 0
    buf = replica.buffer(_state(step), slot)
    for k, t in _state(step)["model"].items():
        buf["model"][k].copy_(t)
    replica.mark(step, slot, {**buf, "step": step}, run="r1", checksums=state_digests(buf))


def restored_step(directory, rank: int) -> int | None:
    """The step a restarted rank would read back from ``directory``, checked against its values."""
    loaded = NodeReplica(directory, rank).load(_state(0))
    if loaded is None:
        return None
    step, _, state = loaded
    assert torch.equal(state["model"]["w"], torch.full((64, 64), float(step))) and state["step"] == step
    return step


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    """The job's peer secret and identity, as the launcher gives them to every rank and daemon."""
    monkeypatch.setenv(peer.SECRET_ENV, "ab" * 32)
    monkeypatch.setenv(peer.JOB_ENV, "job-1")


@pytest.fixture
def store(tmp_path):
    s = PeerStore(tmp_path / "holder").start()
    yield s
    s.close()


def test_the_ring_keeps_each_node_on_another_node():
    assert [holder_of(i, 3) for i in range(3)] == [1, 2, 0] and holder_of(0, 1) == 0


def test_a_replacement_node_restores_the_newest_step_every_rank_has(tmp_path, store):
    src, dest = tmp_path / "node1-shm", tmp_path / "replacement-shm"
    replicas = [NodeReplica(src, r) for r in (2, 3)]
    sender = PeerSender(src, node=1, peer=store.address)
    for step in (5, 6):
        for r in replicas:
            snapshot(r, step)
        assert sorted(sender.send_once()) == [(2, step), (3, step)]
    # Only a step the other nodes' ranks hold is of use: the older one, if that is what they have.
    assert restore_from_peer(store.address, 1, [2, 3], dest, among={5}) == 5
    assert [restored_step(dest, r) for r in (2, 3)] == [5, 5]
    snapshot(replicas[0], 7)          # rank 2 has moved on; rank 3 has not (yet)
    assert sender.send_once() == [(2, 7)] and sender.send_once() == []      # nothing new: nothing sent
    assert peer_steps(store.address, 1) == {2: [7, 6], 3: [6, 5]}
    assert restore_from_peer(store.address, 1, [2, 3], dest) == 6
    assert [restored_step(dest, r) for r in (2, 3)] == [6, 6]
    # A rank the holder never got: no consistent step, nothing restored, the restart uses FSx.
    assert restore_from_peer(store.address, 1, [2, 3, 4], tmp_path / "other") is None
    assert restored_step(tmp_path / "other", 2) is None


def test_a_copy_torn_at_the_source_is_dropped(tmp_path, store, monkeypatch):
    """The trainer finished a newer copy while the sender read the slot: the bytes may mix two snapshots."""
    src = tmp_path / "shm"
    replica = NodeReplica(src, 0)
    snapshot(replica, 3)
    sender = PeerSender(src, node=0, peer=store.address)
    assert sender.send_once() == [(0, 3)]
    snapshot(replica, 4)
    real_stream = peer._stream

    def stream_then_trainer_moves_on(sock, f, size, h=None):
        digest = real_stream(sock, f, size, h)
        snapshot(replica, 5)           # marker replaced mid-read: slot 0 (step 4) may be being overwritten
        return digest

    monkeypatch.setattr(peer, "_stream", stream_then_trainer_moves_on)
    assert sender.send_once() == []
    monkeypatch.setattr(peer, "_stream", real_stream)
    assert peer_steps(store.address, 0) == {0: [3]}
    assert sender.send_once() == [(0, 5)]          # the next round ships the newer, whole one
    assert restore_from_peer(store.address, 0, [0], tmp_path / "new") == 5
    assert restored_step(tmp_path / "new", 0) == 5


def test_a_sender_killed_mid_copy_leaves_the_holders_older_copies_whole(tmp_path, store):
    src = tmp_path / "shm"
    replica = NodeReplica(src, 0)
    for step in (1, 2):
        snapshot(replica, step)
        PeerSender(src, node=0, peer=store.address).send_once()
    snapshot(replica, 3)
    # A sender that dies half way through the step-3 slot: header, marker, half the bytes, then gone.
    raw = replica.marker_path.read_bytes()
    data = replica._slot_path(replica.marked()["slot"]).read_bytes()
    with socket.create_connection(store.address, timeout=5) as sock:
        peer._send_json(sock, peer.Auth.from_env().seal({"op": "put", "node": 0, "rank": 0, "step": 3,
                                                         "size": len(data), "marker_len": len(raw)}))
        sock.sendall(raw + data[:len(data) // 2])
    # The slot it was overwriting (step 1's) is struck from the index; step 2's is whole and restorable.
    assert until(lambda: peer_steps(store.address, 0) == {0: [2]}, 10)
    assert restore_from_peer(store.address, 0, [0], tmp_path / "new") == 2
    assert restored_step(tmp_path / "new", 0) == 2


def test_a_holder_that_dies_or_stalls_mid_copy_costs_that_copy_not_a_hang(tmp_path):
    """A holder that accepts and then stops reading (or vanishes): the sender gives up within its timeout
    and sends again later; a restore from it returns None (fall back to FSx) within the timeout too."""
    src = tmp_path / "shm"
    replica = NodeReplica(src, 0)
    replica_size = 64 << 20      # larger than the socket buffers, so a holder that stops reading blocks the send
    buf = replica.buffer({"x": torch.zeros(replica_size // 4)}, 0)
    replica.mark(1, 0, buf, run="r1", checksums=state_digests(buf))
    stalled = socket.create_server(("127.0.0.1", 0))
    address = stalled.getsockname()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(stalled.accept()[0]), daemon=True).start()
    sender = PeerSender(src, node=0, peer=address, timeout_s=1.0)
    assert sender.send_once() == [] and sender.sent == {}
    assert restore_from_peer(address, 0, [0], tmp_path / "new", timeout_s=1.0) is None
    stalled.close()
    for s in accepted:
        s.close()
    # Gone altogether: refused at once.
    assert sender.send_once() == []
    assert restore_from_peer(address, 0, [0], tmp_path / "new", timeout_s=1.0) is None


def test_a_restore_cut_short_leaves_nothing_a_restart_would_read(tmp_path, store, monkeypatch):
    src = tmp_path / "shm"
    snapshot(NodeReplica(src, 0), 4)
    PeerSender(src, node=0, peer=store.address).send_once()
    dest = tmp_path / "new"
    snapshot(NodeReplica(dest, 0), 1)         # an old replica in the way: discarded, not mixed with the copy

    def cut(sock, f, size):
        f.write(sock.recv(16))
        raise ConnectionError("peer gone")

    monkeypatch.setattr(peer, "_receive", cut)
    assert restore_from_peer(store.address, 0, [0], dest) is None
    assert restored_step(dest, 0) is None


def test_the_node_daemon_follows_the_snapshots(tmp_path, store):
    """Without wake-ups the daemon still ships every snapshot, at its next look."""
    import json

    from trainer.layout import peer_file

    src = tmp_path / "shm"
    replica = NodeReplica(src, 0)
    snapshot(replica, 1)
    peer_file(src).write_text(json.dumps({"node": 0, "holder": list(store.address)}))
    proc, _ = peer.start_daemon(src, "127.0.0.1", poll_s=0.05)
    try:
        for step in range(1, 4):
            if step > 1:
                snapshot(replica, step)
            # 30 s: the first look waits for the niced daemon to start on a loaded machine.
            assert until(lambda: step in peer_steps(store.address, 0).get(0, []), 30), peer_steps(store.address, 0)
    finally:
        proc.kill()
        proc.wait()
    assert peer_steps(store.address, 0) == {0: [3, 2]}


def test_the_peer_daemon_reads_markers_without_torch(tmp_path):
    """A node's peer daemon never imports torch (seconds of CPU taken from the ranks at every node start)."""
    import subprocess
    import sys

    snapshot(NodeReplica(tmp_path, 0), 9)
    code = ("import sys; sys.modules['torch'] = None\n"      # any import of torch fails
            "from pathlib import Path; from trainer import peer, layout\n"
            f"print(peer._read_marker(layout.replica_marker(Path({str(tmp_path)!r}), 0))[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "{'step': 9, 'slot': 0, 'run': 'r1'}", out.stderr


def test_only_copies_of_the_asked_run_are_offered(tmp_path, store):
    """A copy made by another run (or at another world size: the tag carries it) is never restored."""
    src = tmp_path / "shm"
    snapshot(NodeReplica(src, 0), 3)                         # tagged r1
    PeerSender(src, node=0, peer=store.address).send_once()
    assert peer_steps(store.address, 0, run="r1") == {0: [3]} and peer_steps(store.address, 0, run="r2") == {0: []}
    assert restore_from_peer(store.address, 0, [0], tmp_path / "new", run="r2") is None
    assert restore_from_peer(store.address, 0, [0], tmp_path / "new", run="r1") == 3


def test_the_previous_snapshot_stays_readable_until_its_slot_is_overwritten(tmp_path):
    """A restore may need the snapshot before the newest (the step a lagging peer copy has). Once it has read the
    previous marker, the replica knows which slot it names from its own marks, without reading it again."""
    replica = NodeReplica(tmp_path, 0)
    snapshot(replica, 1)
    assert replica.marked(previous=True) is None
    snapshot(replica, 2)
    step, _, state = replica.load(_state(0), previous=True)
    assert step == 1 and torch.equal(state["model"]["w"], torch.full((64, 64), 1.0))
    replica.overwriting(1 - replica.marked()["slot"])         # a copy into its slot begins: it is gone first
    assert replica.marked(previous=True) is None and replica.marked()["step"] == 2
    snapshot(replica, 3)
    assert replica.marked(previous=True)["step"] == 2
    replica.overwriting(1 - replica.marked()["slot"])
    assert replica.marked(previous=True) is None and replica.marked()["step"] == 3


def test_the_node_daemon_follows_what_its_ranks_name(tmp_path):
    """``start_daemon``: a child process whose store listens on the address it returns at once, and whose
    sender ships nothing until the ranks wrote the node's index and its holder (``peer.json``), then to it."""
    import json

    from trainer.layout import peer_file

    holder_dir, src = tmp_path / "holder", tmp_path / "shm"
    snapshot(NodeReplica(src, 1), 4)
    proc, address = peer.start_daemon(holder_dir, "127.0.0.1")
    sender_proc, _ = peer.start_daemon(src, "127.0.0.1")
    try:
        holder = peer.parse_address(address)
        assert peer_steps(holder, 1) == {}
        peer_file(src).write_text(json.dumps({"node": 1, "holder": list(holder)}))
        assert until(lambda: peer_steps(holder, 1) == {1: [4]}, 30)
        assert restore_from_peer(holder, 1, [1], tmp_path / "new") == 4 and restored_step(tmp_path / "new", 1) == 4
    finally:
        for p in (proc, sender_proc):
            p.kill()
            p.wait()
    # Gone: refused at once, no copies offered (the restore falls back to the checkpoint).
    assert restore_from_peer(holder, 1, [1], tmp_path / "other", timeout_s=1.0) is None


def test_a_rank_that_marks_a_snapshot_wakes_its_node_daemon_which_ships_it_at_once(tmp_path):
    """The daemon ships a snapshot when a rank wakes it (``peer.wake``), not at its next look (here ten
    minutes away): the holder's copy lags by the transfer only."""
    import json

    from trainer.layout import peer_file

    holder_dir, src = tmp_path / "holder", tmp_path / "shm"
    replica = NodeReplica(src, 0)
    snapshot(replica, 1)
    proc, address = peer.start_daemon(holder_dir, "127.0.0.1")
    holder = peer.parse_address(address)
    peer_file(src).write_text(json.dumps({"node": 0, "holder": list(holder)}))
    sender_proc, _ = peer.start_daemon(src, "127.0.0.1", poll_s=600)
    try:
        assert until(lambda: peer_steps(holder, 0) == {0: [1]}, 30)      # its first look, at its start
        for step in (2, 3):
            snapshot(replica, step)
            peer.wake(src)
            assert until(lambda: step in peer_steps(holder, 0)[0], 30), peer_steps(holder, 0)
    finally:
        for p in (proc, sender_proc):
            p.kill()
            p.wait()
    peer.wake(src)             # no daemon: nothing happens, nothing blocks
