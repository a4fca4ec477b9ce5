"""Corrupted copies of the training state are never used, and peers that are not the job's are never heard.

Bytes are flipped between a save and the restore in a checkpoint's shard, a memory snapshot (newest or the
one before), the staging copy an in-process restart resumes from, or a peer's copy; the restore detects it
(a ``checksum_mismatch`` event), takes the next source, and restores the exact state of that source's step.
Peer messages that are forged, replayed or another job's are refused and counted, by a store in this
process and by a real peer daemon process; so is a marker that is not plain JSON (never unpickled).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch

from tests.conftest import until
from tests.s3_stand_in import CREDENTIALS, MotoS3
from trainer import peer
from trainer.checkpoint import CheckpointManager, step_dir
from trainer.checkpoint.integrity import ChecksumMismatch, state_digests, verify_files
from trainer.checkpoint.replica import NodeReplica
from trainer.config import CheckpointConfig
from trainer.events import Event, EventLog, read_events
from trainer.fault_spec import CORRUPT_KINDS, corruption_fault
from trainer.faults import corruption_outcome
from trainer.layout import replica_dir, replica_marker, replica_previous, replica_slot
from trainer.peer import Auth, PeerRefused, PeerSender, PeerStore, peer_steps, restore_from_peer


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "optim": {"step": torch.tensor(float(seed)), "m": torch.randn(64, 64, generator=g)},
            "train": {"step": seed, "betas": (0.9, 0.95)}}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)},
            "optim": {"step": torch.tensor(0.0), "m": torch.zeros(64, 64)}, "train": {"step": -1, "betas": (0, 0)}}


def _equal(a: dict, b: dict) -> bool:
    return (all(torch.equal(a[k][n], b[k][n]) for k in ("model", "optim") for n in a[k])
            and a["train"] == b["train"])


W_BYTES = 64 * 64 * 4   # model.w: the first tensor of a replica slot


def _flip(path, rng: random.Random, within: tuple[int, int] | None = None) -> None:
    """Flip one byte of ``path`` at a random offset (``within``: [start, end) of the file)."""
    data = bytearray(path.read_bytes())
    i = rng.randrange(*(within or (0, len(data))))
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_tensor(path, tensor: torch.Tensor, rng: random.Random) -> None:
    """Flip a byte of ``tensor``'s data where a shard file holds it (bytes a load reads, not padding)."""
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    start = path.read_bytes().index(raw[:64])
    _flip(path, rng, (start, start + len(raw)))


