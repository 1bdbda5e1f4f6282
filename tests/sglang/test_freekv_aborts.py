"""The abort path with a real external kvstore daemon that is killed and brought back: only the requests whose host
pages cannot be had end (with SGLang's abort, a 503 and a message naming the daemon), the rest go on; new requests
are refused while no daemon answers; /health fails meanwhile; once a daemon is back everything is served again.

Layers: KVStoreHostPool (unreachable -> fail fast, frees kept for later; session lost -> new session at the same
arena address), FreeKVAttnBackend driven as the scheduler drives it (reserve_decode before each decode step), the
scheduler seams' abort helpers on real SGLang finish reasons and AbortReq messages, and the /health middleware on a
FastAPI app.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from freekv_kvstore import daemon_stats
from freekv_kvstore.journal import discard_store
from freekv_sglang.kvstore_pool import HostPagesUnavailable, KVStoreHostPool

pytestmark = pytest.mark.timeout(180)

FAST = ("--client-timeout", "2.0", "--heartbeat-interval", "0.25")


class Daemon:
    """An external daemon on a fixed ipc endpoint that can be killed, restarted (re-adopting its state) or started
    afresh."""

    def __init__(self, workdir: Path):
        self.workdir, self.shm = workdir, str(workdir)
        self.endpoint = f"ipc://{workdir}/kv.sock"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FREEKV_KVSTORE_")}
        with open(self.workdir / "daemon.log", "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "freekv_kvstore", "--endpoint", self.endpoint,
                                          "--arena-gb", "0.1", "--shm-dir", self.shm, "--ready-file", str(ready),
                                          *FAST], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text().strip()):
            assert self.proc.poll() is None and time.monotonic() < deadline, (self.workdir / "daemon.log").read_text()
            time.sleep(0.02)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def used_pages(self) -> int:
        return sum(a.used_pages for a in daemon_stats(self.endpoint).arenas)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        discard_store(self.shm, self.endpoint)


@pytest.fixture
def daemon():
    workdir = Path(__import__("tempfile").mkdtemp(prefix="fkv-ab-", dir="/tmp"))  # ipc paths are short
    d = Daemon(workdir)
    d.start()
    yield d
    d.stop()
    __import__("shutil").rmtree(workdir, ignore_errors=True)


def make_pool(daemon, timeout_s=0.5, client_id="pool") -> KVStoreHostPool:
    return KVStoreHostPool(daemon.endpoint, num_layers=2, num_kv_heads=2, page_size=4, head_dim=16,
                           dtype=torch.float32, num_pages=32, rank=0, client_id=client_id, timeout_s=timeout_s)


def wait_until(predicate, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


# ---- KVStoreHostPool ----------------------------------------------------------------------------


def test_unreachable_daemon_fails_fast_and_frees_wait_for_its_return(daemon):
    pool = make_pool(daemon)
    try:
        assert pool.alloc(1, 3) and pool.used_pages == 3
        pool.reserve(2, 2)
        assert daemon.used_pages() == 5
        daemon.kill()
        assert pool.alloc(2, 2)  # reserved pages need no daemon call
        with pytest.raises(HostPagesUnavailable) as e:
            pool.reserve(2, 3)
        assert e.value.reason == "kvstore_unreachable" and daemon.endpoint in str(e.value)
        t0 = time.monotonic()
        with pytest.raises(HostPagesUnavailable):
            pool.alloc(3, 1)  # no second wait for a daemon known to be down
        assert pool.free(1) == 3  # kept until the daemon answers, never raised
        assert time.monotonic() - t0 < 0.3
        assert pool.problem() is not None and pool.state == "down"

        daemon.start()  # kill -9 + restart: the store (and this session) is re-adopted
        wait_until(lambda: pool.problem() is None)
        assert not pool.owner_lost(2)
        assert daemon.used_pages() == 2  # owner 1's FREE went out when the daemon answered
        pool.reserve(2, 3)
        assert daemon.used_pages() == 3
    finally:
        pool.close()


def test_an_alloc_a_stopped_daemon_carries_out_late_is_freed(daemon):
    pool = make_pool(daemon)
    try:
        pool.alloc(1, 1)
        daemon.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(HostPagesUnavailable, match="kvstore_unreachable|cannot be used"):
            pool.reserve(2, 2)  # its copies sit in the stopped daemon's socket
        assert pool.free(2) == 0
        daemon.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: pool.problem() is None)
        assert daemon.used_pages() == 1  # the late ALLOC of owner 2 was freed with the waiting FREE
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        pool.close()


def test_lost_session_ends_its_owners_and_a_new_one_keeps_the_arena_address(daemon):
    pool = make_pool(daemon)
    try:
        address = pool.arena.data_ptr()
        pool.alloc(1, 2)
        daemon.kill()
        discard_store(daemon.shm, daemon.endpoint)  # the restarted daemon has none of the old state
        daemon.start()
        with pytest.raises(HostPagesUnavailable) as e:
            pool.reserve(1, 3)
        assert e.value.reason == "kvstore_session_lost" and daemon.endpoint in str(e.value)
        assert pool.owner_lost(1)
        wait_until(lambda: pool.problem() is None)  # a new session
        with pytest.raises(HostPagesUnavailable, match="no longer holds"):
            pool.reserve(1, 3)  # its pages are gone for good
        assert pool.free(1) == 2 and daemon.used_pages() == 0  # nothing to free in the new session
        pool.reserve(7, 2)
        assert pool.alloc(7, 2) and daemon.used_pages() == 2 and pool.used_pages == 2
        assert pool.arena.data_ptr() == address
    finally:
        pool.close()


# ---- the backend, driven as the scheduler drives it ---------------------------------------------------


def test_backend_aborts_only_requests_whose_pages_are_gone(daemon):
    from test_freekv_backend import Request, decode_batch, layers, make_backend, prefill

    backend, runner = make_backend(SimpleNamespace(endpoint=daemon.endpoint))
    backend.host.client._channel.timeout_s = 0.5  # the server's 5 s deadline, shortened for the test

    def step(reqs):
        fb = decode_batch(reqs)
        backend.init_forward_metadata(fb)
        for layer in layers():
            q, k, v = (torch.randn(len(reqs), n) for n in (6 * 16, 2 * 16, 2 * 16))
            out = backend.forward_decode(q, k, v, layer, fb)
            assert torch.isfinite(out).all()

    grows, steady = Request(runner, 3, 159), Request(runner, 5, 70)  # 159 + 1 fills a page; 70 + 2 does not
    prefill(backend, [grows, steady], 64)
    assert backend.reserve_decode([3, 5]) == {}
    step([grows, steady])

    daemon.kill()
    lost = backend.reserve_decode([3, 5])
    assert list(lost) == [3] and lost[3].reason == "kvstore_unreachable" and daemon.endpoint in str(lost[3])
    step([steady])  # the other request decodes on: its pages are in the mapped arena
    late = Request(runner, 4, 100)
    prefill(backend, [late], 64)  # its prefill runs on the GPU, its pages cannot go to the host
    assert backend._lost[4].reason == "kvstore_unreachable"
    assert set(backend.reserve_decode([4, 5])) == {4}
    assert backend.kvstore_problem().reason == "kvstore_unreachable"
    from freekv_sglang.sglang_backend import on_request_freed

    on_request_freed(3)
    on_request_freed(4)  # SGLang frees the aborted requests' slots; FreeKV drops them on its next step
    step([steady])

    daemon.start()  # back with its state: the frees go out, new requests are served
    wait_until(lambda: backend.kvstore_problem() is None)
    fresh = Request(runner, 4, 90)
    prefill(backend, [fresh], 64)
    assert backend.reserve_decode([4, 5]) == {}
    step([fresh, steady])
    eng, host = backend.engine, backend.host
    held = sum(max(0, -(-eng.seq_len(s) // 16) - 1) for s in (4, 5))  # host pages of the two live requests
    reserved = sum(len(pages) for pages in host._reserved.values())
    assert daemon.used_pages() == host.used_pages == held + reserved  # the aborted requests' pages were freed
    backend.host.close()


# ---- the scheduler side -----------------------------------------------------------------------------


class FakeBatch:
    """The parts of ScheduleBatch the decode abort uses."""

    def __init__(self, reqs):
        self.reqs, self.released, self.batch_is_full = list(reqs), [], True

    def release_req(self, idx, remaining, server_args):
        self.released.append(self.reqs[idx].rid)

    def filter_batch(self, keep_indices=None):
        self.reqs = [self.reqs[i] for i in keep_indices]


class FakeBackend:
    def __init__(self, lost=None, problem=None):
        self.lost, self.problem = lost or {}, problem

    def reserve_decode(self, slots):
        return {s: p for s, p in self.lost.items() if s in slots}

    def kvstore_problem(self):
        return self.problem


def scheduler():
    sent = []
    channel = SimpleNamespace(send_output=lambda obj, req=None: sent.append(obj))
    return SimpleNamespace(tp_size=1, server_args=None, waiting_queue=[], sent=sent,
                           ipc_channels=SimpleNamespace(send_to_tokenizer=channel))


def req(rid, slot):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=4))
    r.req_pool_idx = slot
    return r


def test_the_sglang_calls_the_aborts_mirror_are_there():
    """_aborts does what SGLang 0.5.16 does when it aborts the last request it cannot fit (retract_decode and
    update_running_batch) and a queued request (abort_request): the same calls, checked in SGLang's source."""
    import inspect

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    retract = inspect.getsource(ScheduleBatch.retract_decode)
    for call in ("last_req.to_finish = FINISH_ABORT(", "self.release_req(last_idx, 0, server_args)",
                 "self.filter_batch(keep_indices=sorted_indices)"):
        assert call in retract, call
    update = inspect.getsource(Scheduler.update_running_batch)
    assert "self.ipc_channels.send_to_tokenizer.send_output(" in update
    assert "finished_reason=abort_reason.to_json()" in update and "batch.prepare_for_decode()" in update
    abort = inspect.getsource(Scheduler.abort_request)
    assert "req = self.waiting_queue.pop(i)" in abort
    assert "self.tp_cpu_group = self.tp_group.cpu_group" in inspect.getsource(Scheduler)


