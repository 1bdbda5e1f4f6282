"""/health of a FreeKV server follows its host pools, not only its daemon (issue 19).

A pool can be unable to serve while the daemon answers every PING: its session was lost (here: the daemon restarted
without its state) and a new one is refused (here: another client holds its client id, CLIENT_ID_IN_USE). Every
request then aborts, so /health must say 503 with the reason, and 200 again once the pool is back up. The pools
publish their state in files (freekv_sglang.kvstore_pool), read by the middleware (freekv_patches._health) on a
FastAPI app whose server_args name the server, as SGLang's app does. Real daemon, CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from freekv_kvstore import ArenaGeometry, KVStoreClient
from freekv_kvstore.journal import discard_store
from freekv_sglang import kvstore_pool
from freekv_sglang.kvstore_pool import KVStoreHostPool, read_pool_states, server_identity, stable_client_id
from test_freekv_aborts import daemon, get, wait_until  # noqa: F401 (daemon: the aborts tests' fixture)

pytestmark = pytest.mark.timeout(180)

SERVER_ARGS = SimpleNamespace(model_path="org/Some-Model", port=30123)
GEOMETRY = dict(num_layers=2, num_kv_heads=2, page_size=4, head_dim=16)


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """The pools' state files go to a directory of the test's own."""
    directory = tmp_path / "state"
    directory.mkdir()
    monkeypatch.setattr(kvstore_pool, "state_dir", lambda: str(directory))
    return directory


def client_id(rank: int, server_args=SERVER_ARGS) -> str:
    return stable_client_id(SimpleNamespace(server_args=server_args), rank)


def make_pool(daemon, rank: int, server_args=SERVER_ARGS) -> KVStoreHostPool:
    return KVStoreHostPool(daemon.endpoint, **GEOMETRY, dtype=torch.float32, num_pages=32, rank=rank,
                           client_id=client_id(rank, server_args), timeout_s=0.5)


def squat(daemon, rank: int) -> KVStoreClient:
    """A client holding a rank's client id on the daemon: that rank's pool gets no new session (CLIENT_ID_IN_USE)."""
    return KVStoreClient.connect(daemon.endpoint, geometry=ArenaGeometry(**GEOMETRY, dtype="float32"), num_pages=8,
                                 client_id=client_id(rank), timeout_s=2.0)


def restart_afresh(daemon, pools) -> None:
    """The daemon restarts without its state: every pool's session is gone (found by its heartbeat)."""
    daemon.kill()
    discard_store(daemon.shm, daemon.endpoint)
    daemon.start()
    wait_until(lambda: all(p.client.expired is not None for p in pools))