def _mismatches(tmp_path) -> list[dict]:
    return [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checksum_mismatch"]


def _manager(tmp_path, process_group, **cfg) -> CheckpointManager:
    cfg = CheckpointConfig(memory_dir=str(tmp_path / "shm"), **cfg)
    return CheckpointManager(tmp_path / "ckpt", cfg, process_group, EventLog(tmp_path / "events.jsonl", 0),
                             run_id="run-1")


def _restore_fresh(tmp_path, cfg, process_group):
    """A restore by a new manager of the run (a restarted job): (step, source, restored state)."""
    mgr = CheckpointManager(tmp_path / "ckpt", cfg, process_group, EventLog(tmp_path / "events.jsonl", 0))
    try:
        return mgr.restore(_zeros())
    finally:
        mgr.close()


def _committed_step_2(tmp_path, process_group) -> None:
    """A run directory whose one checkpoint, step 2, is committed."""
    mgr = _manager(tmp_path, process_group)
    try:
        _save(mgr, 2)
        mgr.wait()
    finally:
        mgr.close()


def _save(mgr: CheckpointManager, step: int) -> None:
    """An interval checkpoint as the loop takes it; the live state then changes (the optimizer step)."""
    live = _state(step)
    mgr.save(step, live)
    mgr.finish_snapshot()
    live["model"]["w"].add_(1.0)
    mgr.maybe_finalize()


def _memory(mgr: CheckpointManager, step: int) -> None:
    mgr.snapshot_to_memory(step, _state(step))
    mgr.finish_snapshot()
    mgr.wait_for_mark()   # marked on the node: what a restarted rank finds


# The corruption chaos: each seed flips a random byte of a random copy; the restore must take the next source.
TARGETS = ("newest checkpoint", "newest memory snapshot", "previous memory snapshot", "staging copy")


@pytest.mark.parametrize("seed", range(20))
def test_a_corrupted_copy_is_detected_and_the_next_source_restores_the_exact_state(tmp_path, process_group, seed):
    rng = random.Random(seed)
    target = TARGETS[seed % len(TARGETS)] if seed < len(TARGETS) else rng.choice(TARGETS)
    # Synchronous saves where the staging copy is not the target: the same checksums and restore, no writer
    # process to boot per seed.
    mgr = _manager(tmp_path, process_group, keep=3, sync=target != "staging copy")
    try:
        for step in (2, 4):
            _save(mgr, step)
        mgr.wait()
        if target == "staging copy":
            # An in-process restart resumes from the staging copy of the last save, unless it changed since.
            _save(mgr, 6)
            mgr.wait()
            mgr.snapshot["model"]["w"].view(-1)[rng.randrange(64 * 64)] += 1.0
            expected = (6, "checkpoint")       # its write had completed: the committed step 6 is the next source
            step, source, restored = mgr.restore(_zeros())
        else:
            if target != "newest checkpoint":
                _memory(mgr, 5)
                _memory(mgr, 6)
            mgr.close()
            shm = replica_dir(tmp_path / "shm", tmp_path / "ckpt")
            if target == "newest checkpoint":
                shard = sorted(step_dir(tmp_path / "ckpt", 4).glob("*.distcp"))[0]
                part, name = rng.choice([("model", "w"), ("model", "b"), ("optim", "m")])
                _flip_tensor(shard, _state(4)[part][name], rng)
                expected = (2, "checkpoint")
            elif target == "newest memory snapshot":
                slot = json.loads(replica_marker(shm, 0).read_text())["slot"]
                _flip(replica_slot(shm, 0, slot), rng, (0, W_BYTES))
                expected = (5, "memory")   # the one before it is whole, and newer than the checkpoint
            else:
                _flip(replica_slot(shm, 0, json.loads(replica_previous(shm, 0).read_text())["slot"]), rng,
                      (0, W_BYTES))
                expected = (6, "memory")   # the newest is whole: it is what the restore takes
            mgr = _manager(tmp_path, process_group)
            step, source, restored = mgr.restore(_zeros())
    finally:
        mgr.close()
    assert (step, source) == expected
    assert _equal(restored, _state(step)), "a restore used bytes other than the step's"
    where = {"newest checkpoint": "checkpoint", "staging copy": "staging"}.get(target, "memory")
    assert [e["source"] for e in _mismatches(tmp_path)] == [where]


def test_the_memory_snapshot_an_in_process_restart_reads_where_it_lies_is_verified(tmp_path, process_group):
    """An in-process restart reads its replica through the mapping it copied into (no file read): bytes flipped
    under that mapping are refused there too, and the snapshot before it restored."""
    mgr = _manager(tmp_path, process_group, sync=True, keep=3)
    try:
        _save(mgr, 2)
        mgr.wait()
        _memory(mgr, 5)
        _memory(mgr, 6)
        shm = replica_dir(tmp_path / "shm", tmp_path / "ckpt")
        _flip(replica_slot(shm, 0, json.loads(replica_marker(shm, 0).read_text())["slot"]), random.Random(7),
              (0, W_BYTES))
        step, source, restored = mgr.restore(_zeros())
    finally:
        mgr.close()
    assert (step, source) == (5, "memory") and _equal(restored, _state(5))
    assert [(e["source"], e["step"]) for e in _mismatches(tmp_path)] == [("memory", 6)]


def test_a_checkpoint_with_a_shard_corrupted_everywhere_is_refused_not_started_over(tmp_path, process_group):
    """Nothing unverified loads: with every committed checkpoint corrupt the restore fails, naming them, rather
    than training from scratch over them."""
    _committed_step_2(tmp_path, process_group)
    _flip_tensor(sorted(step_dir(tmp_path / "ckpt", 2).glob("*.distcp"))[0], _state(2)["model"]["b"],
                 random.Random(0))
    mgr = _manager(tmp_path, process_group)
    try:
        with pytest.raises(RuntimeError, match=r"steps \[2\] failed their checksums"):
            mgr.restore(_zeros())
    finally:
        mgr.close()


def test_a_checkpoint_without_checksums_is_not_verified_so_not_used(tmp_path, process_group):
    _committed_step_2(tmp_path, process_group)
    marker = step_dir(tmp_path / "ckpt", 2) / "COMMITTED"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "checksums"}))
    with pytest.raises(ChecksumMismatch, match="records no xxh3_64 checksums"):
        verify_files(step_dir(tmp_path / "ckpt", 2))


