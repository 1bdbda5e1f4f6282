"""Chain RETAIN (protocol 2): every page-aligned prefix of a prompt retained for one page id per key. A chain key's
LOOKUP gives its ancestors' pages then its own; eviction cuts chains from their end only; RELEASE drops a key's
descendants; a restarted daemon re-adopts chains from its journal; a prompt of 1024 pages fits one message."""

from __future__ import annotations

import random
import signal

import pytest

from freekv_kvstore import ArenaGeometry, KVStoreClient, prefix_keys
from freekv_kvstore.errors import ArenaFull, InvalidArgument
from freekv_kvstore.store import PageTable

pytestmark = pytest.mark.timeout(90)


def counts(t: PageTable) -> tuple[int, int, int]:
    assert t.audit() is None
    return t.free_pages, t.used_pages, t.cached_pages


def test_a_chain_key_finds_its_whole_prefix_and_branches_share_the_trunk():
    t = PageTable(8)
    (a,) = t.alloc([1], [4])
    assert t.retain_chain([b"a0", b"a1", b"a2", b"a3"], a) == [True] * 4
    assert t.lookup([b"a0", b"a1", b"x"]) == (1, a[:2])
    # A second request shared the first two pages, then exported its own two: a branch off a1.
    (b,) = t.alloc([2], [2])
    assert t.retain_chain([b"a0", b"a1", b"b2", b"b3"], a[:2] + b) == [False, False, True, True]
    assert t.lookup([b"a0", b"a1", b"b2", b"b3"], request_id=3) == (3, a[:2] + b)
    t.free([1, 2])
    assert counts(t) == (2, 4, 2)  # request 3 pins a0, a1, b2, b3; a2, a3 are cached
    with pytest.raises(InvalidArgument, match="another parent"):
        t.retain_chain([b"b2"], [a[2]], parent=b"a0")
    with pytest.raises(InvalidArgument, match="not retained"):
        t.retain_chain([b"c0"], [a[0]], parent=b"nope")
    assert counts(t) == (2, 4, 2)


def test_eviction_cuts_chains_from_their_end_and_release_drops_descendants():
    t = PageTable(6)
    (a,) = t.alloc([1], [4])
    t.retain_chain([b"a0", b"a1", b"a2", b"a3"], a)
    t.free([1])
    t.lookup([b"a0"])  # the trunk key is used most recently, yet its descendants hold it up
    t.alloc([2], [3])  # two free pages, one more from the chain: its last key goes
    assert t.lookup([b"a0", b"a1", b"a2", b"a3"]) == (2, a[:3])
    assert t.evicted_prefixes == 1
    assert t.release([b"a1"]) == ([True], 2)  # a1 and its child a2
    assert t.lookup([b"a0", b"a1", b"a2"]) == (0, a[:1])
    assert counts(t) == (2, 3, 1)


def test_random_chains_keep_every_invariant():
    rng = random.Random(7)
    t = PageTable(48, max_prefixes=40)
    live: dict[int, list[int]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            rid = rng.randrange(10)
            try:
                (pages,) = t.alloc([rid], [rng.randrange(1, 6)])
            except ArenaFull:
                continue
            live.setdefault(rid, []).extend(pages)
        elif op < 0.5 and live:
            t.free([rid := rng.choice(list(live))])
            live.pop(rid)
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            held = list(dict.fromkeys(live[rid]))
            pages = held[: rng.randrange(1, len(held) + 1)]
            t.retain_chain([f"{step}-{i}".encode() for i in range(len(pages))], pages)
        elif op < 0.9:
            keys = list(t._prefixes)
            if keys:
                t.release([rng.choice(keys)])
        else:
            keys = list(t._prefixes)
            if keys:
                rid = rng.randrange(10, 20)
                _, pages = t.lookup([rng.choice(keys)], request_id=rid)
                live.setdefault(rid, []).extend(pages)
        if step % 50 == 0:
            counts(t)
    t.free(list(live))
    t.release(list(t._prefixes))
    assert counts(t) == (48, 0, 0)


def test_a_long_prompt_is_retained_in_one_message_and_survives_a_daemon_restart(daemons):
    geom = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float16")
    shm = str(daemons.workdir())
    d = daemons.start("ipc", shm_dir=shm)
    c = KVStoreClient.connect(d.endpoint, geometry=geom, num_pages=1100, cuda_register=False, client_id="chain")
    keys = prefix_keys(list(range(4 * 1024)), 4, namespace=b"m")
    pages = c.alloc(1, 1024)
    assert all(c.retain_chain(keys, pages))  # 1024 keys: one id each, not 1024 * 1025 / 2
    c.free(1)
    tail = prefix_keys(list(range(4 * 500)) + [7] * 8, 4, namespace=b"m")
    assert c.lookup_longest(tail, request_id=2) == (499, pages[:500])
    d.stop(signal.SIGKILL)
    daemons.start("ipc", endpoint=d.endpoint, shm_dir=shm)  # re-adopts the table, chains included, from its journal
    assert c.lookup_longest(keys) == (1023, pages)
    assert c.stats(check=True)["accounting_ok"]
    c.close()
