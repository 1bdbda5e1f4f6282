"""--kv-prefill tsp in the server, on CPU: the FreeKV backend picks the propagated tokens in the TSP layer, the later
layers attend over and store only those, and decoding matches FastKV's two engines (tsp_engines) fed the same
prompts directly; the decoder-layer wrappers carry only the propagated tokens past the TSP layer."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from freekv_kernels.tsp_select import naive_tsp_select
from freekv_sglang.engine import ModelShape, merged_stats, tsp_engines
from freekv_sglang.tsp_propagation import Propagation, install

from test_freekv_backend import CFG, CTX, D, H, HQ, L, Request, daemon, decode_batch, extend_batch, layers, \
    make_backend  # noqa: F401 (daemon: the module's fixture)
from freekv_sglang.sglang_backend import on_request_freed

TSP = dataclasses.replace(CFG, prefill="tsp", tsp_layer=1, tsp_keep=100)  # layer 0 dense, 1 the TSP layer, 2 later


def causal(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=1 / math.sqrt(D), enable_gqa=True)
    return o[0].transpose(0, 1)


def tsp_prefill(backend, reqs, g):
    """One extend batch of whole prompts through every layer; returns each prompt's propagated positions, the later
    layer's K/V of them and its last query there."""
    fb, _ = extend_batch(reqs, 10_000)
    backend.init_forward_metadata(fb)
    n = sum(r.prompt for r in reqs)
    lay = layers()
    for layer in lay[:2]:
        q = torch.randn(n, HQ * D, generator=g)
        ends = torch.tensor([r.prompt for r in reqs]).cumsum(0) - 1
        for r, end in zip(reqs, ends.tolist()):  # each prompt's last query, for the reference's prefill_layer
            r.q[layer.layer_id][-1] = q[end].view(HQ, D)
        k = torch.cat([r.k[layer.layer_id] for r in reqs])
        v = torch.cat([r.v[layer.layer_id] for r in reqs])
        backend.forward_extend(q, k.reshape(n, -1), v.reshape(n, -1), layer, fb)
    state = backend.tsp
    kept, start = [], 0
    for r in reqs:  # the pick: FastKV's, from the TSP layer's last queries over each prompt's keys
        if r.prompt > TSP.tsp_keep:
            kept.append(naive_tsp_select(q.view(n, HQ, D)[start + r.prompt - 8:start + r.prompt], r.k[1],
                                         TSP.tsp_keep, 1 / math.sqrt(D)))
        else:
            kept.append(torch.arange(r.prompt))
        start += r.prompt
    offsets = torch.tensor([0] + [r.prompt for r in reqs]).cumsum(0)
    torch.testing.assert_close(state.kept, torch.cat([k + o for k, o in zip(kept, offsets)]), rtol=0, atol=0)
    assert state.tokens == n
    late_k = [r.k[2][idx] for r, idx in zip(reqs, kept)]
    late_v = [r.v[2][idx] for r, idx in zip(reqs, kept)]
    m = sum(len(idx) for idx in kept)
    q = torch.randn(m, HQ * D, generator=g)
    out = backend.forward_extend(q, torch.cat(late_k).reshape(m, -1), torch.cat(late_v).reshape(m, -1), lay[2], fb)
    start, late_q = 0, []
    for kk, vv in zip(late_k, late_v):  # each prompt's propagated tokens attend causally among themselves
        rows = slice(start, start + len(kk))
        torch.testing.assert_close(out[rows].view(-1, HQ, D), causal(q[rows].view(-1, HQ, D), kk, vv))
        late_q.append(q[start + len(kk) - 1].view(HQ, D))  # the last propagated token's: the prompt's last
        start += len(kk)
    for r in reqs:
        r.n = r.prompt
    return kept, late_k, late_v, late_q