@pytest.mark.parametrize("sync", [False, True])
def test_every_item_of_a_committed_checkpoint_is_verified_from_its_files(tmp_path, process_group, sync):
    """Async and synchronous saves both record a checksum of every item (tensors and values) as staged."""
    mgr = _manager(tmp_path, process_group, sync=sync)
    try:
        _save(mgr, 2)
        mgr.wait()
    finally:
        mgr.close()
    path = step_dir(tmp_path / "ckpt", 2)
    verify_files(path)
    sums = json.loads((path / "COMMITTED").read_text())["checksums"]
    assert {"model.w@0,0", "optim.step@", "train.step", "train.betas"} <= set(sums)


@pytest.fixture
def s3(monkeypatch):
    """moto on loopback, its credentials in the environment."""
    for k, v in {**CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    with MotoS3() as server:
        yield server


# ---- peer copies ----------------------------------------------------------------------------------------

@pytest.fixture
def job(monkeypatch):
    monkeypatch.setenv(peer.SECRET_ENV, "cd" * 32)
    monkeypatch.setenv(peer.JOB_ENV, "job-1")
    return Auth.from_env()


def _snapshot(replica: NodeReplica, step: int) -> None:
    slot = 1 - replica.marked()["slot"] if replica.marked() else 0
    buf = replica.buffer(_state(step), slot)
    for k in ("model", "optim"):
        for n, t in _state(step)[k].items():
            buf[k][n].copy_(t)
    replica.mark(step, slot, buf, run="r1", checksums=state_digests(buf))


def test_a_peer_copy_corrupted_at_its_source_or_its_holder_is_never_restored(tmp_path, job):
    src, store = tmp_path / "node0", PeerStore(tmp_path / "holder").start()
    try:
        replica = NodeReplica(src, 0)
        _snapshot(replica, 3)
        assert PeerSender(src, 0, store.address).send_once() == [(0, 3)]
        _snapshot(replica, 4)
        # Flipped in node memory after the copy was marked: the transfer is whole, the bytes are not the staged.
        _flip(replica_slot(src, 0, replica.marked()["slot"]), random.Random(1), (0, W_BYTES))
        assert PeerSender(src, 0, store.address).send_once() == [(0, 4)]
        assert restore_from_peer(store.address, 0, [0], tmp_path / "new", among={4}) == 4
        with pytest.raises(ChecksumMismatch, match="differ from the bytes staged"):
            NodeReplica(tmp_path / "new", 0).load(_zeros())
        # Flipped at the holder: the fetch itself fails its transfer checksum (the restore records it), nothing is
        # written.
        index = json.loads((tmp_path / "holder" / "node0" / "rank0.index").read_text())
        slot = next(int(s) for s, e in index.items() if e["step"] == 3)
        _flip(tmp_path / "holder" / "node0" / f"rank0.slot{slot}", random.Random(2), (0, W_BYTES))
        with pytest.raises(ChecksumMismatch, match="not the copy it was sent"):
            restore_from_peer(store.address, 0, [0], tmp_path / "again", among={3})
        assert NodeReplica(tmp_path / "again", 0).load(_zeros()) is None
    finally:
        store.close()


def _steps_request(auth: Auth) -> dict:
    return auth.seal({"op": "steps", "node": 0})


def _send(address, message: dict) -> dict | None:
    """Send one message; the reply, or None when the store hung up without one (refused)."""
    with socket.create_connection(address, timeout=10) as sock:
        peer._send_json(sock, message)
        try:
            return peer._recv_json(sock)
        except (ConnectionError, OSError):
            return None


def test_forged_replayed_and_other_jobs_peer_messages_are_refused_and_counted(tmp_path, job):
    events = EventLog(tmp_path / "events.jsonl", -1)
    store = PeerStore(tmp_path / "holder", events=events).start()
    try:
        genuine = _steps_request(job)
        assert job.open(_send(store.address, genuine), reply_to=genuine["nonce"])["ranks"] == {}
        assert _send(store.address, genuine) is None                                     # replayed
        assert _send(store.address, _steps_request(Auth(b"\x01" * 32, "job-1"))) is None    # forged: other secret
        assert _send(store.address, _steps_request(Auth(job.secret, "job-2"))) is None      # another job's
        assert _send(store.address, {**_steps_request(job), "node": 1}) is None            # altered in transit
        assert _send(store.address, {"op": "steps", "node": 0}) is None                    # unauthenticated
        assert until(lambda: store.refused == 5, 10)
    finally:
        store.close()
    refused = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "peer_refused"]
    assert len(refused) == 5 and all(e["role"] == "store" for e in refused)


