"""A seeded fuzz run against a real daemon: every frame gets one typed reply, and the accounting survives."""

from __future__ import annotations

import random

import msgpack
import pytest

from freekv_kvstore import ArenaGeometry, KVStoreClient, SessionExpired, codec, daemon_stats, ping_daemon, protocol
from freekv_kvstore.protocol import Opcode, Status

from kvstore_helpers import TOKEN

SEED = 20261121
FRAMES = 10_000
BATCH = 50  # frames in flight at once

GEOM = ArenaGeometry(num_layers=1, num_kv_heads=2, page_size=4, head_dim=8, dtype="bfloat16")


def _valid_requests(rng: random.Random, session: int, pages: int) -> list[tuple[int, int, object]]:
    """Well-formed requests with random (often nonsensical) arguments, as (opcode, session, message)."""
    rid = lambda: rng.choice([rng.randrange(8), rng.randrange(-(2**63), 2**63)])  # noqa: E731
    page = lambda: rng.choice([rng.randrange(pages), rng.randrange(-5, pages * 2)])  # noqa: E731
    key = lambda: rng.randbytes(rng.choice([1, 16, 16, 16, 64]))  # noqa: E731
    keys = [key() for _ in range(4)]
    return [
        (Opcode.ALLOC, session, protocol.AllocRequest([rid() for _ in range(3)], [rng.randrange(6) for _ in range(3)])),
        (Opcode.FREE, session, protocol.FreeRequest([rid() for _ in range(rng.randrange(4))])),
        (Opcode.RETAIN, session, protocol.RetainRequest(keys[:2], [[page() for _ in range(rng.randint(1, 3))]] * 2)),
        (Opcode.RELEASE, session, protocol.ReleaseRequest(keys[1:3])),
        (Opcode.LOOKUP, session, protocol.LookupRequest(keys, rng.choice([None, rid()]))),
        (Opcode.HEARTBEAT, session, protocol.HeartbeatRequest()),
        (Opcode.STATS, rng.choice([0, session]), protocol.StatsRequest(rng.choice([None, "x"]), rng.random() < 0.05)),
        # Never the token outside HELLO: a PING whose opcode byte mutates into SHUTDOWN would stop the daemon.
        (Opcode.PING, rng.choice([0, session]), protocol.PingRequest(rng.choice([None, "guess"]))),
        (Opcode.SHUTDOWN, rng.choice([0, session]), protocol.ShutdownRequest(rng.choice([None, "guess"]))),
        (Opcode.HELLO, 0, protocol.HelloRequest(f"fuzz{rng.randrange(4)}", GEOM, rng.randrange(1, 64), token=TOKEN)),
    ]  # fmt: skip


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    i = rng.randrange(len(frames))
    data = bytearray(frames[i])
    how = rng.randrange(7)
    if how == 0 and data:  # flip bits
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1:  # truncate
        del data[rng.randrange(len(data) + 1) :]
    elif how == 2:  # insert junk
        pos = rng.randrange(len(data) + 1)
        data[pos:pos] = rng.randbytes(rng.randint(1, 8))
    elif how == 3:  # drop or duplicate a frame
        return frames[:i] + frames[i + 1 :] if rng.random() < 0.5 and len(frames) > 1 else frames + [frames[i]]
    elif how == 4 and i == 0 and len(data) >= 4:  # another opcode or version, same body
        data[rng.choice([2, 3])] = rng.randrange(256)
    elif how == 5:  # a body of another message type
        data = bytearray(msgpack.packb(rng.choice([{"keys": [1]}, {"token": b"x"}, [None], {}, "s", 2**64 - 1])))
    else:  # random map values of random types
        field = rng.choice(["request_ids", "counts", "keys", "pages", "token", "x"])
        value = rng.choice([[1, 2], "a", b"b", None, -1, 1.5, [[]], {"a": 1}, True])
        data = bytearray(msgpack.packb({field: value}))
    frames[i] = bytes(data)
    return frames


def _random_frames(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.choice([0, 1, 9, 16, 16, 40, 300])) for _ in range(rng.randint(1, 4))]


@pytest.mark.timeout(180)
def test_fuzzed_frames_get_typed_replies_and_leave_accounting_intact(daemons, raw_peer):
    d = daemons.start("ipc", token=TOKEN, arena_gb=0.01)
    legit = KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=64, token=TOKEN, cuda_register=False)
    assert legit.alloc(1, 10) == list(range(10))
    peer = raw_peer(d.endpoint)
    fuzz = _fuzz_session(d.endpoint)
    rng = random.Random(SEED)
    kinds = {"random": 0, "mutated": 0, "valid": 0}
    replies = {Status.OK: 0, Status.ERROR: 0}
    sent = 0
    while sent < FRAMES:
        batch = []
        for _ in range(min(BATCH, FRAMES - sent)):
            r = rng.random()
            if r < 0.2:
                frames, kind = _random_frames(rng), "random"
            else:
                op, session, msg = rng.choice(_valid_requests(rng, fuzz.session, 64))
                frames = codec.request_frames(op, rng.randrange(2**32), session, msg)
                frames, kind = (_mutate(rng, frames), "mutated") if r < 0.75 else (frames, "valid")
            kinds[kind] += 1
            batch.append(frames)
        for frames in batch:
            peer.send(frames)
        for _ in batch:  # exactly one well-formed reply per frame, error or result
            _, status, _, body = peer.recv(timeout_s=10)
            codec.decode(protocol.ErrorReply if status is Status.ERROR else _reply_type(body), body)
            replies[status] += 1
        sent += len(batch)
        try:  # a fuzzed BYE may have ended the fuzzer's session: open a new one to keep the valid frames useful
            fuzz.stats()
        except SessionExpired:
            fuzz.close()
            fuzz = _fuzz_session(d.endpoint)
    assert sum(replies.values()) == FRAMES and min(kinds.values()) > 1000 and replies[Status.OK] > 1000

    assert ping_daemon(d.endpoint, token=TOKEN).daemon_pid == d.pid
    stats = daemon_stats(d.endpoint, token=TOKEN, check=True)
    assert stats.accounting_ok, stats.accounting_error
    assert stats.messages >= FRAMES and stats.errors >= replies[Status.ERROR]
    for arena in stats.arenas:
        assert arena.free_pages + arena.used_pages + arena.cached_pages == arena.num_pages
    mine = next(a for a in stats.arenas if a.client_id == "rank0")
    assert (mine.used_pages, mine.free_pages) == (10, 54)  # nothing the fuzzer did touched another client
    assert legit.alloc(2, 5) == list(range(10, 15)) and legit.free(1) == 10
    legit.close()
    fuzz.close()


def _fuzz_session(endpoint: str) -> KVStoreClient:
    return KVStoreClient.connect(endpoint, geometry=GEOM, num_pages=64, client_id="fuzzer", token=TOKEN,
                                 cuda_register=False)  # fmt: skip


def _reply_type(body: bytes) -> type:
    """Any reply message that decodes: the fuzz test cares that the body is one, not which."""
    for spec in protocol.MESSAGES.values():
        try:
            codec.decode(spec.reply, body)
            return spec.reply
        except Exception:
            continue
    raise AssertionError(f"a success reply that is no known reply message: {body[:80]!r}")
