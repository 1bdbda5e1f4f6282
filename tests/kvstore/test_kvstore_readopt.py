"""Re-adoption with real daemons: kill -9 and a restart on the same endpoint keep every page, byte for byte, the
page tables and the sessions; a store that is not what it should be is refused and left as it was."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from freekv_kvstore import ArenaGeometry, KVStoreClient, codec, daemon_stats, protocol
from freekv_kvstore.arena import map_segment
from freekv_kvstore.journal import store_prefix
from freekv_kvstore.protocol import ErrorCode, Opcode

from kvstore_helpers import run_worker

pytestmark = pytest.mark.timeout(90)

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=4, head_dim=16, dtype="float32")  # 2 KiB pages
FAST = ("--client-timeout", "1.0", "--heartbeat-interval", "0.25")


def connect(daemon, **kw) -> KVStoreClient:
    kw = {"geometry": GEOM, "num_pages": 32, "cuda_register": False, "token": daemon.token, **kw}
    return KVStoreClient.connect(daemon.endpoint, **kw)


def arenas(daemon) -> dict[str, dict]:
    stats = daemon_stats(daemon.endpoint, token=daemon.token, check=True)
    assert stats.accounting_ok, stats.accounting_error
    return {a.client_id: {f: getattr(a, f) for f in a.__dataclass_fields__ if f != "idle_s"} for a in stats.arenas}


def fill(buffer: memoryview, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, len(buffer), dtype=np.uint8).tobytes()
    buffer[:] = data
    return data


def wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        time.sleep(0.02)


def test_kill_9_and_a_restart_keep_every_page_the_table_and_the_session(daemons, transport, raw_peer):
    shm = str(daemons.workdir())
    d = daemons.start(transport, shm_dir=shm)
    c = connect(d)
    first = c.alloc(1, 5)
    second, _ = c.alloc_many([(2, 3), (3, 4)])
    c.retain(b"prefix", first[:2])
    c.free(3)
    assert c.lookup(b"prefix", request_id=4) == first[:2]
    data = fill(c.buffer, seed=1)
    before, segments = arenas(d), d.segments()
    d.stop(signal.SIGKILL)
    d2 = daemons.start(transport, endpoint=d.endpoint, shm_dir=shm)
    assert "re-adopted" in d2.log() and d2.segments() == segments
    assert arenas(d2) == before
    fresh = map_segment(c.arena_path, c.num_pages * c.page_bytes)  # the file itself, not only our mapping
    assert bytes(fresh) == data == bytes(c.buffer)
    fresh.close()
    # The session goes on: the next page comes from the free pool, the prefix and request 4 are still there.
    (page,) = c.alloc(1, 1)
    assert page not in first + second and arenas(d2)["rank0"]["used_pages"] == before["rank0"]["used_pages"] + 1
    assert c.free(4) == 0 and c.free(1) == 4  # request 4 held the two retained pages; request 1 the others
    # Bad input still gets its typed errors from the restarted daemon.
    peer = raw_peer(d2.endpoint)
    ping = codec.encode(protocol.PingRequest(d2.token))
    for header, code in [
        (protocol.REQUEST_HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION + 1, Opcode.PING, 1, 0),
         ErrorCode.VERSION_MISMATCH),
        (b"garbage", ErrorCode.MALFORMED),
    ]:  # fmt: skip
        _, status, _, body = peer.exchange([header, ping])
        assert status is protocol.Status.ERROR and codec.decode(protocol.ErrorReply, body).code == code
    c.close()


def test_a_page_call_made_while_the_daemon_is_down_completes_once_after_the_restart(daemons):
    shm = str(daemons.workdir())
    d = daemons.start("ipc", shm_dir=shm)
    c = connect(d, timeout_s=10.0)
    c.alloc(1, 2)
    d.process.send_signal(signal.SIGSTOP)
    result: list = []
    call = threading.Thread(target=lambda: result.append(c.alloc(7, 3)))
    call.start()
    time.sleep(0.2)
    d.stop(signal.SIGKILL)  # it dies with the call unread: only a resend can bring it to the next daemon
    time.sleep(1.0)  # resent twice more while nobody listens: the copies wait in the queue
    d2 = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm)
    call.join(10)
    assert result == [[2, 3, 4]]
    assert arenas(d2)["rank0"]["used_pages"] == 5  # once, not three times
    c.close()


def test_a_journal_that_does_not_check_out_is_refused_and_left_for_a_fix(daemons):
    shm = str(daemons.workdir())
    d = daemons.start("ipc", shm_dir=shm)
    c = connect(d)
    pages = c.alloc(1, 4)
    data = fill(c.buffer, seed=2)
    d.stop(signal.SIGKILL)
    journal = Path(f"{store_prefix(shm, d.endpoint)}journal")
    good = journal.read_bytes()
    journal.write_bytes(good[:40] + bytes([good[40] ^ 0xFF]) + good[41:])  # inside the snapshot

    def files() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(shm).iterdir()
                if p.name.startswith("freekv.")}  # fmt: skip

    spoiled = files()
    refused = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm, wait=False)
    assert refused.process.wait(20) == 1
    assert "snapshot fails its checksum. Nothing was changed" in refused.log() and files() == spoiled
    journal.write_bytes(good)  # whoever fixes the journal gets everything back
    d3 = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm)
    assert bytes(c.buffer) == data and c.alloc(1, 1)[0] not in pages
    assert arenas(d3)["rank0"]["used_pages"] == 5
    c.close()


def test_clients_that_die_while_the_daemon_is_down_are_reaped_others_keep_theirs(daemons):
    """Two servers share a daemon; the daemon and one server are killed; the daemon comes back."""
    shm = str(daemons.workdir())
    d = daemons.start("ipc", shm_dir=shm, extra=FAST)
    workers = {name: run_worker("hold", d.endpoint, name, str(n), str(kept))
               for name, n, kept in (("a", 40, 4), ("b", 10, 0))}  # fmt: skip
    try:
        held = {name: json.loads(w.stdout.readline())["pages"] for name, w in workers.items()}
        b = arenas(d)["b"]
        b_arena = map_segment(b["arena_path"], b["num_pages"] * b["page_bytes"])
        b_data = fill(memoryview(b_arena), seed=3)
        d.stop(signal.SIGKILL)
        workers["a"].kill()
        workers["a"].wait(10)
        d2 = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm, extra=FAST)
        wait_for(lambda: not arenas(d2)["a"]["attached"], 2.0)  # its process is gone: reaped at the first sweep
        after = arenas(d2)
        assert (after["a"]["free_pages"], after["a"]["used_pages"], after["a"]["cached_pages"]) == (60, 0, 4)
        time.sleep(1.5)  # longer than the client timeout: b's heartbeats came back, so b keeps its session
        assert arenas(d2)["b"]["attached"] and arenas(d2)["b"]["used_pages"] == 10
        assert bytes(b_arena) == b_data
        b_arena.close()
        # A new server takes over a's client_id and prefix; b's request ids and pages are none of its business.
        with KVStoreClient.connect(d2.endpoint, geometry=GEOM, num_pages=64, client_id="a", cuda_register=False) as a:
            assert a.reattached and a.lookup(b"held-prefix") == held["a"][:4]
            assert a.free(1) == 0 and len(a.alloc(1, 60)) == 60
        assert arenas(d2)["b"]["used_pages"] == 10
    finally:
        for w in workers.values():
            w.kill()
            w.wait(10)