def test_a_reply_that_is_not_the_holders_is_refused(tmp_path, job):
    """A rank asking a holder that is not the job's (or a replayed reply) refuses the answer."""
    fake = socket.create_server(("127.0.0.1", 0))

    def answer(auth: Auth, reply_to) -> None:
        conn, _ = fake.accept()
        with conn:
            request = peer._recv_json(conn)
            peer._send_json(conn, auth.seal({"ranks": {"0": [9]}}, reply_to=reply_to(request)))

    import threading
    for auth, reply_to in ((Auth(b"\x02" * 32, "job-1"), lambda r: r["nonce"]),    # another secret
                           (job, lambda r: "an-older-nonce")):                      # a replayed reply
        t = threading.Thread(target=answer, args=(auth, reply_to))
        t.start()
        with pytest.raises(PeerRefused):
            peer_steps(fake.getsockname(), 0, timeout_s=10)
        t.join()
    fake.close()


def test_a_marker_that_is_not_plain_json_is_never_unpickled(tmp_path, job):
    """A pickled marker (one that would run code when unpickled) is no marker: not read, not shipped, not kept."""
    witness = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    src = tmp_path / "node0"
    replica = NodeReplica(src, 0)
    _snapshot(replica, 3)
    replica_marker(src, 0).write_bytes(pickle.dumps({"step": 4, "slot": 0, "run": "r1", "x": Evil()}))
    assert replica.marked() is None and NodeReplica(src, 0).load(_zeros()) is None
    store = PeerStore(tmp_path / "holder").start()
    try:
        assert PeerSender(src, 0, store.address).send_once() == []
        # Sent by hand, authenticated: the holder refuses to keep it.
        raw, data = replica_marker(src, 0).read_bytes(), replica_slot(src, 0, 0).read_bytes()
        with socket.create_connection(store.address, timeout=10) as sock:
            request = job.seal({"op": "put", "node": 0, "rank": 0, "step": 4, "size": len(data),
                                "marker_len": len(raw)})
            peer._send_json(sock, request)
            sock.sendall(raw)
            with pytest.raises((ConnectionError, OSError)):
                peer._recv_json(sock)
        assert peer_steps(store.address, 0) == {}
    finally:
        store.close()
    assert not witness.exists()


def test_a_real_peer_daemon_refuses_a_forged_message_and_records_it(tmp_path, job):
    events = tmp_path / "events.jsonl"
    proc, address = peer.start_daemon(tmp_path / "node1", "127.0.0.1", events=events)
    try:
        host, port = peer.parse_address(address)
        assert _send((host, port), _steps_request(Auth(b"\x03" * 32, "job-1"))) is None
        genuine = _steps_request(job)
        assert job.open(_send((host, port), genuine), reply_to=genuine["nonce"])["ranks"] == {}
        assert until(lambda: any(e["event"] == "peer_refused" for e in read_events(events)), 30)
    finally:
        proc.kill()
        proc.wait()