def test_decode_abort_takes_the_lost_requests_out_with_sglangs_abort(monkeypatch):
    from sglang.srt.managers.io_struct import AbortReq

    from freekv_patches import _aborts

    problem = HostPagesUnavailable("kvstore_unreachable", "the kvstore daemon at ipc:///x cannot be used: gone")
    monkeypatch.setattr(_aborts, "_backends", lambda: [FakeBackend(lost={2: problem})])
    counted = []
    monkeypatch.setattr("freekv_sglang.metrics.count_aborted_requests", lambda r, n=1: counted.append((r, n)))
    sched, batch = scheduler(), FakeBatch([req("a", 1), req("b", 2), req("c", 3)])
    lost = batch.reqs[1]
    assert _aborts.abort_lost_decode_requests(sched, batch) == 1
    assert [r.rid for r in batch.reqs] == ["a", "c"] and batch.released == ["b"] and not batch.batch_is_full
    lost.update_finish_state()  # what SGLang would do with it: finished by the abort
    assert lost.finished_reason.to_json()["type"] == "abort"
    (msg,) = sched.sent
    assert isinstance(msg, AbortReq) and msg.rid == "b"
    assert msg.finished_reason["type"] == "abort" and msg.finished_reason["status_code"] == HTTPStatus.SERVICE_UNAVAILABLE
    assert "ipc:///x" in msg.finished_reason["message"] and "gone" in msg.finished_reason["message"]
    assert counted == [("kvstore_unreachable", 1)]

    monkeypatch.setattr(_aborts, "_backends", lambda: [FakeBackend()])
    batch = FakeBatch([req("a", 1)])
    assert _aborts.abort_lost_decode_requests(sched, batch) == 0 and batch.released == []


