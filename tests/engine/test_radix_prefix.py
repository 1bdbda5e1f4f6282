"""Shared prefixes (docs/radix.md): a request started from another request's exported host pages decodes exactly like
the same request prefilled from scratch, and its sharers come and go without touching each other's pages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freekv_kernels.testing import device
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

D = 16
DEV = device()
H, G, L = 2, 2, 3
P = 5  # shared full pages
KEY_OWNER = 1 << 40  # a host-pool owner standing for the retained prefix
CFG = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1)


def make_engine(cfg=CFG, dense_outside=False):
    shape = ModelShape(num_layers=L, num_q_heads=H * G, num_kv_heads=H, head_dim=D)
    return FreeKVEngine(cfg, shape, max_requests=4, max_context=512, dtype=torch.float32, device=DEV, backend="torch",
                        dense_outside=dense_outside)


def prompt(n, prefix=None):
    data = [(torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV), torch.randn(H * G, D, device=DEV))
            for _ in range(L)]
    if prefix is not None:  # the same first tokens as `prefix` in every layer
        m = P * CFG.page_size
        for (k, v, _), (pk, pv, _) in zip(data, prefix):
            k[:m], v[:m] = pk[:m], pv[:m]
    return data


def prefill(eng, data, shared=None):
    s = eng.add_request()
    n = data[0][0].shape[0]
    if shared is None:
        eng.begin_prefill(s, n)
    else:
        eng.host.hold(eng.owner(s), shared)
        eng.begin_prefill_shared(s, shared, n)
    start = 0 if shared is None else len(shared) * CFG.page_size
    for layer, (k, v, q) in enumerate(data):
        eng.prefill_layer(s, layer, k[start:], v[start:], q)
    return s


def step(eng, slots, qkv):
    """One decode step; qkv[layer] = (q, k, v) with one row per slot."""
    plan = eng.begin_step(slots)
    outs = [eng.attend(plan, layer, *qkv[layer]) for layer in range(L)]
    eng.end_step()
    return outs


def rand_step(b):
    return [(torch.randn(b, H * G, D, device=DEV), torch.randn(b, H, D, device=DEV), torch.randn(b, H, D, device=DEV))
            for _ in range(L)]


@pytest.mark.parametrize("suffix", [3, 37])  # 3: prefix pages fall in the sharer's window and are recalled there
def test_a_shared_start_decodes_like_a_prefill_from_scratch_and_outlives_the_exporter(suffix):
    torch.manual_seed(0)
    eng, fresh = make_engine(), make_engine()
    a_data = prompt(P * CFG.page_size + 13)
    a = prefill(eng, a_data)
    for _ in range(4):  # the exporter decodes on before exporting (its window moves)
        step(eng, [a], rand_step(1))
    pages = eng.export_prefix(a, P)
    assert len(pages) == P and eng.export_prefix(a, P) == pages  # exporting again writes nothing new
    for layer, (k, v, _) in enumerate(a_data):  # every layer, dense included, sink and window pages included
        pk, pv = (eng.host.arena[pages, layer, :, i].transpose(1, 2).reshape(-1, *k.shape[1:]) for i in (0, 1))
        assert torch.equal(pk, k[:P * CFG.page_size].cpu()) and torch.equal(pv, v[:P * CFG.page_size].cpu())
    eng.host.hold(KEY_OWNER, pages)  # retained
    b_data = prompt(P * CFG.page_size + suffix, prefix=a_data)
    free_before = eng.host.free_pages
    b = prefill(eng, b_data, shared=pages)
    own = -(-(P * CFG.page_size + suffix) // CFG.page_size) - P
    assert free_before - eng.host.free_pages == own  # only the suffix's pages are new
    ref = prefill(fresh, b_data)
    for t in range(16):
        if t == 6:
            eng.remove_request(a)  # one sharer leaves: the other's pages are untouched
            assert not set(pages) & set(eng.host._free)
        slots = [b] if t >= 6 else [a, b]
        qkv = rand_step(1)
        mixed = [tuple(torch.cat([torch.randn_like(x), x]) for x in row) for row in qkv] if t < 6 else qkv
        out, out_ref = step(eng, slots, mixed), step(fresh, [ref], qkv)
        for layer in range(L):
            torch.testing.assert_close(out[layer][-1], out_ref[layer][0], atol=1e-6, rtol=1e-6)
    st, st_ref = eng.stats(), fresh.stats()
    assert st["recall_pages_now"] + st["recall_pages_speculative"] > 0  # the shared pages were selected and recalled
    eng.remove_request(b)
    assert not set(pages) & set(eng.host._free)  # still retained
    eng.host.free(KEY_OWNER)
    assert eng.host.free_pages == eng.host.arena.shape[0]


def test_two_sharers_a_sharer_exporting_further_and_summaries_rebuilt_from_the_arena():
    torch.manual_seed(1)
    eng, fresh = make_engine(), make_engine()
    a_data = prompt(P * CFG.page_size + 5)  # its prefix page P - 1 is still in its window: export offloads it
    a = prefill(eng, a_data)
    pages = eng.export_prefix(a, P)
    b_data, c_data = prompt(P * CFG.page_size + 40, prefix=a_data), prompt(P * CFG.page_size + 9, prefix=a_data)
    b, c = prefill(eng, b_data, shared=pages), prefill(eng, c_data, shared=pages)
    longer = eng.export_prefix(b, P + 2)  # a sharer exports a longer prefix: the shared pages, then its own
    assert longer[:P] == pages and not set(longer[P:]) & set(pages)
    eng.remove_request(a)
    # Sketches are GPU state: a new server rebuilds them from the arena before the first hit.
    sparse = [layer for layer in range(L) if not eng.dense[layer]]
    before = [eng.summaries[layer][longer].clone() for layer in sparse]
    for layer in sparse:
        eng.summaries[layer][longer] = 0
    eng.load_prefix_summaries(longer)
    for layer, want in zip(sparse, before):
        torch.testing.assert_close(eng.summaries[layer][longer], want, atol=0, rtol=0)
    refs = [prefill(fresh, b_data), prefill(fresh, c_data)]
    for _ in range(10):
        qkv = rand_step(2)
        out, out_ref = step(eng, [b, c], qkv), step(fresh, refs, qkv)
        for layer in range(L):
            torch.testing.assert_close(out[layer], out_ref[layer], atol=1e-6, rtol=1e-6)
    eng.remove_request(b)
    eng.remove_request(c)
    assert eng.host.free_pages == eng.host.arena.shape[0]


def test_a_staged_prompt_exports_its_pages_so_far_as_a_whole_prompt_would():
    # A prompt prefilled outside the engine in chunks (SGLang: staging pages, store_staged offloading each chunk's full
    # pages past the sink) exports its full pages before its last chunk: the sink page from staging, the rest as
    # store_staged offloaded them. Bytes and summaries equal a whole prompt's export of the same pages.
    torch.manual_seed(2)
    eng, whole = make_engine(dense_outside=True), make_engine(dense_outside=True)
    p, sink = CFG.page_size, CFG.sink_pages
    data = prompt(150)
    sparse = [layer for layer in range(L) if not eng.dense[layer]]
    k_st = [torch.zeros(10 * p, H, D, device=DEV) for _ in range(L)]  # staging page j holds logical page j
    v_st = [torch.zeros(10 * p, H, D, device=DEV) for _ in range(L)]
    staged = (lambda layer: (k_st[layer], v_st[layer]), list(range(10)))
    i32 = dict(dtype=torch.int32, device=DEV)
    none = torch.zeros(0, dtype=torch.long, device=DEV)
    s, start = eng.add_request(), 0
    for end in (40, 80):
        eng.stage_prefill(s, end)
        for layer in sparse:
            k_st[layer][start:end], v_st[layer][start:end] = data[layer][0][start:end], data[layer][1][start:end]
            full = range(max(start // p, sink), end // p)
            eng.store_staged(layer, k_st[layer], v_st[layer], torch.tensor(list(full), **i32),
                             torch.tensor([eng.host_page(s, j) for j in full], **i32),
                             torch.ones(len(full), dtype=torch.bool, device=DEV), none, none)
        eng.end_step()
        start = end
    pages = eng.export_prefix(s, 5, staged)
    w = whole.add_request()
    whole.begin_prefill(w, 80)
    for layer in sparse:
        whole.prefill_layer(w, layer, data[layer][0][:80], data[layer][1][:80])
    want = whole.export_prefix(w, 5)
    for layer in sparse:
        assert torch.equal(eng.host.arena[pages, layer], whole.host.arena[want, layer])
        assert torch.equal(eng.summaries[layer][pages], whole.summaries[layer][want])
    free = eng.host.free_pages
    assert eng.export_prefix(s, 5, staged) == pages and eng.host.free_pages == free  # nothing new: nothing written


def test_bad_shared_starts_are_refused():
    eng = make_engine()
    a = prefill(eng, prompt(40))
    with pytest.raises(ValueError, match="1..2 full pages"):
        eng.export_prefix(a, 3)
    with pytest.raises(ValueError, match="needs dense_outside"):  # its dense layers would be the engine's, unwritten
        eng.export_prefix(a, 2, (lambda layer: (eng.k_cache[layer], eng.v_cache[layer]), [0, 1, 2]))
    pages = eng.export_prefix(a, 2)
    s = eng.add_request()
    with pytest.raises(ValueError, match="longer than 32 tokens"):
        eng.begin_prefill_shared(s, pages, 32)  # no suffix of its own
    with pytest.raises(ValueError, match="distinct host pages"):
        eng.begin_prefill_shared(s, [pages[0], pages[0]], 40)
    with pytest.raises(ValueError, match="1 full page|expects 8 tokens"):
        eng.begin_prefill_shared(s, pages, 40)
        eng.prefill_layer(s, 0, *prompt(40)[0])  # the whole prompt instead of its suffix
    louis = make_engine(FreeKVConfig(budget=32, sink=16, window=16, page_size=16, dense_layers=1, retrieval="louiskv"))
    r = prefill(louis, prompt(80))
    with pytest.raises(ValueError, match="cluster order"):
        louis.export_prefix(r, 2)


def test_an_fp8_arena_shares_prefixes_as_rounded_rows():
    """With FP8 host pages an exported prefix holds each row as e4m3 times its scale (every layer, dense included),
    a sharer reads those rows back where it loads prefix pages from the arena (its sink and window, the recalls),
    and so decodes like a prefill from scratch within e4m3's rounding; summaries rebuilt from the arena are the
    rounded keys' min / max."""
    from freekv_kernels.fp8_rows import naive_dequantize_rows, naive_quantize_rows

    cfg = dataclasses.replace(CFG, host_dtype="fp8_e4m3")
    torch.manual_seed(2)
    eng, fresh = make_engine(cfg), make_engine(cfg)
    a_data = prompt(P * CFG.page_size + 13)
    a = prefill(eng, a_data)
    pages = eng.export_prefix(a, P)
    m = P * CFG.page_size
    for layer, (k, v, _) in enumerate(a_data):
        for i, x in enumerate((k, v)):
            got = naive_dequantize_rows(eng.host.arena[pages, layer, :, i], eng.host.scales[pages, layer, :, i],
                                        torch.float32).transpose(1, 2).reshape(-1, H, D)
            want = naive_dequantize_rows(*naive_quantize_rows(x[:m].cpu()), torch.float32)
            assert torch.equal(got, want)
    b_data = prompt(m + 37, prefix=a_data)
    b, ref = prefill(eng, b_data, shared=pages), prefill(fresh, b_data)
    eng.remove_request(a)
    worst = 0.0
    for _ in range(8):
        qkv = rand_step(1)
        out, out_ref = step(eng, [b], qkv), step(fresh, [ref], qkv)
        assert torch.equal(eng.slot_table[:, b], fresh.slot_table[:, ref])  # the exporter's exact summaries
        worst = max(worst, max(float((o - r).abs().max()) for o, r in zip(out, out_ref)))
    assert 0 < worst < 0.1, worst
    eng.load_prefix_summaries(pages)  # as a later server's first hit on a retained prefix
    for layer in (layer for layer in range(L) if not eng.dense[layer]):
        keys = naive_dequantize_rows(*naive_quantize_rows(a_data[layer][0][:m].cpu()), torch.float32)
        keys = keys.view(P, CFG.page_size, H, D)
        assert torch.equal(eng.summaries[layer][pages, :, 0].cpu(), keys.amin(1))
        assert torch.equal(eng.summaries[layer][pages, :, 1].cpu(), keys.amax(1))