def test_a_peer_daemon_without_the_jobs_secret_does_not_start(tmp_path, monkeypatch):
    monkeypatch.delenv(peer.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="GOODPUT_PEER_SECRET"):
        peer.start_daemon(tmp_path / "node1", "127.0.0.1")
    out = subprocess.run([sys.executable, "-m", "trainer.peer", "--listen-fd", "0", "--replica-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith("python -m trainer.peer: GOODPUT")


def test_a_multi_node_peer_run_without_a_secret_stops_before_anything_starts(tmp_path, monkeypatch, capfd):
    from trainer.warmstart import NodePlace, run_with_zygote

    monkeypatch.delenv(peer.SECRET_ENV, raising=False)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500",
               "-m", "trainer", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "data")]
    assert run_with_zygote(command, node=NodePlace("2", "10.0.0.1:29500")) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warm start: GOODPUT_PEER_SECRET must hold")
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_corrupted_in_the_s3_mirror_is_refused_after_its_download(tmp_path, process_group, s3):
    """FSx lost, the mirror's copy of the newest checkpoint corrupted: fetched through the same restore path, it
    fails its checksums and is not loaded (the run stops naming it rather than starting over)."""
    from dataclasses import replace

    from trainer.mirror import CheckpointMirror

    s3.client().create_bucket(Bucket="ckpt")
    cfg = replace(CheckpointConfig(memory_dir=str(tmp_path / "shm"), sync=True), mirror="s3://ckpt/runs/a",
                  mirror_endpoint_url=s3.url)
    mgr = _manager(tmp_path, process_group, sync=True)
    try:
        _save(mgr, 2)
    finally:
        mgr.close()
    mirror = CheckpointMirror(tmp_path / "ckpt", cfg, EventLog(tmp_path / "events.jsonl", 0))
    mirror.enqueue(2, json.loads((step_dir(tmp_path / "ckpt", 2) / "COMMITTED").read_text())["committed_at"])
    mirror.drain(120)
    mirror.close(0)
    key = f"runs/a/checkpoints/{step_dir(tmp_path / 'ckpt', 2).name}/__0_0.distcp"
    data = bytearray(s3.client().get_object(Bucket="ckpt", Key=key)["Body"].read())
    start = bytes(data).index(_state(2)["model"]["w"].view(torch.uint8).numpy().tobytes()[:64])
    data[start + random.Random(3).randrange(W_BYTES)] ^= 0xFF
    s3.client().put_object(Bucket="ckpt", Key=key, Body=bytes(data))
    shutil.rmtree(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=r"steps \[2\] failed their checksums"):
        _restore_fresh(tmp_path, cfg, process_group)
    # S3's own checksum of the object, checked by the download, refuses it before the restore reads it.
    events = read_events(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "resumed_from_mirror"]
    assert [(e["step"], e["phase"]) for e in events if e["event"] == "mirror_error"] == [(2, "download")]


def _mirror_cfg(tmp_path, s3) -> CheckpointConfig:
    from dataclasses import replace

    s3.client().create_bucket(Bucket="ckpt")
    # A prefix of its own: moto's buckets outlive the server of one test.
    return replace(CheckpointConfig(memory_dir=str(tmp_path / "shm"), sync=True),
                   mirror=f"s3://ckpt/runs/{tmp_path.name}", mirror_endpoint_url=s3.url)


def _mirror(tmp_path, cfg: CheckpointConfig, *steps: int) -> None:
    from trainer.mirror import CheckpointMirror

    mirror = CheckpointMirror(tmp_path / "ckpt", cfg, EventLog(tmp_path / "events.jsonl", 0))
    for step in steps:
        mirror.enqueue(step, json.loads((step_dir(tmp_path / "ckpt", step) / "COMMITTED").read_text())["committed_at"])
    assert mirror.drain(120)
    mirror.close(0)


def test_a_mirrored_step_corrupted_before_its_upload_is_refused_and_the_next_older_one_restored(
        tmp_path, process_group, s3):
    """Bytes wrong before the upload (here: flipped on FSx after the commit) pass S3's checksums; the checksums
    taken at staging refuse the newest mirrored step after its download, and the next older one, verified, is
    restored."""
    cfg = _mirror_cfg(tmp_path, s3)
    mgr = _manager(tmp_path, process_group, sync=True, keep=3)
    try:
        for step in (2, 4):
            _save(mgr, step)
    finally:
        mgr.close()
    _flip_tensor(sorted(step_dir(tmp_path / "ckpt", 4).glob("*.distcp"))[0], _state(4)["model"]["w"],
                 random.Random(4))
    _mirror(tmp_path, cfg, 2, 4)
    shutil.rmtree(tmp_path / "ckpt")        # FSx lost
    step, source, restored = _restore_fresh(tmp_path, cfg, process_group)
    assert (step, source) == (2, "checkpoint") and _equal(restored, _state(2))
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["source"], e["step"]) for e in _mismatches(tmp_path)] == [("mirror", 4)]
    assert [e["step"] for e in events if e["event"] == "resumed_from_mirror"] == [2]
    assert not step_dir(tmp_path / "ckpt", 4).exists()     # never published where a restore would take it