def test_waiting_requests_are_rejected_only_while_no_kvstore_serves(monkeypatch):
    from freekv_patches import _aborts

    monkeypatch.setattr("freekv_sglang.metrics.count_aborted_requests", lambda r, n=1: None)
    sched = scheduler()
    sched.waiting_queue.extend([req("new1", None), req("new2", None)])
    monkeypatch.setattr(_aborts, "_backends", lambda: [FakeBackend()])
    assert _aborts.reject_waiting_requests(sched) == 0 and len(sched.waiting_queue) == 2
    problem = HostPagesUnavailable("kvstore_session_lost", "the kvstore daemon at ipc:///y no longer holds ...")
    monkeypatch.setattr(_aborts, "_backends", lambda: [FakeBackend(problem=problem)])
    assert _aborts.reject_waiting_requests(sched) == 2 and sched.waiting_queue == []
    assert [m.rid for m in sched.sent] == ["new1", "new2"]
    assert all("ipc:///y" in m.finished_reason["message"] for m in sched.sent)


def test_ranks_agree_on_the_union_of_their_findings():
    from freekv_patches._aborts import merge_ranks

    r0 = {1: ("kvstore_unreachable", "rank 0 saw it")}
    r1 = {1: ("kvstore_session_lost", "rank 1 saw it"), 4: ("kvstore_arena_full", "full")}
    assert merge_ranks([r0, r1]) == {1: r0[1], 4: r1[4]}
    assert merge_ranks([{}, {}]) == {}


