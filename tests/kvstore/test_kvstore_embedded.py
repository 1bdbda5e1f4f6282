"""Embedded mode: a daemon subprocess that starts with a server and goes away with it, however it ends."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from freekv_kvstore import ArenaGeometry, KVStoreClient, start_embedded
from freekv_kvstore.config import ipc_path

from kvstore_helpers import run_worker

pytestmark = pytest.mark.timeout(60)

GEOM = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"freekv.{os.getuid()}.{pid}.")]


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
            assert _segments_of(kv.pid)
    assert kv.process.returncode == 0
    assert not os.path.exists(path) and not _segments_of(kv.pid)
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