def test_a_corrupt_fsx_copy_of_the_only_checkpoint_is_replaced_by_the_mirrors_verified_copy(
        tmp_path, process_group, s3):
    cfg = _mirror_cfg(tmp_path, s3)
    _committed_step_2(tmp_path, process_group)
    _mirror(tmp_path, cfg, 2)
    _flip_tensor(sorted(step_dir(tmp_path / "ckpt", 2).glob("*.distcp"))[0], _state(2)["optim"]["m"],
                 random.Random(5))
    step, source, restored = _restore_fresh(tmp_path, cfg, process_group)
    assert (step, source) == (2, "checkpoint") and _equal(restored, _state(2))
    assert [(e["source"], e["step"]) for e in _mismatches(tmp_path)] == [("checkpoint", 2)]
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "resumed_from_mirror"] == [2]


@pytest.mark.parametrize("sync", [False, True])
def test_a_checkpoint_owed_to_a_busy_writer_is_not_written_from_a_copy_that_changed(tmp_path, process_group, sync):
    """The copy a checkpoint owed to a busy writer is written from must still be the one taken at its step:
    had anything copied into its slot since, the checkpoint would hold another step's state under this one's
    name, with checksums that match (they are taken of the staging copy). Checked beside the staging copy, and
    agreed by every rank before the write is handed to the writer."""
    mgr = _manager(tmp_path, process_group, sync=sync)
    try:
        whole = mgr.snapshot_to_memory(4, _state(4), keep=True)
        mgr.finish_snapshot()
        mgr.save_owed(4, whole)
        mgr.finish_snapshot()
        mgr.wait()
        verify_files(step_dir(tmp_path / "ckpt", 4))
        mgr.release(whole)
        changed = mgr.snapshot_to_memory(6, _state(6), keep=True)
        mgr.finish_snapshot()
        mgr.wait_for_mark()                    # a later copy waits for it
        changed["model"]["w"].add_(1.0)        # what a copy of a later step into its slot would do
        mgr.save_owed(6, changed)
        mgr.finish_snapshot()
        mgr.wait()
        assert not list(step_dir(tmp_path / "ckpt", 6).glob("*")), "nothing of step 6 is written"
    finally:
        mgr.close()
    assert [(e["source"], e["step"]) for e in _mismatches(tmp_path)] == [("owed copy", 6)]


@pytest.mark.parametrize("then", ["restore", "close"])
def test_after_a_fault_an_owed_checkpoints_copy_completes_and_its_write_is_dropped(
        tmp_path, process_group, monkeypatch, then):
    """A fault while an owed checkpoint's copy runs leaves that save unfinished on some ranks only, so the
    agreement its write needs (a collective) cannot be made after it: in the restore of an in-process restart
    the other ranks are in the restore's own collectives, and in the teardown after an in-job failure the
    process group is gone (torch's ValueError, which the trainer takes for a settings error: the run stopped
    instead of restarting). The copy completes and the write is dropped: nothing of the owed step is written."""
    mgr = _manager(tmp_path, process_group)
    try:
        whole = mgr.snapshot_to_memory(4, _state(4), keep=True)
        mgr.finish_snapshot()
        mgr.save_owed(4, whole)        # the fault comes before the step's finish_snapshot

        def gone(*args, **kwargs):
            raise ValueError("Default process group has not been initialized")

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "all_reduce", gone)
            if then == "restore":
                mgr.restore(_state(0))
            else:
                mgr.close()
        assert mgr.copying is None and not list(step_dir(tmp_path / "ckpt", 4).glob("*"))
    finally:
        mgr.close()


