"""FreeKV attention through FlashInfer (the path used when FreeKV wraps SGLang's FlashInfer backend), GPU only.

With the budget covering the context the output must be bit-identical to FlashInfer's full-KV decode over
the same tokens, planned the way SGLang plans it (B requests of H KV heads), eager and graph-mode wrappers,
GQA groups 1/3/4/8 (4 and 8 take FlashInfer's tensor-core path, as SGLang chooses); a captured step
replays equal to eager; past the budget it matches the engine's own kernel.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs a GPU")

D, L = 64, 2
BF = torch.bfloat16


# SGLang's split-KV settings: default, and --enable-deterministic-inference (tensor cores, a fixed split size
# in eager mode, no split in graphs; 256 here instead of 2048 so these contexts do split).
MODES = {"default": dict(split=None, no_split_in_graph=False, tensor_cores=None),
         "deterministic": dict(split=256, no_split_in_graph=True, tensor_cores=True)}


_WORKSPACES: dict[str, torch.Tensor] = {}
# Wrappers stay alive for the whole process, as a server's do: FlashInfer 0.6.14 crashes (illegal address
# in BatchPrefillWithPagedKVCache) when a graph-mode tensor-core wrapper is planned after an earlier one
# was freed, even with no FreeKV code involved.
_KEEP: list = []


def workspace(name: str) -> torch.Tensor:
    """FlashInfer float workspaces live as long as the process, as SGLang's global one does (wrappers of
    earlier tests may still be referenced by FlashInfer's caches)."""
    if name not in _WORKSPACES:
        _WORKSPACES[name] = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    return _WORKSPACES[name]


def inner_backend(G: int, mode: dict):
    """The attributes of SGLang's FlashInferAttnBackend that FlashInferHeadAttention reads."""
    tc = G >= 4 if mode["tensor_cores"] is None else mode["tensor_cores"]
    return SimpleNamespace(workspace_buffer=workspace("freekv"),
                           indices_updater_decode=SimpleNamespace(data_type=BF, q_data_type=BF),
                           decode_use_tensor_cores=tc, disable_cuda_graph_kv_split=mode["no_split_in_graph"],
                           decode_split_tile_size=mode["split"])


def layer_of(i: int):
    return SimpleNamespace(layer_id=i, scaling=D ** -0.5, logit_cap=0.0, k_scale_float=None, v_scale_float=None)


class Dense:
    """SGLang's full-KV FlashInfer decode: each request's tokens in order, B requests of H heads."""

    def __init__(self, G: int, H: int, graph_bs: int | None, mode: dict):
        self.G, self.H, self.mode = G, H, mode
        ws = workspace("dense")
        kw = dict(use_tensor_cores=G >= 4 if mode["tensor_cores"] is None else mode["tensor_cores"])
        if graph_bs:
            self.indices = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
            kw.update(use_cuda_graph=True, paged_kv_indices_buffer=self.indices,
                      paged_kv_indptr_buffer=torch.zeros(graph_bs + 1, dtype=torch.int32, device="cuda"),
                      paged_kv_last_page_len_buffer=torch.ones(graph_bs, dtype=torch.int32, device="cuda"))
        self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kw)
        self.graph = bool(graph_bs)
        _KEEP.append(self)

    def __call__(self, q, ks, vs):
        lens = [k.shape[0] for k in ks]
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(lens).cumsum(0)
        idx = torch.arange(sum(lens), dtype=torch.int32, device="cuda")
        self.w.plan(indptr, idx, torch.ones(len(lens), dtype=torch.int32), self.G * self.H, self.H, D, 1,
                    data_type=BF, q_data_type=BF, fixed_split_size=None if self.graph else self.mode["split"],
                    disable_split_kv=self.graph and self.mode["no_split_in_graph"])
        kv = (torch.cat(ks)[:, None], torch.cat(vs)[:, None])
        return self.w.forward(q, kv, sm_scale=D ** -0.5, logits_soft_cap=0.0)