def test_tsp_prefill_propagates_then_decodes_like_fastkvs_two_engines(daemon):
    backend, runner = make_backend(daemon, cfg=TSP, tsp=Propagation())
    g = torch.Generator().manual_seed(0)
    reqs = [Request(runner, 3, 150), Request(runner, 5, 30)]  # the second propagates whole
    kept, late_k, late_v, late_q = tsp_prefill(backend, reqs, g)
    assert [len(x) for x in kept] == [TSP.tsp_keep, 30]
    assert backend.engine.seq_len(3) == 150 and backend.late.seq_len(3) == TSP.tsp_keep
    assert runner.token_to_kv_pool.staging.free_pages == 40  # the prompts completed: staging released

    early, late = tsp_engines(TSP, ModelShape(L, HQ, H, D), max_requests=2, max_context=CTX, dtype=torch.float32,
                              device="cpu", backend="torch")
    slots = []
    for r, kk, vv, ql in zip(reqs, late_k, late_v, late_q):
        s = early.add_request()
        late.add_request(s)
        early.begin_prefill(s, r.prompt)
        for layer in range(2):
            early.prefill_layer(s, layer, r.k[layer], r.v[layer], r.q[layer][-1])
        late.begin_prefill(s, len(kk))
        late.prefill_layer(s, 0, kk, vv, ql)
        slots.append(s)
    early.fill_slots(slots)  # as the backend fills the first engine's slots from staging, the later one's from the host
    late.fill_slots(slots)
    for mine, ref in ((backend.engine, early), (backend.late, late)):  # the same pages and last queries, both engines
        assert (ref.slot_table[:, slots] >= 0).any()
        assert torch.equal(mine.slot_table[:, [3, 5]], ref.slot_table[:, slots])
        assert torch.equal(mine.prev_q[:, [3, 5]], ref.prev_q[:, slots])
    lay = layers()
    for step in range(24):
        fb = decode_batch(reqs, pad_to=4 if step % 2 else None)
        backend.init_forward_metadata(fb)
        plans = early.begin_step(slots), late.begin_step(slots)
        for layer in lay:
            bs = fb.batch_size
            q, k, v = torch.randn(bs, HQ * D, generator=g), torch.randn(bs, H * D, generator=g), \
                torch.randn(bs, H * D, generator=g)
            out = backend.forward_decode(q, k, v, layer, fb)
            if layer.layer_id == 0:
                continue  # dense: SGLang's
            eng, plan, local = (early, plans[0], 1) if layer.layer_id == 1 else (late, plans[1], 0)
            want = eng.attend(plan, local, q[:2].view(2, HQ, D), k[:2].view(2, H, D), v[:2].view(2, H, D))
            torch.testing.assert_close(out[:2], want.reshape(2, HQ * D), atol=1e-6, rtol=1e-6)
        early.end_step()
        late.end_step()
    assert backend.late.seq_len(3) == TSP.tsp_keep + 24 and backend.engine.seq_len(3) == 150 + 24
    # Both engines' sparse layers, by model layer.
    assert set(merged_stats(backend._snapshots())["correction_rate"]) == {1, 2}

    on_request_freed(3)  # both engines let the slot go; a new prompt in it propagates afresh
    fb = decode_batch(reqs[1:])
    backend.init_forward_metadata(fb)
    assert not backend.engine.is_active(3) and not backend.late.is_active(3) and 3 not in backend._tsp_drop
    for layer in lay:
        backend.forward_decode(torch.randn(1, HQ * D), torch.randn(1, H * D), torch.randn(1, H * D), layer, fb)
    new = Request(runner, 3, 130)
    tsp_prefill(backend, [new], g)
    assert backend.late.seq_len(3) == TSP.tsp_keep and backend._tsp_drop[3] == 130 - TSP.tsp_keep


def test_tsp_refuses_a_chunked_prompt_and_a_missing_layer_hook(daemon):
    backend, runner = make_backend(daemon, cfg=TSP, tsp=Propagation())
    fb, _ = extend_batch([Request(runner, 2, 100)], 64)
    with pytest.raises(RuntimeError, match="--chunked-prefill-size -1"):
        backend.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="decoder layers are not wrapped"):
        make_backend(daemon, cfg=TSP)


class ToyLayer(torch.nn.Module):
    """SGLang's decoder-layer call; the TSP layer's 'attention' picks rows 1 and 3 of each forward."""

    def __init__(self, state=None):
        super().__init__()
        self.state, self.seen = state, []

    def forward(self, positions, hidden_states, forward_batch, residual):
        self.seen.append((positions.clone(), hidden_states.shape[0]))
        if self.state is not None and forward_batch == "extend":
            self.state.pick(torch.tensor([1, 3]), hidden_states.shape[0])
        r = hidden_states if residual is None else residual
        return hidden_states + positions[:, None].float(), r + 1


def test_layer_wrappers_carry_only_the_propagated_tokens():
    state = Propagation()
    stack = torch.nn.ModuleList([ToyLayer(), ToyLayer(state), ToyLayer(), ToyLayer()])
    install(stack, 1, state)
    pos, h = torch.arange(5), torch.zeros(5, 2)
    res = None
    for layer in stack:
        h, res = layer(pos, h, "extend", res)
    assert [n for _, n in (s.seen[-1] for s in stack)] == [5, 5, 2, 2]
    assert stack[2].seen[-1][0].tolist() == [1, 3]  # later layers see the propagated tokens' own positions
    assert h.shape == (5, 2) and h[[0, 2, 4]].abs().sum() == 0  # scattered back; dropped rows are zero
    assert h[:, 0].tolist() == [0, 4, 0, 12, 0] and state.kept is None  # 4 layers of +position, cleared after
    h, res = torch.zeros(3, 2), None
    for layer in stack:  # decode (no pick): every layer sees every row
        h, res = layer(torch.arange(3), h, "decode", res)
    assert [s.seen[-1][1] for s in stack] == [3, 3, 3, 3]
    with pytest.raises(RuntimeError, match="already wrapped"):
        install(stack, 1, state)
    with pytest.raises(ValueError, match="leaves no later layer"):
        install(torch.nn.ModuleList([ToyLayer(), ToyLayer()]), 1, state)