def test_a_save_planned_after_the_process_group_was_aborted_is_dropped_at_close(tmp_path, process_group):
    """The in-job layer's teardown after a fault: the process group is aborted while a save's plan waits behind
    its copy on the copy thread. The plan then fails (torch's ValueError, which the trainer takes for a settings
    error: the run stopped instead of restarting), so the save is dropped and close goes on; the checkpoint
    committed before stays."""
    mgr = _manager(tmp_path, process_group)
    copy_thread_held = threading.Event()
    try:
        _save(mgr, 2)
        mgr.wait()                             # planned: later saves plan on the copy thread
        mgr.copier.then(copy_thread_held.wait)
        mgr.save(4, _state(4))
        torch.distributed.destroy_process_group()
        copy_thread_held.set()
        mgr.close()
        assert mgr.copying is None and not step_dir(tmp_path / "ckpt", 4).exists()
        assert (step_dir(tmp_path / "ckpt", 2) / ".metadata").exists()
    finally:
        copy_thread_held.set()
        mgr.close()
        if not torch.distributed.is_initialized():   # for the fixture's teardown
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)


def test_a_restore_allocates_both_memory_slots_and_no_copy_allocates_them_again(tmp_path, process_group, monkeypatch):
    """Allocating a slot's node memory (``posix_fallocate``) costs about 12 ms per 100 MB here, and as much again
    on tmpfs when it is allocated already: the restore does it once per slot (on a thread), and the copies, the
    first into each slot after every restart included, do not."""
    mgr = _manager(tmp_path, process_group)
    try:
        mgr.restore(_state(0))
        node = mgr.replica.node
        node.settle()                # the restore's thread: both slots allocated and mapped
        for slot in (0, 1):
            assert os.stat(replica_slot(node.dir, 0, slot)).st_blocks * 512 >= node.slot_size(_state(0))
        allocations = []
        monkeypatch.setattr(os, "posix_fallocate", lambda *a: allocations.append(a))
        for step in (1, 2, 3):
            mgr.snapshot_to_memory(step, _state(step))
            mgr.finish_snapshot()
        mgr.restore(_state(0))       # an in-process restart: the slots are mapped afresh
        mgr.snapshot_to_memory(4, _state(4))
        mgr.finish_snapshot()
        assert allocations == []
    finally:
        mgr.close()


def test_refused_copies_and_peer_messages_are_counted_in_the_run_metrics(tmp_path):
    from trainer.metrics import RunCollector

    events = EventLog(tmp_path / "events.jsonl", 0)
    events.emit(Event.RUN_START, world_size=1, restart_count=0, run_id="r", agent_attempts={}, agent_restart_counts={})
    events.emit(Event.STEP, step=1, loss=1.0, step_s=0.1, lr=1e-3, tokens=64, tokens_per_s=640.0)
    for source in ("checkpoint", "memory"):
        events.emit(Event.CHECKSUM_MISMATCH, source=source, step=1, rank=0, reason="x")
    events.emit(Event.PEER_REFUSED, role="store", peer="10.0.0.9", reason="forged")
    values = RunCollector(tmp_path / "events.jsonl", refresh_s=0).values()
    assert values["goodput_integrity_refusals"] == {"checksum_mismatch": 2, "peer_refused": 1}


# ---- the corruption chaos in real trainings ---------------------------------------------------------------
# 2 ranks under ft_launcher, the recovery tests' 14 steps with a checkpoint every 2 and a memory snapshot at every
# step between them (0.3 s apart would leave none on a quiet machine); one byte of a copy flipped, then the rank
# killed (--inject-fault corrupt-*). Synchronous checkpoints: committed at their step, not whenever a writer that
# boots after every start gets to it, so the fault finds two to choose from at its step.
# bench/corruption_chaos.py runs the same over many seeds.
CHAOS_RUN = ("--max-steps", "14", "--ckpt-every", "2", "--ckpt-sync", "--memory-snapshot-every-s", "0.01")


@pytest.mark.parametrize("spec,message", [
    ("corrupt-ckpt@5:1", "corrupt-ckpt fires on rank 0, which commits"),
    ("corrupt-mirror@5", "corrupt-mirror@5 needs --ckpt-mirror"),
    ("corrupt-peer@5:1 --no-peer-snapshots", "corrupt-peer@5:1 needs peer snapshots"),
    ("kill@5:1/3", "only the corrupt-\\* kinds take a /SEED"),
])
def test_a_corruption_fault_that_cannot_do_what_it_says_is_refused_before_the_run(spec, message):
    from trainer.config import parse_config

    with pytest.raises(ValueError, match=message):
        parse_config(["--data", "d", "--inject-fault", *spec.split()])
    assert parse_config(["--data", "d", "--inject-fault", "corrupt-snapshot@5:1/7"]).faults.inject_fault


