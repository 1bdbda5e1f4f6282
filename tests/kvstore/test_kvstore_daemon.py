"""A real daemon subprocess over ipc:// and tcp://: every message, every kind of bad frame, security, files."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from freekv_kvstore import (
    ArenaFull,
    ArenaGeometry,
    BudgetExceeded,
    ClientIdInUse,
    KVStoreClient,
    Unauthorized,
    codec,
    daemon_stats,
    ping_daemon,
    prefix_keys,
    protocol,
    shutdown_daemon,
)
from freekv_kvstore.arena import ARENA_ID_BYTES
from freekv_kvstore.journal import store_prefix
from freekv_kvstore.protocol import ErrorCode, Opcode, Status

from kvstore_helpers import TOKEN

pytestmark = pytest.mark.timeout(90)

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=4, head_dim=8, dtype="float16")


def connect(daemon, **kw) -> KVStoreClient:
    kw = {"geometry": GEOM, "num_pages": 32, "cuda_register": False, "token": daemon.token, **kw}
    return KVStoreClient.connect(daemon.endpoint, **kw)


def test_every_message_type_round_trips(daemons, transport):
    d = daemons.start(transport)
    seen: set[Opcode] = set()
    with connect(d) as c:
        seen.add(Opcode.HELLO)
        assert c.arena.shape == (32, 2, 2, 2, 4, 8) and str(c.arena.dtype) == "torch.float16"
        assert c._channel.call(Opcode.HEARTBEAT, protocol.HeartbeatRequest(), c.session).ready
        seen.add(Opcode.HEARTBEAT)
        pages = c.alloc(1, 3)
        more = c.alloc_many([(2, 2), (3, 0)])
        assert pages == [0, 1, 2] and more == [[3, 4], []]
        seen.add(Opcode.ALLOC)
        keys = prefix_keys(range(12), page_size=4)
        assert c.retain_many([(keys[0], pages[:1]), (keys[2], pages)]) == [pages[:1], pages]
        seen.add(Opcode.RETAIN)
        assert c.free(1) == 0 and c.free_many([2, 99]) == 2  # retained pages stay out of the pool
        seen.add(Opcode.FREE)
        assert c.lookup(keys[2]) == pages and c.lookup(keys[1]) is None
        assert c.lookup_longest(keys, request_id=5) == (2, pages)
        seen.add(Opcode.LOOKUP)
        assert c.release(keys[2]) and not c.release(keys[2])
        seen.add(Opcode.RELEASE)
        chain = prefix_keys(range(8), page_size=4, namespace=b"chain")
        assert c.retain_chain(chain, pages[:2]) == [True, True] and c.lookup(chain[1]) == pages[:2]
        seen.add(Opcode.RETAIN_CHAIN)
        stats = c.stats(check=True)
        seen.add(Opcode.STATS)
        (arena,) = stats["arenas"]
        assert stats["accounting_ok"] and stats["sessions"] == 1 and stats["endpoint"] == d.endpoint
        assert (arena["free_pages"], arena["used_pages"], arena["cached_pages"]) == (29, 3, 0)
        assert 0 < c.ping() < 1
        seen.add(Opcode.PING)
    seen.add(Opcode.BYE)
    assert ping_daemon(d.endpoint, token=d.token).daemon_pid == d.pid
    assert daemon_stats(d.endpoint, token=d.token).sessions == 0
    assert shutdown_daemon(d.endpoint, token=d.token).sessions == 0
    seen.add(Opcode.SHUTDOWN)
    assert seen == set(Opcode)
    assert d.process.wait(10) == 0 and not d.segments()


def _header(opcode: int, *, version: int = protocol.PROTOCOL_VERSION, call_id: int = 1, session: int = 0) -> bytes:
    return protocol.REQUEST_HEADER.pack(protocol.MAGIC, version, opcode, call_id, session)


def test_bad_frames_get_typed_errors_and_the_daemon_stays_up(daemons, transport, raw_peer):
    d = daemons.start(transport)
    peer = raw_peer(d.endpoint)
    ping = codec.encode(protocol.PingRequest(d.token))
    cases = [
        ([_header(Opcode.PING, version=protocol.PROTOCOL_VERSION + 1), ping], ErrorCode.VERSION_MISMATCH),
        ([_header(0x7E), ping], ErrorCode.UNKNOWN_OPCODE),
        ([_header(Opcode.PING)[:7], ping], ErrorCode.MALFORMED),  # truncated header
        ([_header(Opcode.PING)], ErrorCode.MALFORMED),  # body missing
        ([_header(Opcode.PING), ping, b"extra"], ErrorCode.MALFORMED),
        ([_header(Opcode.PING), ping[:-1] if len(ping) > 1 else b"\x81"], ErrorCode.MALFORMED),  # truncated body
        ([_header(Opcode.PING), b"\x80" * (protocol.MAX_BODY_BYTES + 1)], ErrorCode.MESSAGE_TOO_LARGE),
        ([os.urandom(16), os.urandom(40)], ErrorCode.MALFORMED),  # garbage
        ([b"", b""], ErrorCode.MALFORMED),
        ([_header(Opcode.PING), b"\xc1\xff\x00"], ErrorCode.MALFORMED),  # not msgpack
        ([_header(Opcode.ALLOC), msgpack.packb({"request_ids": "x", "counts": [1]})], ErrorCode.INVALID_MESSAGE),
        ([_header(Opcode.PING), msgpack.packb({"token": 5})], ErrorCode.INVALID_MESSAGE),
        ([_header(Opcode.PING), msgpack.packb([1, 2, 3])], ErrorCode.INVALID_MESSAGE),
        ([_header(Opcode.ALLOC, session=12345), codec.encode(protocol.AllocRequest([1], [1]))],
         ErrorCode.UNKNOWN_SESSION),
        ([_header(Opcode.HELLO), msgpack.packb({"client_id": "x", "num_pages": 0, "token": d.token,
           "geometry": {"num_layers": 1, "num_kv_heads": 1, "page_size": 1, "head_dim": 1}})],
         ErrorCode.INVALID_ARGUMENT),
    ]  # fmt: skip
    for i, (frames, code) in enumerate(cases):
        op, status, call_id, body = peer.exchange(frames)
        err = codec.decode(protocol.ErrorReply, body)
        assert status is Status.ERROR and err.code == code, f"case {i}: {err}"
        assert err.message
        if len(frames[0]) == protocol.REQUEST_HEADER.size and frames[0][:2] == protocol.MAGIC:
            assert call_id == 1  # the caller can still match the error to its request
    assert ping_daemon(d.endpoint, token=d.token).daemon_pid == d.pid
    stats = daemon_stats(d.endpoint, token=d.token, check=True)
    assert stats.errors == len(cases) and stats.accounting_ok is not False


def test_tcp_refuses_clients_without_the_token(daemons, raw_peer):
    d = daemons.start("tcp")
    for token in (None, "wrong-token"):
        with pytest.raises(Unauthorized, match="token"):
            connect(d, token=token)
        with pytest.raises(Unauthorized):
            ping_daemon(d.endpoint, token=token)
        with pytest.raises(Unauthorized):
            daemon_stats(d.endpoint, token=token)
        with pytest.raises(Unauthorized):
            shutdown_daemon(d.endpoint, token=token)
    assert ping_daemon(d.endpoint, token=TOKEN).daemon_pid == d.pid
    # A tcp daemon without a token does not start at all.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREEKV_KVSTORE_")}
    cmd = [sys.executable, "-m", "freekv_kvstore", "--endpoint", "tcp://127.0.0.1:0"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert refused.returncode == 2 and "need a token" in refused.stderr


def test_shutdown_needs_the_token_even_from_a_session(daemons):
    d = daemons.start("ipc", token=TOKEN)
    with connect(d) as c:
        with pytest.raises(Unauthorized):
            c._channel.call(Opcode.SHUTDOWN, protocol.ShutdownRequest(), c.session)
        assert c.stats()["sessions"] == 1  # a session is enough for STATS and PING
    assert shutdown_daemon(d.endpoint, token=TOKEN).sessions == 0
    assert d.process.wait(10) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_segments_are_private_while_alive_and_gone_after_a_signal(daemons, sig):
    d = daemons.start("ipc")
    c = connect(d)
    st = os.stat(c.arena_path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert st.st_size == 32 * GEOM.page_bytes + ARENA_ID_BYTES
    assert stat.S_IMODE(os.stat(d.endpoint.removeprefix("ipc://")).st_mode) == 0o600
    assert len(d.segments()) == 1
    assert d.stop(sig) == 0
    assert not d.segments() and not os.path.exists(c.arena_path)
    assert not os.path.exists(d.endpoint.removeprefix("ipc://"))
    assert "listening on " + d.endpoint in d.log()
    c.close()  # the daemon is gone: close must still return promptly


def test_a_taken_endpoint_is_refused(daemons, transport):
    first = daemons.start(transport)
    second = daemons.start(transport, endpoint=first.endpoint, wait=False)
    assert second.process.wait(20) == 1
    assert ("taken by a running kvstore" if transport == "ipc" else "already in use") in second.log()
    assert ping_daemon(first.endpoint, token=first.token).daemon_pid == first.pid


def test_a_start_removes_unjournaled_arenas_of_its_endpoint_and_stores_nobody_can_re_adopt(daemons):
    shm = str(daemons.workdir())  # private: nothing of a concurrent run in it
    d = daemons.start("ipc", shm_dir=shm)
    with connect(d, client_id="a") as c:
        c.retain(b"k", c.alloc(1, 1))  # the arena stays after the session ends
    d.stop(signal.SIGKILL)
    orphan = f"{store_prefix(shm, d.endpoint)}9"  # as if the daemon died between creating and journaling it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    external = store_prefix(shm, "ipc:///external.sock")  # its daemon may be restarted: left alone
    embedded = store_prefix(shm, "ipc:///embedded.sock")  # its daemon and its server are gone: nobody can
    for prefix, parent in ((external, "0 0"), (embedded, f"{int(dead.stdout)} 123456")):
        Path(f"{prefix}lock").write_text(f"{int(dead.stdout)} 1 {parent}\n")
        Path(f"{prefix}0").write_bytes(b"x")
    Path(orphan).write_bytes(b"x")
    kept = d.segments()
    d2 = daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm)
    assert not os.path.exists(orphan) and d2.segments() == [p for p in kept if p != orphan]
    assert os.path.exists(f"{external}0") and not any(os.path.exists(f"{embedded}{n}") for n in ("0", "lock"))
    assert "no journaled arena" in d2.log() and "daemon and server are both gone" in d2.log()


def test_client_ids_budget_and_reattach(daemons):
    d = daemons.start("ipc", arena_gb=0.001)  # 1 MiB: 2048 pages of GEOM (512 bytes each)
    c = connect(d, client_id="rank0", num_pages=1200)
    with pytest.raises(ClientIdInUse, match="in use by a live session"):
        connect(d, client_id="rank0", num_pages=1200)
    with pytest.raises(BudgetExceeded, match="--arena-gb"):
        connect(d, client_id="rank1", num_pages=1200)
    # The start-up split a server logs: the wait for the new arena's pre-fault, its mapping (no CUDA here).
    assert set(c.startup_s) == {"prefault", "attach"} and min(c.startup_s.values()) >= 0
    pages = c.alloc(7, 1200)
    with pytest.raises(ArenaFull, match="cannot allocate 1 pages"):
        c.alloc(8, 1)
    key = prefix_keys(range(8), 4)[-1]
    c.retain(key, pages[:2])
    c.arena[pages[0]] = 3.0
    c.close()
    # A restarted server with the same client_id and geometry finds its retained prefix and its bytes.
    c2 = connect(d, client_id="rank0", num_pages=1200)
    assert c2.reattached and c2.lookup(key) == pages[:2]
    assert float(c2.arena[pages[0]].float().mean()) == 3.0
    assert c2.stats()["arenas"][0]["free_pages"] == 1198
    c2.close()
    # A different geometry replaces the detached arena (and its prefixes) instead of failing.
    c3 = connect(d, client_id="rank0", num_pages=600)
    assert not c3.reattached and c3.lookup(key) is None
    c3.close()


def test_arena_layout_matches_the_documented_geometry(daemons):
    """arena[p, l, h, kv, t, d] sits at byte ((((p*L + l)*H + h)*2 + kv)*ps + t)*D + d) * itemsize."""
    import torch

    geom = ArenaGeometry(num_layers=3, num_kv_heads=2, page_size=4, head_dim=8, dtype="bfloat16")
    d = daemons.start("ipc")
    with connect(d, geometry=geom, num_pages=5) as c:
        a = c.arena
        assert a.shape == (5, 3, 2, 2, 4, 8) and a.dtype == torch.bfloat16 and a.is_contiguous()
        assert c.page_bytes == 3 * 2 * 2 * 4 * 8 * 2 and len(c.buffer) == 5 * c.page_bytes
        p, layer, h, kv, t, dim = 3, 2, 1, 1, 2, 5
        a[p, layer, h, kv, t, dim] = 1.0  # bf16 1.0 is 0x3F80
        offset = (((((p * 3 + layer) * 2 + h) * 2 + kv) * 4 + t) * 8 + dim) * 2
        assert bytes(c.buffer[offset : offset + 2]) == b"\x80\x3f"
        page = bytes(c.buffer[p * c.page_bytes : (p + 1) * c.page_bytes])
        assert c.arena[p].view(torch.uint8).numpy().tobytes() == page


def test_an_fp8_arena_keeps_each_pages_exponents_after_its_values(daemons):
    """float8_e4m3fn ("fp8_e4m3"): page p is page_bytes = L*H*2*ps*(D + 1) bytes at p * page_bytes, its e4m3 values
    [L, H, 2, ps, D] first, then one int8 exponent per row [L, H, 2, ps]; the client's views reach exactly those
    bytes. An arena of another dtype has no exponents."""
    import torch

    L, H, ps, D = 3, 2, 4, 8
    geom = ArenaGeometry(num_layers=L, num_kv_heads=H, page_size=ps, head_dim=D, dtype="fp8_e4m3")
    assert geom.dtype == "float8_e4m3fn" and geom.page_bytes == L * H * 2 * ps * (D + 1)
    d = daemons.start("ipc")
    with connect(d, geometry=geom, num_pages=5) as c:
        a, e = c.arena, c.scales
        assert a.shape == (5, L, H, 2, ps, D) and a.dtype == torch.float8_e4m3fn
        assert e.shape == (5, L, H, 2, ps) and e.dtype == torch.int8 and len(c.buffer) == 5 * c.page_bytes
        p, layer, h, kv, t, dim = 3, 2, 1, 1, 2, 5
        a[p, layer, h, kv, t, dim] = 1.0  # e4m3 1.0 is 0x38
        e[p, layer, h, kv, t] = -7
        row = (((layer * H + h) * 2 + kv) * ps + t)
        base = p * c.page_bytes
        assert c.buffer[base + row * D + dim] == 0x38
        assert c.buffer[base + L * H * 2 * ps * D + row] == (-7) & 0xFF
        assert bytes(c.buffer).count(b"\x00") == 5 * c.page_bytes - 2
    with connect(d, geometry=ArenaGeometry(L, H, ps, D, "bfloat16"), num_pages=2, client_id="bf16") as c:
        assert c.scales is None


def test_numpy_and_torch_integers_are_accepted_and_bools_refused(daemons):
    import numpy as np
    import torch

    d = daemons.start("ipc")
    with connect(d, num_pages=np.int64(16), rank=np.int32(0)) as c:
        pages = c.alloc(np.int64(3), torch.tensor(2))
        assert c.retain(b"k", torch.tensor(pages)) == pages
        assert c.lookup(b"k", request_id=np.uint8(4)) == pages
        assert c.free_many(np.array([3, 4])) == 0
        with pytest.raises(TypeError):
            c.alloc(True, 1)
        with pytest.raises(TypeError):
            c.alloc(1, 2.0)
