"""KVStoreCore in process, with a fake clock: pre-faulting, budget, sessions and reaping."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import psutil
import pytest

from freekv_kvstore import (
    ArenaFailed,
    ArenaGeometry,
    ArenaNotReady,
    BudgetExceeded,
    ClientIdInUse,
    SessionExpired,
    Unauthorized,
)
from freekv_kvstore.arena import Segment
from freekv_kvstore.config import DaemonConfig
from freekv_kvstore.core import KVStoreCore
from freekv_kvstore.protocol import (
    AllocRequest,
    ByeRequest,
    HeartbeatRequest,
    HelloRequest,
    Opcode,
    PingRequest,
    RetainRequest,
    StatsRequest,
)

pytestmark = pytest.mark.timeout(60)

GEOM = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")  # 256-byte pages


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_core(tmp_path):
    cores = []

    def make(**overrides) -> tuple[KVStoreCore, Clock]:
        settings = dict(endpoint=f"ipc://{tmp_path}/x.sock", arena_bytes=64 * GEOM.page_bytes, shm_dir=str(tmp_path))
        clock = Clock()
        core = KVStoreCore(DaemonConfig(**{**settings, **overrides}), "ipc://test", clock)
        cores.append(core)
        return core, clock

    yield make
    for core in cores:
        core.close()


def hello(core: KVStoreCore, client_id: str = "rank0", num_pages: int = 16, **kw):
    return core.handle(Opcode.HELLO, 0, HelloRequest(client_id, GEOM, num_pages, **kw))


def test_large_arenas_are_prefaulted_in_the_background_and_refuse_pages_until_ready(make_core):
    core, _ = make_core(sync_prefault_bytes=0)
    reply = hello(core)
    assert not reply.ready
    with pytest.raises(ArenaNotReady, match="pre-faulted"):
        core.handle(Opcode.ALLOC, reply.session, AllocRequest([1], [1]))
    for _ in range(200):
        core.tick()
        if core.handle(Opcode.HEARTBEAT, reply.session, HeartbeatRequest()).ready:
            break
        time.sleep(0.005)
    assert core.handle(Opcode.ALLOC, reply.session, AllocRequest([1], [2])).pages == [[0, 1]]


def test_a_failed_prefault_is_reported_and_its_segment_removed(make_core, monkeypatch):
    def no_space(self, threads, cancel=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Segment, "prefault", no_space)
    core, _ = make_core(sync_prefault_bytes=0)
    reply = hello(core)
    with pytest.raises(ArenaFailed, match="No space left"):
        for _ in range(200):
            core.tick()
            core.handle(Opcode.HEARTBEAT, reply.session, HeartbeatRequest())
            time.sleep(0.005)
    assert not os.path.exists(reply.arena_path)
    core.handle(Opcode.BYE, reply.session, ByeRequest())
    assert hello(core, num_pages=16).session  # the failed arena does not block the client_id


def test_silent_sessions_are_reaped_and_keep_only_retained_pages(make_core):
    core, clock = make_core(client_timeout_s=3.0)
    s = hello(core).session
    (pages,) = core.handle(Opcode.ALLOC, s, AllocRequest([1], [4])).pages
    core.handle(Opcode.RETAIN, s, RetainRequest([b"key"], [pages[:1]]))
    clock.now += 2.9
    core.tick()
    assert core.handle(Opcode.PING, s, PingRequest()).daemon_pid == os.getpid()  # any message is a heartbeat
    clock.now += 3.1
    core.tick()
    with pytest.raises(SessionExpired):
        core.handle(Opcode.HEARTBEAT, s, HeartbeatRequest())
    (arena,) = core.handle(Opcode.STATS, 0, StatsRequest(check=True)).arenas
    assert not arena.attached and (arena.free_pages, arena.used_pages, arena.cached_pages) == (15, 0, 1)
    assert core.reaped_sessions == 1


def test_a_client_id_is_free_again_at_once_when_its_process_dies(make_core):
    core, _ = make_core()
    child = subprocess.Popen(["sleep", "30"])
    me = dict(pid=child.pid, hostname=os.uname().nodename, proc_start=psutil.Process(child.pid).create_time())
    hello(core, **me)
    with pytest.raises(ClientIdInUse, match=f"pid {child.pid}"):
        hello(core)
    child.kill()
    child.wait()
    assert hello(core).reattached is False  # taken over without waiting for the heartbeat timeout


def test_another_pid_namespace_is_not_watched(make_core):
    core, clock = make_core()
    me = psutil.Process()
    hello(core, pid=me.pid, hostname=os.uname().nodename, proc_start=me.create_time() + 50)  # start time disagrees
    core.tick()
    assert core.handle(Opcode.STATS, 0, StatsRequest()).sessions == 1


def test_detached_arenas_make_room_for_new_ones_lru_and_only_if_enough(make_core):
    core, clock = make_core()  # budget: 64 pages
    for name in ("a", "b"):
        s = hello(core, name, 24).session
        (pages,) = core.handle(Opcode.ALLOC, s, AllocRequest([1], [1])).pages
        core.handle(Opcode.RETAIN, s, RetainRequest([b"k"], [pages]))
        clock.now += 1
        core.handle(Opcode.BYE, s, ByeRequest())
    live = hello(core, "c", 16).session  # 24 + 24 + 16 = 64: fits without dropping anything
    with pytest.raises(BudgetExceeded, match="ask for fewer pages"):
        hello(core, "d", 64)  # even dropping a and b would not make room: nothing is dropped
    assert {a.client_id for a in core.handle(Opcode.STATS, live, StatsRequest()).arenas} == {"a", "b", "c"}
    hello(core, "d", 20)  # dropping the least recently detached (a) is enough
    assert {a.client_id for a in core.handle(Opcode.STATS, live, StatsRequest()).arenas} == {"b", "c", "d"}


def test_the_token_guards_hello_and_admin_calls(make_core):
    core, _ = make_core(token="secret")
    with pytest.raises(Unauthorized):
        hello(core)
    s = hello(core, token="secret").session
    assert core.handle(Opcode.STATS, s, StatsRequest()).sessions == 1
    with pytest.raises(Unauthorized):
        core.handle(Opcode.STATS, 0, StatsRequest())
    with pytest.raises(SessionExpired):  # a stale session is reported as such, not as a missing token
        core.handle(Opcode.PING, 12345, PingRequest())


def test_prefault_faults_in_every_chunk_and_stops_when_cancelled(tmp_path, monkeypatch):
    import threading

    from freekv_kvstore import arena as arena_mod

    monkeypatch.setattr(arena_mod, "_POPULATE_CHUNK", 1 << 16)
    seg = Segment.create(str(tmp_path / "seg"), (1 << 20) + 4096)  # 17 chunks, the last one partial
    seg.prefault(threads=3)
    assert os.stat(seg.path).st_blocks * 512 >= seg.size  # every block reserved
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(InterruptedError):
        Segment.create(str(tmp_path / "seg2"), 1 << 20).prefault(threads=2, cancel=cancel)
    seg.unlink()
    assert not os.path.exists(seg.path)
