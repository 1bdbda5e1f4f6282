"""--kv-prefill tsp without FreeKV (freekv_sglang.tsp_backend), on CPU: SGLang's real token pool, a duck-typed runner
and wrapped backend. The TSP layer picks FastKV's tokens, the later layers attend among them and store them at the
request's first token slots, and decode attends over exactly the compacted prompt then the decode tokens, writing each
step's K/V after them; the settings refuse what the mode cannot serve."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from freekv_kernels.tsp_select import naive_tsp_select
from freekv_sglang.server_args import (FreeKVArgsError, flag_values, freekv_parser, settings_from_values,
                                       tsp_alone_from_values, tsp_alone_problems)
from freekv_sglang.tsp_backend import TSPAttnBackend
from freekv_sglang.tsp_propagation import Propagation
from test_freekv_backend import Mode

L, HQ, H, D = 3, 6, 2, 16  # layer 1 is the TSP layer, layer 2 the later one
SLOTS, CTX, TOKENS, KEEP = 4, 256, 2048, 40
SCALE = 1 / math.sqrt(D)


class Inner:
    """The wrapped backend: writes each token's K/V at out_cache_loc, as SGLang's do; its outputs are not checked."""

    def __init__(self, pool):
        self.pool, self.calls = pool, []

    def init_forward_metadata(self, fb):
        pass

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("extend", layer.layer_id))
        self.pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, H, D), v.view(-1, H, D))
        return torch.zeros_like(q)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("decode", layer.layer_id))
        self.pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, H, D), v.view(-1, H, D))
        return torch.zeros_like(q)


def make_backend():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(TOKENS, page_size=1, dtype=torch.float32, head_num=H, head_dim=D, layer_num=L,
                            device="cpu", enable_memory_saver=False, start_layer=0, end_layer=L,
                            enable_alt_stream=False, enable_kv_cache_copy=False)
    req_to_token = torch.zeros(SLOTS + 1, CTX, dtype=torch.int32)
    for s in range(1, SLOTS + 1):  # disjoint, scattered token slots per request
        req_to_token[s] = torch.randperm(CTX)[:CTX].int() + 1 + (s - 1) * CTX
    runner = SimpleNamespace(
        model_config=SimpleNamespace(num_attention_heads=HQ, head_dim=D, get_num_kv_heads=lambda tp: H),
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), page_size=1,
        device="cpu", kv_cache_dtype=torch.float32, dtype=torch.float32, _freekv_tsp=Propagation())
    return TSPAttnBackend(runner, Inner(pool), tsp_layer=1, keep=KEEP), runner


KS, VS = 1.0, 1.0  # the layers' KV scales (test_..._decodes_over_them sets others)


def layer(i):
    scaled = (KS, VS) != (1.0, 1.0)  # a checkpoint's scales, as SGLang's layers hold them
    return SimpleNamespace(layer_id=i, scaling=SCALE, logit_cap=0.0, k_scale=torch.tensor(KS) if scaled else None,
                           v_scale=torch.tensor(VS) if scaled else None, k_scale_float=KS if scaled else None,
                           v_scale_float=VS if scaled else None)


def causal(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=SCALE * KS, enable_gqa=True)
    return o[0].transpose(0, 1) * VS


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.6, 1.7)], ids=["unscaled", "kv-scales"])
def test_tsp_alone_prefills_the_propagated_tokens_and_decodes_over_them(scales, monkeypatch):
    """The later layers' prefill and decode, with and without a checkpoint's KV scales (the logits times k_scale, the
    output times v_scale, as SGLang's kernels apply them)."""
    monkeypatch.setitem(globals(), "KS", scales[0])
    monkeypatch.setitem(globals(), "VS", scales[1])
    backend, runner = make_backend()
    rt, pool, g = runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool, torch.Generator().manual_seed(0)
    prompts = {1: 150, 3: 30}  # slot -> tokens; the second propagates whole
    n = sum(prompts.values())
    fb = SimpleNamespace(forward_mode=Mode(False), batch_size=2, seq_lens_cpu=torch.tensor(list(prompts.values())),
                         extend_prefix_lens_cpu=[0, 0], out_cache_loc=torch.cat([rt[s, :m] for s, m in prompts.items()]).long(),
                         _freekv_req_slots_cpu=torch.tensor(list(prompts)), _freekv_raw_bs=2,
                         _freekv_prefill_done_cpu=[True, True])
    backend.init_forward_metadata(fb)
    for i in range(2):
        q = torch.randn(n, HQ * D, generator=g)
        k = torch.randn(n, H, D, generator=g)
        backend.forward_extend(q, k.reshape(n, -1), torch.randn(n, H * D, generator=g), layer(i), fb)
    kept = [naive_tsp_select(q.view(n, HQ, D)[142:150], k[:150], KEEP, SCALE), torch.arange(30)]
    torch.testing.assert_close(backend.tsp.kept, torch.cat([kept[0], kept[1] + 150]), rtol=0, atol=0)
    m = [KEEP, 30]
    late_q = torch.randn(sum(m), HQ, D, generator=g)
    late_k, late_v = torch.randn(sum(m), H, D, generator=g), torch.randn(sum(m), H, D, generator=g)
    out = backend.forward_extend(late_q.reshape(sum(m), -1), late_k.reshape(sum(m), -1),
                                 late_v.reshape(sum(m), -1), layer(2), fb).view(-1, HQ, D)
    seqs = {}  # slot -> the later layer's K / V so far
    start = 0
    for (slot, _), mm in zip(prompts.items(), m):
        rows = slice(start, start + mm)
        torch.testing.assert_close(out[rows], causal(late_q[rows], late_k[rows], late_v[rows]))
        torch.testing.assert_close(pool.get_key_buffer(2)[rt[slot, :mm].long()], late_k[rows], rtol=0, atol=0)
        seqs[slot] = [late_k[rows], late_v[rows]]
        start += mm
    assert ("extend", 2) not in backend.inner.calls and backend._drop[1] == 150 - KEEP and backend._drop[3] == 0

    lens = dict(prompts)
    for step in range(6):
        bs = 3 if step % 2 else 2  # odd steps: a padded row (slot 0, length 1)
        for s in lens:
            lens[s] += 1
        slots = list(lens) + [0] * (bs - 2)
        fb = SimpleNamespace(forward_mode=Mode(True), batch_size=bs,
                             seq_lens_cpu=torch.tensor(list(lens.values()) + [1] * (bs - 2)),
                             seq_lens=torch.tensor(list(lens.values()) + [1] * (bs - 2)),
                             req_pool_indices=torch.tensor(slots), _freekv_req_slots_cpu=torch.tensor(slots),
                             _freekv_raw_bs=2, out_cache_loc=torch.tensor([int(rt[s, lens[s] - 1]) for s in lens]
                                                                          + [0] * (bs - 2)))
        backend.init_forward_metadata(fb)
        for i in range(L):
            q, k, v = (torch.randn(bs, HQ, D, generator=g), torch.randn(bs, H, D, generator=g),
                       torch.randn(bs, H, D, generator=g))
            out = backend.forward_decode(q.reshape(bs, -1), k.reshape(bs, -1), v.reshape(bs, -1), layer(i), fb)
            if i < 2:
                assert backend.inner.calls[-1] == ("decode", i)
                continue
            for b, s in enumerate(lens):
                seqs[s] = [torch.cat([seqs[s][0], k[b:b + 1]]), torch.cat([seqs[s][1], v[b:b + 1]])]
                kk, vv = seqs[s]
                want = F.scaled_dot_product_attention(q[b][:, None], kk.repeat_interleave(3, 1).transpose(0, 1),
                                                      vv.repeat_interleave(3, 1).transpose(0, 1),
                                                      scale=SCALE * KS)[:, 0] * VS
                torch.testing.assert_close(out.view(bs, HQ, D)[b], want)
                late_len = lens[s] - backend._drop[s]
                torch.testing.assert_close(pool.get_key_buffer(2)[rt[s, late_len - 1].long()], k[b], rtol=0, atol=0)


def test_tsp_alone_refuses_chunks_and_what_it_cannot_serve():
    backend, runner = make_backend()
    fb = SimpleNamespace(forward_mode=Mode(False), batch_size=1, seq_lens_cpu=torch.tensor([64]),
                         extend_prefix_lens_cpu=[32], out_cache_loc=torch.zeros(32, dtype=torch.long),
                         _freekv_req_slots_cpu=torch.tensor([1]), _freekv_raw_bs=1, _freekv_prefill_done_cpu=[True])
    with pytest.raises(RuntimeError, match="--chunked-prefill-size -1"):
        backend.init_forward_metadata(fb)

    def values(*argv):
        return flag_values(freekv_parser().parse_args(list(argv)))

    cfg = tsp_alone_from_values(values("--kv-prefill", "tsp", "--kv-tsp-layer", "9", "--kv-tsp-keep", "512"))
    assert (cfg.tsp_layer, cfg.tsp_keep) == (9, 512)
    assert settings_from_values(values("--kv-prefill", "tsp")) is None  # FreeKV itself stays off
    assert tsp_alone_from_values(values("--kv-retrieval", "freekv", "--kv-prefill", "tsp")) is None
    with pytest.raises(FreeKVArgsError, match="--kv-budget apply only to --kv-retrieval freekv"):
        tsp_alone_from_values(values("--kv-prefill", "tsp", "--kv-budget", "1024"))
    ok = SimpleNamespace(disable_radix_cache=True, chunked_prefill_size=-1, disable_prefill_cuda_graph=True,
                         tp_size=1, page_size=1, attention_backend="flashinfer")
    assert tsp_alone_problems(ok, cfg) == []
    bad = SimpleNamespace(**{**vars(ok), "page_size": 16, "attention_backend": "fa3", "enable_mixed_chunk": True,
                             "disable_radix_cache": False})
    problems = " | ".join(tsp_alone_problems(bad, cfg))
    for flag in ("--page-size 1", "--attention-backend is fa3", "--enable-mixed-chunk", "--disable-radix-cache"):
        assert flag in problems