def make_app(daemon, sglang_check=lambda: None):
    """A FastAPI app as SGLang's: server_args set, /health and /health_generate routes (sglang_check stands for what
    SGLang's own check sets off: a one-token request that the scheduler, and its pools, see)."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    from freekv_patches._health import add_kvstore_health

    app = FastAPI()
    app.server_args = SERVER_ARGS
    calls = []

    def check():
        calls.append(1)
        sglang_check()
        return Response(status_code=200)

    for path in ("/health", "/health_generate"):
        app.add_api_route(path, check, methods=["GET"])
    app.add_api_route("/other", lambda: Response(status_code=200), methods=["GET"])
    add_kvstore_health(app, daemon.endpoint)
    return app, calls


def test_a_lost_pool_fails_health_while_the_daemon_answers_and_recovers(daemon, state_dir):
    pool = make_pool(daemon, 0)
    squatter = None
    try:
        app, calls = make_app(daemon, sglang_check=pool.problem)  # the scheduler probes as it sees the request
        assert get(app, "/health") == (200, "")
        restart_afresh(daemon, [pool])
        squatter = squat(daemon, 0)
        assert pool.problem() is not None and pool.state == "lost"  # its new session is refused
        for path in ("/health", "/health_generate"):
            status, body = get(app, path)
            assert status == 503, body
            assert "rank 0" in body and client_id(0) in body and "is lost (kvstore_session_lost)" in body
            assert "no longer holds this server's host pages" in body and daemon.endpoint in body
            assert "ClientIdInUse" in body  # why no new session opens
        assert calls  # SGLang's check ran: its request is what lets the pool try again
        assert get(app, "/other")[0] == 200

        squatter.close()
        squatter = None
        wait_until(lambda: get(app, "/health") == (200, ""))  # the check's own request brought the pool back
        assert pool.state == "up"
        assert get(app, "/health_generate") == (200, "")
    finally:
        if squatter is not None:
            squatter.close()
        pool.close()


def test_a_pool_still_down_when_the_daemon_is_back_comes_up_through_the_health_check(daemon, state_dir):
    pool = make_pool(daemon, 0)
    try:
        app, calls = make_app(daemon, sglang_check=pool.problem)
        daemon.kill()
        with pytest.raises(kvstore_pool.HostPagesUnavailable):
            pool.alloc(1, 1)
        status, body = get(app, "/health")
        assert status == 503 and "does not answer" in body and not calls  # the daemon: no request would help
        daemon.start()  # re-adopts the session; the pool finds out at its next probe
        pool._next_probe = time.monotonic() + 3600  # not due yet
        status, body = get(app, "/health")
        assert status == 503 and "rank 0" in body and "is down (kvstore_unreachable)" in body
        assert len(calls) == 1 and pool.state == "down"
        pool._next_probe = 0.0
        assert get(app, "/health") == (200, "") and pool.state == "up"  # probed for the check's request
    finally:
        pool.close()


def test_two_ranks_one_lost_fails_health(daemon, state_dir):
    other_server = SimpleNamespace(model_path=SERVER_ARGS.model_path, port=SERVER_ARGS.port + 1)
    pools = [make_pool(daemon, 0), make_pool(daemon, 1), make_pool(daemon, 0, other_server)]
    squatter = None
    try:
        app, _ = make_app(daemon)
        assert get(app, "/health") == (200, "")
        restart_afresh(daemon, pools)
        squatter = squat(daemon, 1)
        assert pools[0].problem() is None  # rank 0 has its new session
        assert pools[1].problem() is not None and pools[1].state == "lost"
        assert pools[2].state == "up"  # not asked yet
        pools[2]._lose(RuntimeError("another server's loss"))
        status, body = get(app, "/health")
        assert status == 503 and "rank 1" in body and client_id(1) in body and "ClientIdInUse" in body
        assert "rank 0" not in body and "another server" not in body  # only this server's ranks, only the lost one

        squatter.close()
        squatter = None
        wait_until(lambda: pools[1].problem() is None)
        assert get(app, "/health") == (200, "")  # the other server's lost pool is not this server's
    finally:
        if squatter is not None:
            squatter.close()
        for p in pools:
            p.close()


def test_missing_and_dead_ranks_do_not_fail_health(daemon, state_dir):
    pool = make_pool(daemon, 0)
    try:
        app, _ = make_app(daemon)
        # Rank 1 has no file (its pool not open yet); rank 2's file was left lost by a process that is gone.
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        stale = json.loads(Path(pool.state_path).read_text())
        stale.update(state="lost", rank=2, client_id=client_id(2), message="stale", pid=dead.pid)
        (state_dir / os.path.basename(kvstore_pool.state_path(client_id(2)))).write_text(json.dumps(stale))
        assert [s["rank"] for s in read_pool_states(server_identity(SERVER_ARGS))] == [0]
        assert get(app, "/health") == (200, "")
        pool._lose(RuntimeError("gone"))
        status, body = get(app, "/health")
        assert status == 503 and "rank 0" in body and "stale" not in body
    finally:
        pool.close()


def test_the_state_file_is_replaced_whole_at_each_change_and_removed_at_close(daemon, state_dir, monkeypatch):
    replaced = []
    real_replace = os.replace

    def replace(src, dst):
        # The new state is complete in a file of the same directory before it takes the state file's name.
        assert os.path.dirname(src) == os.path.dirname(dst) and src != dst
        replaced.append((os.path.basename(dst), json.loads(Path(src).read_text())))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    pool = make_pool(daemon, 0)
    squatter = None
    try:
        path = Path(pool.state_path)
        assert path.parent == state_dir and path.name == f"freekv-pool.{os.getuid()}.{client_id(0)}.json"
        assert json.loads(path.read_text())["state"] == "up"

        daemon.kill()
        with pytest.raises(kvstore_pool.HostPagesUnavailable):
            pool.alloc(1, 1)
        down = json.loads(path.read_text())
        assert down["state"] == "down" and down["reason"] == "kvstore_unreachable"
        assert daemon.endpoint in down["message"]

        discard_store(daemon.shm, daemon.endpoint)
        daemon.start()
        squatter = squat(daemon, 0)
        wait_until(lambda: pool.problem() is not None and pool.state == "lost")
        lost = json.loads(path.read_text())
        assert lost["state"] == "lost" and lost["reason"] == "kvstore_session_lost"
        squatter.close()
        squatter = None
        wait_until(lambda: pool.problem() is None)
        assert json.loads(path.read_text())["state"] == "up"

        assert {name for name, _ in replaced} == {path.name}
        states = [s["state"] for _, s in replaced]
        assert states[0] == "up" and "down" in states and "lost" in states and states[-1] == "up"
        assert all(s["pid"] == os.getpid() and s["rank"] == 0 and s["client_id"] == client_id(0) for _, s in replaced)
        assert sorted(p.name for p in state_dir.iterdir()) == [path.name]  # no temporary file left
    finally:
        if squatter is not None:
            squatter.close()
        pool.close()
    assert not path.exists() and read_pool_states(server_identity(SERVER_ARGS)) == []


def test_a_pool_that_cannot_publish_its_state_still_serves(daemon, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kvstore_pool, "state_dir", lambda: str(tmp_path / "missing"))
    pool = make_pool(daemon, 0)
    try:
        assert pool.alloc(1, 2) and pool.free(1) == 2
        daemon.kill()
        with pytest.raises(kvstore_pool.HostPagesUnavailable):
            pool.alloc(2, 1)
        daemon.start()  # re-adopts the session
        wait_until(lambda: pool.problem() is None)
        assert pool.alloc(2, 1)
    finally:
        pool.close()
    assert sum("cannot publish the host pool's state" in r.getMessage() for r in caplog.records) == 1  # once


def test_a_process_that_exits_removes_its_state_and_one_killed_is_ignored(daemon, state_dir):
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        from freekv_sglang import kvstore_pool
        kvstore_pool.state_dir = lambda: {str(state_dir)!r}
        pool = kvstore_pool.KVStoreHostPool({daemon.endpoint!r}, num_layers=2, num_kv_heads=2, page_size=4,
                                            head_dim=16, dtype=torch.float32, num_pages=8, rank=0,
                                            client_id=sys.argv[2], timeout_s=0.5)
        pool._lose(RuntimeError("lost before exit"))
        print(pool.state_path, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        """)  # exits without pool.close()
    identity = server_identity(SERVER_ARGS)
    procs = {how: subprocess.Popen([sys.executable, "-c", script, how, client_id(rank)], stdout=subprocess.PIPE,
                                   text=True) for rank, how in enumerate(("exit", "kill"))}
    out = {how: p.communicate(timeout=120)[0].strip() for how, p in procs.items()}
    assert procs["exit"].returncode == 0 and procs["kill"].returncode == -signal.SIGKILL
    assert not Path(out["exit"]).exists()
    assert Path(out["kill"]).exists() and json.loads(Path(out["kill"]).read_text())["state"] == "lost"
    assert read_pool_states(identity) == []  # its process is gone


def test_a_free_refused_for_one_owner_keeps_no_other_owners_pages(daemon, state_dir, monkeypatch, caplog):
    """A step's finished requests go back in one FREE, which the daemon refuses whole: the pool then frees them one
    by one, so only the refused owner's pages stay (and it is logged)."""
    from freekv_kvstore.errors import InvalidArgument

    pool = make_pool(daemon, 0)
    try:
        for owner in (1, 2, 3):
            pool.reserve(owner, 3)
        real, calls = pool.client.free_many, []

        def refuse_owner_2(ids):
            calls.append(sorted(ids))
            if 2 in ids:
                raise InvalidArgument("owner 2 refused")
            return real(ids)

        monkeypatch.setattr(pool.client, "free_many", refuse_owner_2)
        with caplog.at_level("ERROR", logger="freekv_sglang.kvstore_pool"):
            pool.free_many([1, 2, 3])
        assert calls == [[1, 2, 3], [1], [2], [3]] and pool.state == "up"
        arena = next(a for a in pool.client.stats()["arenas"] if a["client_id"] == pool.client.client_id)
        assert arena["used_pages"] == 3  # owner 2's only
        assert "FREE of request 2" in caplog.text
    finally:
        pool.close()