def setup(G, H, cfg, lens, bs, mode=MODES["default"]):
    from freekv_sglang.flashinfer_attention import FlashInferHeadAttention

    eng = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=bs, max_context=4096, dtype=BF,
                       device="cuda", backend="triton", pad_slot=0, dense_outside=True)
    fi = FlashInferHeadAttention(inner_backend(G, mode), cfg, H * G, H, D, eng.num_slots, torch.device("cuda"))
    _KEEP.append(fi)
    hist, slots = [], []
    for i, n in enumerate(lens):
        s = eng.add_request(i + 1)
        eng.begin_prefill(s, n)
        k, v = torch.randn(n, H, D, device="cuda", dtype=BF), torch.randn(n, H, D, device="cuda", dtype=BF)
        eng.prefill_layer(s, 1, k, v)
        hist.append([k, v])
        slots.append(s)
    return eng, fi, hist, slots


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("G,H", [(1, 4), (3, 3), (4, 2), (8, 1)])
def test_budget_covering_context_is_bit_identical_to_full_kv_flashinfer(G, H, graph, mode):
    p = 16 if G % 2 else 32
    cfg = FreeKVConfig(budget=96 * p, sink=p, window=2 * p, page_size=p, tau=0.8, dense_layers=1, selection="sketch")
    lens = [5, 3 * p + 1, 700, 1201, 33]
    bs = len(lens) + 1  # one padding row, as in a captured bucket
    eng, fi, hist, slots = setup(G, H, cfg, lens, bs, MODES[mode])
    dense = Dense(G, H, bs if graph else None, MODES[mode])
    for step in range(2 * p + 3):
        lens = [n + 1 for n in lens]
        eng.prepare_step(slots, pad_to=bs, lens=lens)
        fi.plan(lens + [1], graph=graph)
        plan = eng.plan(bs)
        q = torch.randn(bs, H * G, D, device="cuda", dtype=BF)
        k, v = torch.randn(bs, H, D, device="cuda", dtype=BF), torch.randn(bs, H, D, device="cuda", dtype=BF)
        o = eng.attend(plan, 1, q, k, v, attention=lambda *a: fi.attend(layer_of(1), *a))
        eng.end_step()
        for b in range(len(lens)):
            hist[b] = [torch.cat([hist[b][0], k[b:b + 1]]), torch.cat([hist[b][1], v[b:b + 1]])]
        # The plain server's batch holds the same padding row (one token) in graph mode.
        ks = [h[0] for h in hist] + [k[-1:]]
        vs = [h[1] for h in hist] + [v[-1:]]
        ref = dense(q, ks, vs)
        assert torch.equal(o[:len(lens)], ref[:len(lens)]), (step, (o - ref).abs().max().item())


def test_past_the_budget_it_matches_the_engine_kernel_and_replays_in_a_graph():
    G, H = 4, 2
    cfg = FreeKVConfig(budget=128, sink=32, window=64, page_size=32, tau=0.8, dense_layers=1, selection="sketch")
    lens, bs = [900, 1500, 333], 4
    eng, fi, hist, slots = setup(G, H, cfg, lens, bs)
    # A twin engine with the same history attends with its own split-K kernel.
    twin = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=bs, max_context=4096, dtype=BF,
                        device="cuda", backend="triton", pad_slot=0, dense_outside=True)
    for s, n, (k, v) in zip(slots, lens, hist):
        twin.add_request(s)
        twin.begin_prefill(s, n)
        twin.prefill_layer(s, 1, k, v)
    q = torch.zeros(bs, H * G, D, device="cuda", dtype=BF)
    k = torch.zeros(bs, H, D, device="cuda", dtype=BF)
    v = torch.zeros_like(k)

    def step(e, attention):
        out = e.attend(e.plan(bs), 1, q, k, v, attention=attention)
        e.end_step()
        return out

    run_fi = lambda *a: fi.attend(layer_of(1), *a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eng.prepare_step([], pad_to=bs)
        fi.plan([1] * bs, graph=True)
        step(eng, run_fi)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    eng.prepare_step([], pad_to=bs)
    fi.plan([1] * bs, graph=True)
    with torch.cuda.graph(graph):
        static_out = step(eng, run_fi)
    for _ in range(70):
        q.normal_(), k.normal_(), v.normal_()
        lens = [n + 1 for n in lens]
        twin.prepare_step(slots, pad_to=bs, lens=lens)
        ref = step(twin, None)
        eng.prepare_step(slots, pad_to=bs, lens=lens)
        fi.plan(lens + [1], graph=True)
        graph.replay()
        torch.testing.assert_close(static_out[:3], ref[:3], atol=2e-2, rtol=2e-2)
    assert math.isclose(eng.stats()["recall_bytes_now"], twin.stats()["recall_bytes_now"])