# corrupt-peer needs two nodes: its own test below.
ONE_NODE_KINDS = tuple(k for k in CORRUPT_KINDS if k != "corrupt-peer")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(len(ONE_NODE_KINDS)))
def test_a_training_run_refuses_a_corrupted_copy_and_ends_with_the_fault_free_weights(
        tmp_path, start_run, clean_sha, s3, seed):
    spec = corruption_fault(seed, world_size=2, kinds=ONE_NODE_KINDS)
    kind = spec.split("@")[0]
    s3.client().create_bucket(Bucket="ckpt")
    mirror = ("--ckpt-mirror", f"s3://ckpt/{tmp_path.name}", "--ckpt-mirror-endpoint-url", s3.url)
    run = start_run(tmp_path / "run", *CHAOS_RUN, *(mirror if kind == "corrupt-mirror" else ()),
                    "--inject-fault", spec, max_restarts=2)
    assert run.wait() == 0, run.tail()
    outcome = corruption_outcome(run.events())
    assert outcome["kind"] == kind and outcome["detected"] and outcome["fell_back"], outcome
    summary = run.summary()
    assert summary["steps"] == 14 and summary["params_sha256"] == clean_sha("fsdp")


def test_a_peer_copy_corruption_outside_a_local_cluster_is_refused_when_the_rank_starts(tmp_path, monkeypatch):
    """On a real cluster the holder's copy is on another machine: the fault could never fire, so it is refused."""
    from trainer.faults import FaultInjector
    from trainer.signals import NODE_ENV

    monkeypatch.delenv(NODE_ENV, raising=False)
    events = tmp_path / "events.jsonl"
    with pytest.raises(ValueError, match="corrupt-peer@4:1/3: .* LocalCluster only"):
        FaultInjector(["corrupt-peer@4:1/3"], 1, 2, EventLog(events, 1), events)


# A peer copy is restored only when it is newer than the newest checkpoint, and memory snapshots stay 20x their copy
# time apart, counted from the last save (under load a first copy took 40 ms: none fit between checkpoints 2 steps
# apart). Checkpoints 6 steps apart leave room for them.
PEER_CHAOS_RUN = ("--max-steps", "14", "--ckpt-every", "6", "--ckpt-sync", "--memory-snapshot-every-s", "0.01")


@pytest.mark.timeout(600)
def test_a_lost_nodes_copy_corrupted_at_its_holder_is_refused_and_the_run_ends_with_the_fault_free_weights(
        cluster, clean_sha, monkeypatch):
    """2 nodes x 1 rank: the copy of rank 1's newest memory snapshot that node 0 keeps is flipped, then node 1's
    memory is lost and its rank killed. The restart's rank 1 fetches its state from node 0, refuses the copy, and
    both ranks resume from the checkpoint committed before it."""
    from trainer.metrics import RunCollector

    from tests.multinode import events, logs, summary

    # One thread per rank, as the fault-free run on one node has (its launcher sets it for 2 ranks): the same
    # weights bit for bit.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    c = cluster(*PEER_CHAOS_RUN, "--inject-fault", "corrupt-peer@4:1/3")
    assert c.supervise(timeout=300) == 0, logs(c)
    ev = events(c)
    outcome = corruption_outcome(ev)
    assert outcome["detected"] and outcome["fell_back"] and outcome["resumed"][0] == "checkpoint", outcome
    # The holder's copy was what the restore chose, and it was rank 1's fetch that refused it.
    [refusal] = [e for e in ev if e["event"] == "checksum_mismatch"]
    assert (refusal["source"], refusal["step"], refusal["rank"]) == ("peer", outcome["step"], 1), refusal
    values = RunCollector(c.out / "events.jsonl", refresh_s=0).values()
    assert values["goodput_integrity_refusals"]["checksum_mismatch"] == 1
    s = summary(c)
    assert s["steps"] == 14 and s["params_sha256"] == clean_sha("fsdp")
