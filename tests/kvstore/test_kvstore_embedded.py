"""Embedded mode: a daemon subprocess that starts with a server and goes away with it, however it ends."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from freekv_kvstore import ArenaGeometry, DaemonUnavailable, KVStoreClient, start_embedded
from freekv_kvstore.config import ipc_path
from freekv_kvstore.journal import store_prefix, store_segments

from kvstore_helpers import run_worker

pytestmark = pytest.mark.timeout(60)

GEOM = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")


def _segments_of(endpoint: str) -> list[str]:
    return list(store_segments(store_prefix("/dev/shm", endpoint)).values())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_start_use_and_stop():
    with start_embedded(arena_gb=0.01) as kv:
        path = ipc_path(kv.endpoint)
        assert os.path.dirname(path).endswith("freekv") or "freekv-" in path
        with KVStoreClient.connect(kv.endpoint, geometry=GEOM, num_pages=8, cuda_register=False) as c:
            assert c.alloc(1, 8) == list(range(8))
            assert _segments_of(kv.endpoint)
    assert kv.process.returncode == 0
    assert not os.path.exists(path) and not _segments_of(kv.endpoint)
    assert kv.stop() == 0  # idempotent


def test_tcp_endpoint_gets_a_token():
    with start_embedded(arena_gb=0.01, endpoint="tcp://127.0.0.1:0") as kv:
        assert kv.token and kv.endpoint.startswith("tcp://127.0.0.1:") and not kv.endpoint.endswith(":0")
        with KVStoreClient.connect(kv.endpoint, geometry=GEOM, num_pages=4, token=kv.token, cuda_register=False) as c:
            assert c.alloc(1, 1) == [0]


def test_the_daemon_follows_its_server_when_the_server_is_killed():
    server = run_worker("embed")
    try:
        # The daemon shares the server's stdout and says where it listens first.
        info = next(json.loads(line) for line in server.stdout if line.startswith("{"))
        daemon_pid = info["pid"]
        assert not _gone(daemon_pid)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(daemon_pid):
            assert time.monotonic() < deadline, "the embedded daemon outlived its server"
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait(10)
    assert not os.path.exists(ipc_path(info["endpoint"]))


def test_a_killed_daemon_is_restarted_within_2_s_and_its_clients_go_on():
    with start_embedded(arena_gb=0.01) as kv:
        c = KVStoreClient.connect(kv.endpoint, geometry=GEOM, num_pages=16, cuda_register=False)
        hasty = KVStoreClient.connect(kv.endpoint, geometry=GEOM, num_pages=4, client_id="hasty", timeout_s=0.05,
                                      cuda_register=False)  # fmt: skip
        pages = c.alloc(1, 4)
        c.arena[pages] = 7.0
        heard = []
        kv.add_restart_listener(lambda n: 1 / 0)  # a failing listener is logged; the supervision goes on
        kv.add_restart_listener(heard.append)
        old = kv.pid
        os.kill(old, signal.SIGKILL)
        t0 = time.monotonic()
        try:  # in the restart window a call completes or fails with the clear error, by its deadline
            hasty.alloc(1, 1)
        except DaemonUnavailable as e:
            assert "did not answer ALLOC within 0.05 s" in str(e)
        assert time.monotonic() - t0 < 0.5
        assert c.alloc(1, 1) == [4]  # waits for the restarted daemon, which knows the session
        took = time.monotonic() - t0
        assert took < 2.0
        # The supervisor counts the restart once the new daemon answered its PING, which may come after the
        # client's call; listeners run just after the count.
        deadline = time.monotonic() + 2.0
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert heard == [1] and kv.restarts == 1 and kv.pid != old and kv.failure is None
        assert float(c.arena[pages].mean()) == 7.0
        c.close()
        hasty.close()
    assert kv.process.returncode == 0 and not _segments_of(kv.endpoint)


def test_the_supervisor_gives_up_on_a_restart_that_is_refused():
    with start_embedded(arena_gb=0.01) as kv:
        c = KVStoreClient.connect(kv.endpoint, geometry=GEOM, num_pages=16, cuda_register=False)
        journal = f"{store_prefix('/dev/shm', kv.endpoint)}journal"
        with open(journal, "r+b") as f:  # spoil the snapshot: the restarted daemon must refuse it
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.kill(kv.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kv.failure is None:
            assert time.monotonic() < deadline, "the supervisor neither restarted the daemon nor gave up"
            time.sleep(0.02)
        assert "its restart failed" in kv.failure and kv.restarts == 0
        c.close()
    assert not _segments_of(kv.endpoint) and not os.path.exists(journal)  # the server's private store goes with it
