"""FreeKV attention through SGLang's Triton decode kernel (the path used when FreeKV wraps SGLang's Triton backend).

With the budget covering the context the output must be bit-identical to SGLang's full-KV Triton decode over the
same tokens with B requests of H KV heads, its split counts chosen as SGLang chooses them (the deterministic fixed
tile, and the default heuristic), GQA groups 1/3/4/8, page sizes 16 and 32; past the budget it matches the engine's
own kernel. On CPU the kernels run under TRITON_INTERPRET in fp16 (the interpreter has no bf16); on a GPU in bf16.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from freekv_kernels.testing import device

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

pytest.importorskip("sglang.kernels.ops.attention.decode_attention")
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd  # noqa: E402
from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton  # noqa: E402

from freekv_sglang.triton_attention import TritonHeadAttention  # noqa: E402

DEV = device()
GPU = DEV.type == "cuda"
DT = torch.bfloat16 if GPU else torch.float16
# On CPU the engine's own ops run in torch (its Triton kernels under the interpreter took minutes), fewer steps.
BACKEND, STEPS = ("triton", 1.0) if GPU else ("torch", 0.1)
D, L, MAX_SPLITS, CORES = 64, 2, 16, 132
MODES = {"default": dict(enable_deterministic=False, split_tile_size=None),
         "deterministic": dict(enable_deterministic=True, split_tile_size=64)}  # SGLang's 256, smaller here


def inner_backend(mode: str, rows: int, heads: int):
    """The attributes of SGLang's TritonAttnBackend that TritonHeadAttention reads, with this batch's split buffers."""
    meta = SimpleNamespace(attn_logits=torch.full((rows, heads, MAX_SPLITS, D), float("nan"), device=DEV),
                           attn_lse=torch.full((rows, heads, MAX_SPLITS), float("nan"), device=DEV))
    return SimpleNamespace(**MODES[mode], max_kv_splits=MAX_SPLITS, static_kv_splits=False, device_core_count=CORES,
                           use_pdl=False, forward_metadata=meta)


def layer_of(i: int):
    return SimpleNamespace(layer_id=i, scaling=D ** -0.5, k_scale=None, v_scale=None, k_scale_float=None,
                           v_scale_float=None)


def dense(q, ks, vs, H, mode):
    """SGLang's full-KV Triton decode: each request's tokens in order, B requests of H heads, its split counts."""
    B, Hq = q.shape[0], q.shape[1]
    lens = torch.tensor([k.shape[0] for k in ks], dtype=torch.int32, device=DEV)
    indptr = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = lens.cumsum(0)
    splits = torch.empty(B, dtype=torch.int32, device=DEV)
    if MODES[mode]["enable_deterministic"]:
        tile = MODES[mode]["split_tile_size"]
        splits[:] = (lens + tile - 1) // tile
    else:
        get_num_kv_splits_triton[(1,)](splits, lens, B, 1, Hq, H, MAX_SPLITS, CORES, MAX_NUM_SEQ=256)
    o = torch.empty_like(q)
    logits = torch.empty(B, Hq, MAX_SPLITS, D, device=DEV)
    lse = torch.empty(B, Hq, MAX_SPLITS, device=DEV)
    decode_attention_fwd(q, torch.cat(ks), torch.cat(vs), o, indptr, torch.arange(int(indptr[-1]), dtype=torch.int32,
                         device=DEV), logits, lse, splits, MAX_SPLITS, D ** -0.5, 1.0, 1.0)
    return o


def setup(G, H, cfg, lens, bs, mode):
    eng = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=bs, max_context=2048, dtype=DT, device=DEV,
                       backend=BACKEND, pad_slot=0, dense_outside=True)
    calibrate_synthetic(eng, gaussian_sample(eng))  # the default channel sketch, from keys like these
    ta = TritonHeadAttention(inner_backend(mode, bs, H * G), cfg, H * G, H, D, eng.num_slots, DEV)
    hist, slots = [], []
    for i, n in enumerate(lens):
        s = eng.add_request(i + 1)
        eng.begin_prefill(s, n)
        k, v = torch.randn(n, H, D, device=DEV, dtype=DT), torch.randn(n, H, D, device=DEV, dtype=DT)
        eng.prefill_layer(s, 1, k, v)
        hist.append([k, v])
        slots.append(s)
    return eng, ta, hist, slots


# Every GQA group, each attention mode with two of them (on CPU each case interprets SGLang's kernels for seconds).
@pytest.mark.slow
@pytest.mark.parametrize("G,H,mode", [(1, 4, "default"), (3, 3, "deterministic"), (4, 2, "default"),
                                      (8, 1, "deterministic")])
def test_budget_covering_context_is_bit_identical_to_full_kv_triton(G, H, mode):
    p = 16 if G % 2 else 32
    cfg = FreeKVConfig(budget=32 * p, sink=p, window=2 * p, page_size=p, tau=0.8, dense_layers=1, selection="sketch")
    lens = [5, 3 * p - 2, 300, 33]  # the second fills a page and starts one
    bs = len(lens) + 1  # one padding row, as in a captured bucket
    eng, ta, hist, slots = setup(G, H, cfg, lens, bs, mode)
    for step in range(max(4, int(STEPS * (p + 3)))):
        lens = [n + 1 for n in lens]
        eng.prepare_step(slots, pad_to=bs, lens=lens)
        ta.plan(lens + [1], graph=False)
        plan = eng.plan(bs)
        q = torch.randn(bs, H * G, D, device=DEV, dtype=DT)
        k, v = torch.randn(bs, H, D, device=DEV, dtype=DT), torch.randn(bs, H, D, device=DEV, dtype=DT)
        o = eng.attend(plan, 1, q, k, v, attention=lambda *a: ta.attend(layer_of(1), *a))
        eng.end_step()
        for b in range(len(lens)):
            hist[b] = [torch.cat([hist[b][0], k[b:b + 1]]), torch.cat([hist[b][1], v[b:b + 1]])]
        # The plain server's batch holds the same padding row (one token).
        ref = dense(q, [h[0] for h in hist] + [k[-1:]], [h[1] for h in hist] + [v[-1:]], H, mode)
        assert torch.equal(o[:len(lens)], ref[:len(lens)]), (step, (o - ref).abs().max().item())


@pytest.mark.parametrize("mode", list(MODES))
def test_past_the_budget_it_matches_the_engine_kernel(mode):
    G, H = 4, 2
    cfg = FreeKVConfig(budget=128, sink=32, window=64, page_size=32, tau=0.8, dense_layers=1, selection="sketch")
    lens, bs = [700, 1100, 333], 4
    eng, ta, hist, slots = setup(G, H, cfg, lens, bs, mode)
    twin = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=bs, max_context=2048, dtype=DT, device=DEV,
                        backend=BACKEND, pad_slot=0, dense_outside=True)
    calibrate_synthetic(twin, gaussian_sample(twin))
    for s, n, (k, v) in zip(slots, lens, hist):
        twin.add_request(s)
        twin.begin_prefill(s, n)
        twin.prefill_layer(s, 1, k, v)
    for _ in range(int(STEPS * 40)):
        q = torch.randn(bs, H * G, D, device=DEV, dtype=DT)
        k, v = torch.randn(bs, H, D, device=DEV, dtype=DT), torch.randn(bs, H, D, device=DEV, dtype=DT)
        lens = [n + 1 for n in lens]
        outs = []
        for e, attention in ((twin, None), (eng, lambda *a: ta.attend(layer_of(1), *a))):
            e.prepare_step(slots, pad_to=bs, lens=lens)
            if e is eng:
                ta.plan(lens + [1], graph=False)
            outs.append(e.attend(e.plan(bs), 1, q, k, v, attention=attention))
            e.end_step()
        torch.testing.assert_close(outs[1][:3], outs[0][:3], atol=2e-2, rtol=2e-2)
    assert eng.stats()["recall_bytes_now"] == twin.stats()["recall_bytes_now"]
