"""--kv-retrieval louiskv through FreeKVAttnBackend, on CPU (the duck-typed runner, wrapped backends and batches of
test_freekv_backend.py, FreeKV's real token pool and a real kvstore daemon).

LouisKV clusters a whole prompt's keys, so the backend offloads nothing while a prompt's chunks come in (they stay in
staging, where the chunks' prefix reads find them anyway) and, in the forward of its last chunk, clusters and offloads
it per sparse layer (engine.store_staged_prompt). Prompts prefilled chunk by chunk, alone or in mixed batches, must
then decode exactly like an engine given each whole prompt through prefill_layer; a prompt freed mid-prefill releases
its staging and is never offloaded. The radix cache is refused with LouisKV (test_server_args_louiskv.py).
"""

from __future__ import annotations

import pytest
import torch
from test_freekv_backend import (HQ, STAGING, D, H, L, P, Inner, Request, UnifiedInner, decode_batch, extend_once,
                                 layers, reference_engine)
from test_freekv_backend import make_backend as backend_of

from freekv_kvstore import start_embedded
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.sglang_backend import on_request_freed

CFG = FreeKVConfig(budget=32, sink=16, window=16, page_size=P, dense_layers=1, retrieval="louiskv",
                   boundary_tau=0.7, segment=32)


@pytest.fixture(scope="module")
def daemon():
    handle = start_embedded(arena_gb=0.1)
    yield handle
    handle.stop()


def make_backend(daemon, inner=Inner):
    backend, runner = backend_of(daemon, inner=inner, cfg=CFG)
    stored = []  # (slot, layer) of every whole-prompt store, in call order
    whole = backend.engine.store_staged_prompt
    backend.engine.store_staged_prompt = lambda layer, slot, *a: (stored.append((slot, layer)), whole(layer, slot, *a))
    return backend, runner, stored


def decode_like_the_engine(backend, reqs, steps=16):
    """Decode the backend's requests beside a reference engine given the whole prompts; queries that hold for a
    few steps and jump now and then, so some steps are semantic boundaries and most are not."""
    ref, ref_slots = reference_engine(reqs, CFG)
    sparse = L - CFG.dense_layers
    base = torch.randn(len(reqs), L, HQ, D)
    for step in range(steps):
        fb = decode_batch(reqs, pad_to=4 if step % 2 else None)  # odd steps: a padded replay view
        backend.init_forward_metadata(fb)
        plan = ref.begin_step(ref_slots)
        n, bs = len(reqs), fb.batch_size
        for layer in layers():
            jump = torch.rand(n) < 0.25
            base[jump, layer.layer_id] = torch.randn(int(jump.sum()), HQ, D)
            q = torch.randn(bs, HQ, D)
            q[:n] = base[:, layer.layer_id] + 0.2 * torch.randn(n, HQ, D)
            k, v = torch.randn(bs, H * D), torch.randn(bs, H * D)
            out = backend.forward_decode(q.reshape(bs, -1), k, v, layer, fb)
            if layer.layer_id < CFG.dense_layers:
                continue
            want = ref.attend(plan, layer.layer_id, q[:n], k[:n].view(n, H, D), v[:n].view(n, H, D))
            torch.testing.assert_close(out[:n], want.reshape(n, HQ * D), atol=1e-6, rtol=1e-6)
        ref.end_step()
    got, want = backend.engine.stats(), ref.stats()
    assert got["flagged"] == want["flagged"] and 0 < got["flagged"] < got["checks"]  # boundaries, not every step
    assert got["recall_pages_now"] == want["recall_pages_now"] > sparse * H * CFG.select_pages * len(reqs)
    assert got["recall_pages_speculative"] == 0


@pytest.mark.parametrize("chunk,inner", [(1000, Inner), (37, Inner), (16, Inner), (37, UnifiedInner)])
def test_chunked_prefill_clusters_whole_prompts_then_decodes_like_the_engine(daemon, chunk, inner):
    """Two prompts of different lengths prefilled together in chunks (the shorter completes while the longer is
    mid-prefill): each is stored whole once, in the forward of its last chunk, one store per sparse layer."""
    torch.manual_seed(chunk)
    backend, runner, stored = make_backend(daemon, inner)
    reqs = [Request(runner, 3, 300), Request(runner, 5, 130)]
    while any(r.n < r.prompt for r in reqs):
        batch = [r for r in reqs if r.n < r.prompt]
        before = len(stored)
        extend_once(backend, batch, chunk)
        assert {s for s, _ in stored[before:]} == {r.slot for r in batch if r.n == r.prompt}  # last chunks only
    sparse = list(range(CFG.dense_layers, L))
    for r in reqs:
        assert [layer for s, layer in stored if s == r.slot] == sparse
    assert runner.token_to_kv_pool.staging.free_pages == STAGING
    decode_like_the_engine(backend, reqs)


def test_a_prompt_joins_another_mid_prefill(daemon):
    """A long prompt's first chunk alone, then a batch with its next chunk and a new short prompt whole, then its
    rest: the mixed batches stage and store each prompt on its own."""
    torch.manual_seed(7)
    backend, runner, stored = make_backend(daemon)
    long, short = Request(runner, 2, 260), Request(runner, 4, 90)
    extend_once(backend, [long], 96)
    assert stored == []
    extend_once(backend, [long, short], 96)
    assert {s for s, _ in stored} == {short.slot}
    extend_once(backend, [long], 96)
    assert {s for s, _ in stored} == {short.slot, long.slot}
    assert runner.token_to_kv_pool.staging.free_pages == STAGING
    decode_like_the_engine(backend, [long, short])


def test_a_prompt_freed_mid_prefill_releases_its_staging(daemon):
    torch.manual_seed(8)
    backend, runner, stored = make_backend(daemon)
    staging = runner.token_to_kv_pool.staging
    gone = Request(runner, 2, 200)
    extend_once(backend, [gone], 64)
    assert staging.free_pages == STAGING - 4
    on_request_freed(2)
    other = Request(runner, 4, 150)
    while other.n < other.prompt:
        extend_once(backend, [other], 64)
    assert staging.free_pages == STAGING and not backend.engine.is_active(2)
    assert {s for s, _ in stored} == {other.slot}  # the freed prompt was never clustered nor offloaded
    decode_like_the_engine(backend, [other])
