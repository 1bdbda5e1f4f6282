"""PageTable: the pure page bookkeeping of one arena."""

from __future__ import annotations

import random

import pytest

from freekv_kvstore.errors import ArenaFull, InvalidArgument, LimitExceeded
from freekv_kvstore.store import PageTable

pytestmark = pytest.mark.timeout(60)


def counts(t: PageTable) -> tuple[int, int, int]:
    assert t.free_pages + t.used_pages + t.cached_pages == t.num_pages
    assert t.audit() is None
    return t.free_pages, t.used_pages, t.cached_pages


def test_alloc_hands_out_distinct_low_pages_and_free_returns_them():
    t = PageTable(8)
    a, b = t.alloc([1, 2], [3, 2])
    assert a == [0, 1, 2] and b == [3, 4]
    assert t.alloc([1], [1]) == [[5]]  # appends to the request
    assert t.request_pages(1) == [0, 1, 2, 5]
    assert counts(t) == (2, 6, 0)
    assert t.free([1, 1, 99]) == ([4, 0, 0], [4, 0, 0])  # a second free and an unknown id are no-ops
    assert counts(t) == (6, 2, 0)


def test_alloc_is_all_or_nothing():
    t = PageTable(4)
    t.alloc([1], [3])
    with pytest.raises(ArenaFull, match="cannot allocate 2 pages: 1 free"):
        t.alloc([2, 3], [1, 1])
    assert t.num_requests == 1 and counts(t) == (1, 3, 0)
    with pytest.raises(InvalidArgument):
        t.alloc([2], [-1])
    with pytest.raises(InvalidArgument):
        t.alloc([2, 3], [1])


def test_retained_pages_outlive_their_request_and_are_found_by_lookup():
    t = PageTable(8)
    (pages,) = t.alloc([1], [3])
    held, created = t.retain([b"k1", b"k2"], [pages[:2], pages])
    assert held == [pages[:2], pages] and created == [True, True]
    assert t.free([1]) == ([3], [0])
    assert counts(t) == (5, 0, 3)
    assert t.lookup([b"k1", b"k2", b"nope"]) == (1, pages)
    assert t.lookup([b"nope"]) == (-1, [])
    assert t.release([b"k2", b"k2"]) == ([True, False], 1)  # page 2 was only under k2
    assert counts(t) == (6, 0, 2)
    assert t.release([b"k1"]) == ([True], 2)
    assert counts(t) == (8, 0, 0)


def test_retaining_a_known_key_keeps_its_pages():
    t = PageTable(8)
    (a,) = t.alloc([1], [2])
    (b,) = t.alloc([2], [2])
    t.retain([b"k"], [a])
    held, created = t.retain([b"k"], [b])
    assert held == [a] and created == [False]
    t.free([1, 2])
    assert counts(t) == (6, 0, 2)


def test_retain_refuses_free_foreign_and_repeated_pages_without_changing_anything():
    t = PageTable(8)
    (pages,) = t.alloc([1], [2])
    cases = [([7], "is free"), ([8], "outside"), ([-1], "outside"), ([pages[0], pages[0]], "twice"), ([], "at least")]
    for bad, match in cases:
        with pytest.raises(InvalidArgument, match=match):
            t.retain([b"ok", b"bad"], [pages, bad])
        assert t.num_prefixes == 0
    counts(t)


def test_lookup_with_request_id_pins_pages_against_eviction():
    t = PageTable(4)
    (pages,) = t.alloc([1], [2])
    t.retain([b"k"], [pages])
    t.free([1])
    assert t.lookup([b"k"], request_id=7) == (0, pages)
    assert counts(t) == (2, 2, 0)
    with pytest.raises(ArenaFull):  # the pinned pages are not evictable
        t.alloc([8], [3])
    t.release([b"k"])  # the key goes, the request still holds the pages
    assert counts(t) == (2, 2, 0)
    assert t.free([7]) == ([2], [2])
    assert counts(t) == (4, 0, 0)


