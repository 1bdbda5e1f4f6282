"""Radix prefix sharing on a real daemon (docs/radix.md): shared prefix pages stay while any request or retained key
holds them, unused prefixes are evicted least recently used first only when space is needed, a restarted server
(same client_id) finds them, another model's keys never hit; and the FreeKV engine on a kvstore arena starts a request
from a retained prefix and decodes exactly as from its own prefill."""

from __future__ import annotations

import pytest
import torch

from freekv_kvstore import ArenaFull, ArenaGeometry, KVStoreClient, prefix_keys

pytestmark = pytest.mark.timeout(90)

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=4, head_dim=8, dtype="float16")


def connect(daemon, geometry=GEOM, num_pages=16, client_id="rank0") -> KVStoreClient:
    return KVStoreClient.connect(daemon.endpoint, geometry=geometry, num_pages=num_pages, cuda_register=False,
                                 client_id=client_id)


def arena_stats(c):
    return c.stats()["arenas"][0]


def test_shared_prefix_pages_refcounts_lru_eviction_and_reuse_after_a_restart(daemons):
    d = daemons.start("ipc")
    c = connect(d)
    tokens = list(range(24))
    keys = prefix_keys(tokens, 4, namespace=b"model-a")
    a = c.alloc(1, 6)  # the exporting request: 6 full pages
    for i, page in enumerate(a):
        c.arena[page] = i + 1
    c.retain_many([(keys[4], a[:5]), (keys[2], a[:3])])  # its prefix end and a split point
    # Two running requests hit: one the whole prefix, one diverging after page 2.
    assert c.lookup_longest(prefix_keys(tokens[:20] + [99] * 8, 4, namespace=b"model-a"), request_id=2) == (4, a[:5])
    assert c.lookup_longest(prefix_keys(tokens[:12] + [7] * 12, 4, namespace=b"model-a"), request_id=3) == (2, a[:3])
    assert c.lookup_longest(prefix_keys(tokens, 4, namespace=b"model-b")) is None  # another model never hits
    assert c.free(1) == 1  # the exporter leaves: only its unshared page returns
    st = arena_stats(c)
    assert (st["free_pages"], st["used_pages"], st["cached_pages"], st["prefixes"]) == (11, 5, 0, 2)
    # Every prefix page is pinned by a running request: nothing can be evicted for a new one.
    c.alloc(4, 11)
    with pytest.raises(ArenaFull):
        c.alloc(5, 1)
    assert arena_stats(c)["prefixes"] == 2
    c.free_many([4, 2])  # pages 3..4 are now held by the key alone (cached), 0..2 still by request 3
    st = arena_stats(c)
    assert (st["free_pages"], st["cached_pages"]) == (11, 2)
    c.alloc(5, 13)  # needs the cached pages: the least recently used key that frees something goes
    st = arena_stats(c)
    assert (st["prefixes"], st["evicted_prefixes"], st["free_pages"]) == (1, 1, 0)
    assert c.lookup(keys[4]) is None and c.lookup(keys[2]) == a[:3]
    c.free_many([5, 3])
    assert arena_stats(c)["cached_pages"] == 3
    assert c.stats(check=True)["accounting_ok"]
    c.close()
    # A restarted server (same client_id and geometry) finds the retained prefix and its bytes; another client not.
    c2 = connect(d)
    assert c2.reattached
    assert c2.lookup_longest(keys, request_id=9) == (2, a[:3])
    assert [float(c2.arena[p].float().mean()) for p in a[:3]] == [1.0, 2.0, 3.0]
    with connect(d, client_id="other") as other:
        assert other.lookup_longest(keys) is None
    assert c2.free(9) == 0  # still retained
    c2.close()


def test_engine_on_a_kvstore_arena_starts_from_a_retained_prefix(daemons):
    from freekv_kernels.testing import device
    from freekv_sglang.config import FreeKVConfig
    from freekv_sglang.engine import FreeKVEngine, ModelShape
    from freekv_sglang.kvstore_pool import KVStoreHostPool

    L, H, G, D, p, P = 3, 2, 2, 16, 16, 4
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=p, tau=0.6, dense_layers=1)
    shape = ModelShape(num_layers=L, num_q_heads=H * G, num_kv_heads=H, head_dim=D)
    dev = device()
    d = daemons.start("ipc")

    def engine(host=None):
        return FreeKVEngine(cfg, shape, max_requests=3, max_context=256, dtype=torch.float32, device=dev,
                            backend="torch", host_pool=host, host_pages=64)

    pool = KVStoreHostPool(d.endpoint, num_layers=L, num_kv_heads=H, page_size=p, head_dim=D, dtype=torch.float32,
                           num_pages=64, rank=0, client_id="srv-rank0")
    eng, fresh = engine(pool), engine()
    torch.manual_seed(3)
    tokens = torch.randint(0, 1000, (P * p + 30,)).tolist()
    keys = prefix_keys(tokens, p, namespace=b"model-a")
    kv = [(torch.randn(len(tokens), H, D, device=dev), torch.randn(len(tokens), H, D, device=dev),
           torch.randn(H * G, D, device=dev)) for _ in range(L)]
    a = eng.add_request()
    eng.begin_prefill(a, P * p + 7)
    for layer, (k, v, q) in enumerate(kv):
        eng.prefill_layer(a, layer, k[:P * p + 7], v[:P * p + 7], q)
    pool.reserve(eng.owner(a), 5)  # one page ahead, as the scheduler reserves before a step
    assert pool.retain_prefix(keys[P - 1], eng.export_prefix(a, P))
    assert len(pool._reserved[eng.owner(a)]) == 1  # the export's sink page did not take the reserved page
    eng.remove_request(a)  # the exporter is gone; the prefix stays retained
    assert arena_stats(pool.client)["cached_pages"] == P
    b = eng.add_request()
    pages = pool.lookup_prefix(eng.owner(b), keys, sink_pages=cfg.sink_pages)
    assert len(pages) == P
    assert pool.lookup_prefix(eng.owner(b) + 100, prefix_keys(tokens, p, namespace=b"model-b"), sink_pages=1) == []
    eng.begin_prefill_shared(b, pages, len(tokens))
    for layer, (k, v, q) in enumerate(kv):
        eng.prefill_layer(b, layer, k[P * p:], v[P * p:], q)
    ref = fresh.add_request()
    fresh.begin_prefill(ref, len(tokens))
    for layer, (k, v, q) in enumerate(kv):
        fresh.prefill_layer(ref, layer, k, v, q)
    for _ in range(8):
        qkv = [(torch.randn(1, H * G, D, device=dev), torch.randn(1, H, D, device=dev),
                torch.randn(1, H, D, device=dev)) for _ in range(L)]
        # As reserve_decode does: the shared pages past the sink count as the request's, so none is reserved again.
        pool.reserve(eng.owner(b), -(-(eng.seq_len(b) + 1) // p) - cfg.sink_pages)
        plan, plan_ref = eng.begin_step([b]), fresh.begin_step([ref])
        for layer in range(L):
            torch.testing.assert_close(eng.attend(plan, layer, *qkv[layer]), fresh.attend(plan_ref, layer, *qkv[layer]),
                                       atol=1e-6, rtol=1e-6)
        eng.end_step()
        fresh.end_step()
    st = arena_stats(pool.client)
    assert st["used_pages"] == -(-(len(tokens) + 8) // p) - cfg.sink_pages + min(cfg.sink_pages, P)
    eng.remove_request(b)
    st = arena_stats(pool.client)
    assert (st["used_pages"], st["cached_pages"], st["prefixes"]) == (0, P, 1)
    pool.close()
