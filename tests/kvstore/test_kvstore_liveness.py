"""Liveness: dead clients lose their pages in bounded time, a dead daemon fails clients fast, restarts are clean."""

from __future__ import annotations

import json
import signal
import time

import pytest

from freekv_kvstore import (
    ArenaGeometry,
    DaemonUnavailable,
    KVStoreClient,
    SessionExpired,
    codec,
    daemon_stats,
    protocol,
)
from freekv_kvstore.protocol import Opcode

from kvstore_helpers import run_worker

pytestmark = pytest.mark.timeout(90)

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=4, head_dim=16, dtype="float32")


def arena_of(endpoint: str, client_id: str) -> dict | None:
    stats = daemon_stats(endpoint, check=True)
    assert stats.accounting_ok
    return next((vars_(a) for a in stats.arenas if a.client_id == client_id), None)


def vars_(arena) -> dict:
    return {f: getattr(arena, f) for f in arena.__dataclass_fields__}


def wait_for(predicate, timeout_s: float, step_s: float = 0.05) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - t0


def test_kill_9_of_a_client_frees_its_unretained_pages_within_5_s(daemons):
    d = daemons.start("ipc")
    worker = run_worker("hold", d.endpoint, "victim", "40", "4")
    try:
        line = worker.stdout.readline()
        assert line, worker.stderr.read()
        pages = json.loads(line)["pages"]
        assert len(pages) == 40
        before = arena_of(d.endpoint, "victim")
        assert before["used_pages"] == 40 and before["attached"]
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        took = wait_for(lambda: not arena_of(d.endpoint, "victim")["attached"], 5.0)
    finally:
        worker.kill()
        worker.wait(10)
    after = arena_of(d.endpoint, "victim")
    # The 36 unretained pages are back in the pool; the 4 retained ones stay for a restarted client.
    assert (after["free_pages"], after["used_pages"], after["cached_pages"]) == (24 + 36, 0, 4)
    assert took < 5.0
    with KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=64, client_id="victim", cuda_register=False) as c:
        assert c.reattached and c.lookup(b"held-prefix") == pages[:4]


def test_a_silent_client_is_reaped_after_the_client_timeout(daemons, raw_peer):
    d = daemons.start("ipc", extra=("--client-timeout", "1.0", "--heartbeat-interval", "0.25"))
    # A HELLO without a pid (as from another host or container): only heartbeats keep it alive.
    peer = raw_peer(d.endpoint)
    hello = protocol.HelloRequest("silent", GEOM, num_pages=16)
    _, status, _, body = peer.exchange(codec.request_frames(Opcode.HELLO, 1, 0, hello))
    session = codec.decode(protocol.HelloReply, body).session
    alloc = protocol.AllocRequest([1], [5])
    _, status, _, _ = peer.exchange(codec.request_frames(Opcode.ALLOC, 2, session, alloc))
    assert status is protocol.Status.OK
    # Meanwhile a real client idles for longer than the timeout: its heartbeat thread keeps it.
    with KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=16, client_id="idle", cuda_register=False) as c:
        c.alloc(1, 3)
        took = wait_for(lambda: arena_of(d.endpoint, "silent") is None, 5.0)
        assert 0.5 < took < 2.5
        time.sleep(1.5)
        assert c.alloc(1, 1) == [3]
        assert arena_of(d.endpoint, "idle")["used_pages"] == 4
    _, status, _, body = peer.exchange(codec.request_frames(Opcode.ALLOC, 3, session, alloc))
    assert codec.decode(protocol.ErrorReply, body).code == protocol.ErrorCode.UNKNOWN_SESSION
    assert daemon_stats(d.endpoint).reaped_sessions == 1


def test_kill_9_of_the_daemon_fails_calls_by_their_deadline_and_a_restart_resumes_the_session(daemons):
    shm = str(daemons.workdir())  # private: nothing of a concurrent test run in it
    d = daemons.start("ipc", shm_dir=shm)
    c = KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=16, timeout_s=1.0, cuda_register=False)
    assert c.alloc(1, 2) == [0, 1]
    segments = d.segments()
    d.stop(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match=rf"kvstore at {d.endpoint} did not answer ALLOC within 1 s"):
        c.alloc(1, 1)
    assert time.monotonic() - t0 < 1.5
    # A daemon restarted on the endpoint re-adopts the arena and the session; the call given up on never ran.
    d2 = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm)
    assert d2.segments() == segments and "re-adopted" in d2.log()
    assert c.alloc(1, 1) == [2]
    assert arena_of(d2.endpoint, "rank0")["used_pages"] == 3
    # A daemon that stopped cleanly took its state along: the next one starts empty and knows no session.
    assert d2.stop() == 0
    d3 = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm)
    assert not d3.segments() and "re-adopted" not in d3.log()
    with pytest.raises(SessionExpired, match="daemon restarted"):
        c.alloc(1, 1)
    c.close()


def test_connecting_to_nothing_fails_fast(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="no kvstore listens"):
        KVStoreClient.connect(f"ipc://{tmp_path}/none.sock", geometry=GEOM, num_pages=4, cuda_register=False)
    with pytest.raises(DaemonUnavailable, match=r"within 0.3 s: is the daemon running\? start it with `freekv-kvstore"):
        KVStoreClient.connect("tcp://127.0.0.1:9", geometry=GEOM, num_pages=4, timeout_s=0.3, cuda_register=False)
    assert time.monotonic() - t0 < 2.0