def test_alloc_evicts_least_recently_used_prefixes_only_as_needed():
    t = PageTable(6)
    for rid, key in enumerate([b"a", b"b", b"c"]):
        (pages,) = t.alloc([rid], [2])
        t.retain([key], [pages])
        t.free([rid])
    assert counts(t) == (0, 0, 6)
    t.lookup([b"a"])  # a becomes most recently used: b is now the oldest
    (got,) = t.alloc([9], [2])
    assert t.lookup([b"b"]) == (-1, []) and t.lookup([b"a"])[0] == 0 and t.lookup([b"c"])[0] == 0
    assert t.evicted_prefixes == 1 and sorted(got) == [2, 3]
    counts(t)


def test_eviction_skips_prefixes_whose_pages_requests_still_hold():
    t = PageTable(4)
    (a,) = t.alloc([1], [2])
    t.retain([b"busy"], [a])  # request 1 still holds these
    (b,) = t.alloc([2], [2])
    t.retain([b"idle"], [b])
    t.free([2])
    (got,) = t.alloc([3], [2])
    assert sorted(got) == sorted(b)
    assert t.lookup([b"busy"])[0] == 0 and t.lookup([b"idle"])[0] == -1
    with pytest.raises(ArenaFull, match="0 evictable"):
        t.alloc([4], [1])
    counts(t)


def test_chained_prefix_keys_share_pages_and_evict_cleanly():
    t = PageTable(3)
    (pages,) = t.alloc([1], [3])
    t.retain([b"k0", b"k1", b"k2"], [pages[:1], pages[:2], pages])
    t.free([1])
    assert counts(t) == (0, 0, 3)
    (got,) = t.alloc([2], [3])  # must drop all three keys to pool all three pages
    assert sorted(got) == pages and t.num_prefixes == 0
    counts(t)


def test_prefix_and_request_limits():
    t = PageTable(8, max_requests=2, max_prefixes=2)
    t.alloc([1, 2], [1, 1])
    with pytest.raises(LimitExceeded):
        t.alloc([3], [1])
    t.alloc([1], [1])  # more pages for a known request are fine
    pages = t.request_pages(1)
    t.retain([b"a", b"b", b"c"], [[pages[0]], [pages[1]], [pages[0]]])
    assert t.num_prefixes == 2 and t.lookup([b"a"]) == (-1, []) and t.evicted_prefixes == 1
    counts(t)


def test_free_all_requests_keeps_retained_pages():
    t = PageTable(8)
    (pages,) = t.alloc([1], [4])
    t.alloc([2], [2])
    t.retain([b"k"], [pages[:1]])
    assert t.free_all_requests() == 5
    assert counts(t) == (7, 0, 1) and t.num_requests == 0


def test_random_operations_keep_every_invariant():
    """A seeded random walk against a model: no page is ever handed to two holders."""
    rng = random.Random(1234)
    t = PageTable(64, max_prefixes=16)
    live: dict[int, list[int]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            rid, n = rng.randrange(20), rng.randrange(1, 9)
            try:
                (pages,) = t.alloc([rid], [n])
            except ArenaFull:
                continue
            owned = {p for ps in live.values() for p in ps}
            assert not owned & set(pages), f"step {step}: page handed out twice"
            live.setdefault(rid, []).extend(pages)
        elif op < 0.6 and live:
            rid = rng.choice(list(live))
            released, _ = t.free([rid])
            assert released == [len(live.pop(rid))]
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            pages = live[rid][: rng.randrange(1, len(live[rid]) + 1)]
            t.retain([rng.randbytes(2)], [pages])
        elif op < 0.9:
            t.release([rng.randbytes(2)])
        else:
            rid = rng.randrange(20, 40)
            idx, pages = t.lookup([rng.randbytes(2)], request_id=rid)
            if idx >= 0:
                live.setdefault(rid, []).extend(pages)
        if step % 100 == 0:
            counts(t)
    t.free(list(live))
    t.release([bytes([a, b]) for a in range(256) for b in range(256)])
    assert counts(t) == (64, 0, 0)