# ---- /health ----------------------------------------------------------------------------------------


def get(app, path: str) -> tuple[int, str]:
    sent: list[dict] = []

    async def call():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(call())
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()


def test_health_fails_while_the_daemon_is_gone_and_recovers(daemon):
    from fastapi import FastAPI
    from fastapi.responses import Response

    from freekv_patches._health import add_kvstore_health

    app = FastAPI()
    for path in ("/health", "/health_generate", "/other"):
        app.add_api_route(path, lambda: Response(status_code=200), methods=["GET"])
    add_kvstore_health(app, daemon.endpoint)
    add_kvstore_health(app, daemon.endpoint)  # once only
    assert get(app, "/health") == (200, "")
    daemon.kill()
    for path in ("/health", "/health_generate"):
        status, body = get(app, path)
        assert status == 503 and daemon.endpoint in body and "DaemonUnavailable" in body
    assert get(app, "/other")[0] == 200
    daemon.start()
    assert get(app, "/health") == (200, "")


def test_tsp_refuses_waiting_requests_that_need_every_prompt_tokens_hidden_state(monkeypatch):
    """--kv-prefill tsp: input-token logprobs or hidden states of a prompt longer than --kv-tsp-keep cannot be had (the
    tokens not propagated have no hidden state past the TSP layer): answered with an abort (400); others wait on."""
    from freekv_patches import _aborts

    monkeypatch.setattr("freekv_sglang.metrics.count_aborted_requests", lambda r, n=1: None)
    sched = scheduler()
    plain, short, logprobs, hidden, outputs = (req(rid, None) for rid in ("plain", "short", "lp", "hs", "out"))
    for r in (plain, logprobs, hidden, outputs):
        r.origin_input_ids = list(range(100))
    for r in (logprobs, outputs):
        r.return_logprob = True
    logprobs.logprob_start_len, outputs.logprob_start_len = 10, 100  # SGLang's 'output tokens only': the length
    short.return_logprob, short.logprob_start_len = True, 0  # 3 tokens: propagates whole
    hidden.return_hidden_states = True
    sched.waiting_queue.extend([plain, short, logprobs, hidden, outputs])
    assert _aborts.reject_tsp_unservable(sched, keep=64) == 2
    assert [r.rid for r in sched.waiting_queue] == ["plain", "short", "out"]
    assert [m.rid for m in sched.sent] == ["lp", "hs"]
    assert all(m.finished_reason["status_code"] == HTTPStatus.BAD_REQUEST for m in sched.sent)
    assert "input-token logprobs (logprob_start_len 10)" in sched.sent[0].finished_reason["message"]
    assert "return_hidden_states" in sched.sent[1].finished_reason["message"]
    assert _aborts.reject_tsp_unservable(sched, keep=64) == 0
