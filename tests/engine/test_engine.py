"""The engine against an independent simulation of FreeKV over the full token history.

The oracle keeps every token's K/V, builds page summaries from them, selects with plain torch and
attends over sink + selected + window tokens with a softmax written out by hand. The engine must match
it step by step: that covers layout, offload, recall, speculation and correction together.
"""

from __future__ import annotations

import math

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_kernels.page_rerank import dequantize_keys, quantize_keys, sketch_bytes
from freekv_kernels.token_index import head_token_index, naive_head_token_index
from freekv_sglang.layout import head_indptr, row_tokens
from freekv_kernels.testing import device

D = 16  # below the default channel sketch's 32 channels: these tests select with the sketch unless they name one
DEV = device()


def attend_ref(q, K, V, tokens_per_head, G, scale):
    """q [Hq, D]; K, V [n, H, D]; tokens_per_head[h]: token indices attended by KV head h."""
    out = torch.empty_like(q)
    for hq in range(q.shape[0]):
        idx = torch.tensor(tokens_per_head[hq // G], dtype=torch.long)
        k, v = K[idx, hq // G].double(), V[idx, hq // G].double()
        w = torch.softmax(k @ q[hq].double() * scale, dim=0)
        out[hq] = (w @ v).to(q.dtype)
    return out


class Oracle:
    """FreeKV semantics for one request in one sparse layer, from the full history."""

    def __init__(self, cfg: FreeKVConfig, H: int, G: int, tau: float):
        self.cfg, self.H, self.G, self.tau = cfg, H, G, tau
        self.K = torch.empty(0, H, D)
        self.V = torch.empty(0, H, D)
        self.prev_q = None
        self.slots = [[-1] * cfg.select_pages for _ in range(H)]  # logical page per slot, per head

    def pages(self, n):
        p, c = self.cfg.page_size, (n - 1) // self.cfg.page_size
        n_s, n_w = self.cfg.sink_pages, self.cfg.window_pages
        sink = list(range(min(n_s, c + 1)))
        window = list(range(max(n_s, c - n_w), c + 1))
        cands = list(range(n_s, max(n_s, c - n_w)))
        return sink, window, cands, p

    def select(self, q, cands, p):
        """The top-k pages of scores(), per head, the resident pages' scores times (1 + hysteresis)."""
        k = self.cfg.select_pages
        sel = []
        for h, score in enumerate(self.scores(q, cands, p)):
            held = torch.tensor([j in self.slots[h] for j in cands], dtype=torch.bool)
            score = torch.where(held, score * (1 + self.cfg.selection_hysteresis), score)
            top = torch.topk(score, min(k, len(cands))).indices.tolist()
            sel.append([cands[i] for i in top if score[i] > float("-inf")])
        return sel

    def scores(self, q, cands, p):
        """Per head, the candidates' scores by the configured selection: MeanS, Quest, or the pages scored with
        decoded 2-bit key codes (log-sum-exp per query head, softmax over them, group mean): all, or the best
        rerank_factor * k of the same scores with mid-range keys but on the sketch's channels (the group's largest
        |q| code bytes); or (sketch) those sketch scores alone."""
        how = self.cfg.selection
        if not cands:
            return [torch.empty(0, dtype=torch.float64) for _ in range(self.H)]
        kp = torch.stack([self.K[j * p:(j + 1) * p] for j in cands])  # [C, p, H, D]
        kmin, kmax = kp.amin(1).double(), kp.amax(1).double()  # [C, H, D]

        def code_mass(qs, keys, top):  # [G, D], [C, p, D] decoded -> group mean of softmax over `top`
            lse = torch.logsumexp(torch.einsum("gd,ctd->gct", qs, keys[top]) / math.sqrt(D), dim=-1)
            score = torch.full((len(cands),), float("-inf"), dtype=torch.float64)
            score[top] = torch.softmax(lse, dim=-1).mean(0)
            return score

        out = []
        for h in range(self.H):
            qs = q[h * self.G:(h + 1) * self.G].double()  # [G, D]
            s = torch.maximum(qs[:, None] * kmin[None, :, h], qs[:, None] * kmax[None, :, h]).sum(-1) / math.sqrt(D)
            score = s.max(0).values if how == "quest" else torch.softmax(s, dim=1).mean(0)
            if how in ("rerank", "sketch"):
                keys = dequantize_keys(quantize_keys(kp[:, :, h], kmin[:, h], kmax[:, h]), kmin[:, h],
                                       kmax[:, h]).double()  # [C, p, D]
                top = torch.arange(len(cands))
                if self.cfg.rerank_factor or how == "sketch":
                    byte = sketch_bytes(qs[None], self.cfg.sketch_bytes(D))[0]
                    ch = (byte[:, None] * 4 + torch.arange(4)).flatten()
                    mixed = ((kmin[:, h] + kmax[:, h]) / 2)[:, None].repeat(1, p, 1)  # mid-range, codes on ch
                    mixed[..., ch] = keys[..., ch]
                    sketch = code_mass(qs, mixed, top)
                    top = torch.topk(sketch, min(self.cfg.rerank_pages, len(cands))).indices
                score = sketch if how == "sketch" else code_mass(qs, keys, top)
            out.append(score)
        return out

    def flags(self, q):
        if self.tau >= 1 or self.prev_q is None:
            return [True] * self.H
        if self.tau <= 0:
            return [False] * self.H
        cos = torch.nn.functional.cosine_similarity(q.double(), self.prev_q.double(), dim=-1)
        return [bool(cos[h * self.G:(h + 1) * self.G].mean() < self.tau) for h in range(self.H)]

    def prefill(self, K, V, q_last):
        self.K, self.V, self.prev_q = K, V, q_last

    def step(self, q, k, v):
        self.K, self.V = torch.cat([self.K, k[None]]), torch.cat([self.V, v[None]])
        n = self.K.shape[0]
        sink, window, cands, p = self.pages(n)
        flags = self.flags(q)
        sel = self.select(q, cands, p)
        attended = []
        for h in range(self.H):
            old, new = self.slots[h], set(sel[h])
            kept = [s if s in new else None for s in old]
            incoming = [j for j in sel[h] if j not in old]
            new_slots = []
            for s, o in enumerate(old):
                new_slots.append(o if o in new else (incoming.pop(0) if incoming else -1))
            # a head sees q_i's selection if flagged; otherwise its old slots, except that empty slots are
            # filled before attention
            seen = new_slots if flags[h] else [o if o >= 0 else ns for o, ns in zip(old, new_slots)]
            del kept
            self.slots[h] = new_slots
            pages = sink + [j for j in seen if j >= 0] + window
            attended.append([t for j in pages for t in range(j * p, min((j + 1) * p, n))])
        self.prev_q = q
        return attended, flags


def make_engine(cfg, H, G, L, max_requests=4, max_context=2048, method="freekv", backend="torch"):
    shape = ModelShape(num_layers=L, num_q_heads=H * G, num_kv_heads=H, head_dim=D)
    return FreeKVEngine(cfg, shape, max_requests=max_requests, max_context=max_context, dtype=torch.float32,
                        device=DEV, backend=backend, method=method)


def drift(prev, n_heads):
    """Queries that drift from the previous one by a random amount: cosines spread over (-1, 1)."""
    a = torch.rand(prev.shape[0], n_heads, 1)
    return a * prev + (1 - a) * torch.randn_like(prev)


def run_and_check(cfg, H, G, prompt_lens, steps, L=3, backend="torch", atol=1e-5, expect_dense=False,
                  attention=None, oracle_tau=None):
    """Prefill each prompt, decode `steps` batched steps, compare every layer with the oracle (correcting by
    oracle_tau, default cfg.tau)."""
    eng = make_engine(cfg, H, G, L, backend=backend)
    scale = 1 / math.sqrt(D)
    reqs = []
    for n in prompt_lens:
        slot = eng.add_request()
        eng.begin_prefill(slot, n)
        oracles = []
        for layer in range(L):
            K, V, q = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(H * G, D)
            eng.prefill_layer(slot, layer, K.to(DEV), V.to(DEV), q.to(DEV))
            o = Oracle(cfg, H, G, cfg.tau if oracle_tau is None else oracle_tau)
            o.prefill(K, V, q)
            oracles.append(o)
        reqs.append((slot, oracles))
    all_flags = []
    for _ in range(steps):
        plan = eng.begin_step([s for s, _ in reqs])
        for layer in range(L):
            q = drift(torch.stack([o[layer].prev_q for _, o in reqs]), H * G)
            k, v = torch.randn(len(reqs), H, D), torch.randn(len(reqs), H, D)
            out = eng.attend(plan, layer, q.to(DEV), k.to(DEV), v.to(DEV), attention=attention).cpu()
            for b, (_, oracles) in enumerate(reqs):
                o = oracles[layer]
                attended, flags = o.step(q[b], k[b], v[b])
                if layer < cfg.dense_layers:
                    n = o.K.shape[0]
                    attended = [list(range(n))] * H
                else:
                    all_flags.append(flags)
                if expect_dense:
                    assert all(sorted(a) == list(range(o.K.shape[0])) for a in attended)
                ref = attend_ref(q[b], o.K, o.V, attended, G, scale)
                torch.testing.assert_close(out[b], ref, atol=atol, rtol=atol)
        eng.end_step()
    return eng, all_flags


@pytest.mark.parametrize("G", [1, 3, 4])
def test_budget_covering_context_equals_dense(G):
    cfg = FreeKVConfig(selection="sketch", budget=512, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1)
    eng, _ = run_and_check(cfg, H=2, G=G, prompt_lens=[37, 100, 16], steps=40, expect_dense=True)
    assert eng.stats()["steps"] == 40


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0])
def test_speculation_and_correction_match_oracle(tau):
    # No hysteresis: on random keys it keeps nearly every resident page, and this test needs speculative recalls.
    cfg = FreeKVConfig(selection="sketch", budget=48, sink=16, window=32, page_size=16, tau=tau, dense_layers=1,
                       hysteresis=0.0)
    eng, flags = run_and_check(cfg, H=2, G=3, prompt_lens=[200, 131], steps=36)
    rate = sum(map(sum, flags)) / sum(map(len, flags))
    if tau == 1.0:
        assert rate == 1.0
    elif tau == 0.0:
        assert rate == 0.0
    else:
        assert 0.05 < rate < 0.95
    st = eng.stats()
    engine_rate = sum(st["correction_rate"].values()) / len(st["correction_rate"])
    assert abs(engine_rate - rate) < 1e-9
    assert st["recall_bytes_now"] > 0
    assert (st["recall_bytes_speculative"] > 0) == (tau < 1.0)
    assert st["recall_page_bytes"] == 2 * 16 * D * 4  # K and V of one head's 16-token fp32 page
    assert st["recall_bytes_now"] % st["recall_page_bytes"] == 0
    assert st["recall_bytes_speculative"] % st["recall_page_bytes"] == 0


def test_a_stats_snapshot_keeps_its_counts_while_the_engine_runs_on():
    """stats_snapshot() copies the counters (a server logs it a step or two later instead of a host sync): steps run
    after it leave it as it was, reading what stats() read when it was taken."""
    cfg = FreeKVConfig(selection="sketch", budget=48, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1,
                       hysteresis=0.0)
    eng, _ = run_and_check(cfg, H=2, G=3, prompt_lens=[200, 131], steps=6)
    snap, then = eng.stats_snapshot(), eng.stats()
    slots = [s for s in range(eng.num_slots) if eng.is_active(s)]
    for _ in range(3):
        plan = eng.begin_step(slots)
        for layer in range(3):
            q, k, v = torch.randn(2, 6, D), torch.randn(2, 2, D), torch.randn(2, 2, D)
            eng.attend(plan, layer, q.to(DEV), k.to(DEV), v.to(DEV))
        eng.end_step()
    now = eng.stats()
    assert snap.ready() and snap.stats() == then
    assert (then["steps"], now["steps"]) == (6, 9) and now["flagged"] > then["flagged"]


@pytest.mark.parametrize("selection", ["sketch", "means"])
def test_hysteresis_matches_oracle_and_recalls_less(selection):
    """With hysteresis the engine attends what the oracle's top-k with boosted resident pages picks, every step and
    layer, and recalls fewer pages than the plain top-k on the same inputs."""
    stats = []
    for hyst in (0.0, 1.0):
        torch.manual_seed(21)
        cfg = FreeKVConfig(budget=48, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1, selection=selection,
                           hysteresis=hyst)
        eng, _ = run_and_check(cfg, H=2, G=3, prompt_lens=[300, 181], steps=24)
        stats.append(eng.stats())
    plain, kept = (s["recall_bytes_now"] + s["recall_bytes_speculative"] for s in stats)
    assert 0 < kept < plain


@pytest.mark.parametrize("victim", [16, 64])
def test_victim_cache_matches_oracle_and_recalls_less(victim):
    """A victim cache changes where a returning page comes from, never what is attended: with it the engine still
    matches the oracle every step and layer, puts the same pages into slots as without it, and takes some of them
    from the GPU instead of the host. (The Triton engine equals this one: test_triton_backend_equals_torch_backend.)"""
    stats = []
    for v in (0, victim):
        torch.manual_seed(23)
        cfg = FreeKVConfig(selection="means", budget=48, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1,
                           hysteresis=0.0, victim=v)
        eng, _ = run_and_check(cfg, H=2, G=3, prompt_lens=[300, 181], steps=24)
        stats.append(eng.stats())
    plain, cached = stats
    placed = [s["recall_pages_now"] + s["recall_pages_speculative"] + s["victim_hits_now"] +
              s["victim_hits_speculative"] for s in stats]
    assert placed[0] == placed[1] and plain["victim_hits_now"] == plain["victim_hits_speculative"] == 0
    assert cached["victim_hits_now"] > 0 and cached["victim_hits_speculative"] > 0
    hits = cached["victim_hits_now"] + cached["victim_hits_speculative"]
    host = [s["recall_bytes_now"] + s["recall_bytes_speculative"] for s in stats]
    assert host[1] == host[0] - hits * cached["recall_page_bytes"]


def test_victim_cache_forgets_a_removed_request():
    """A request slot taken again starts with an empty victim cache in every layer."""
    cfg = FreeKVConfig(selection="means", budget=48, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1,
                       hysteresis=0.0, victim=32)
    eng, _ = run_and_check(cfg, H=2, G=3, prompt_lens=[300], steps=16)
    assert any((t >= 0).any() for t in eng.victims if t is not None)
    slot = 0
    eng.remove_request(slot)
    assert all((t[slot] == -1).all() for t in eng.victims if t is not None)
    assert all((t[slot] == -1).all() for t in eng._victim_age if t is not None)


@pytest.mark.parametrize("selection", ["rerank", "sketch", "means"])
def test_tau_one_selects_with_current_query(selection):
    """tau=1, no hysteresis: after every step the slots of each head hold the top-k of the current query: the
    reference's, up to pages whose reference scores lie within 1% of each other (the kernels score from fp16-rounded
    keys and query, the reference in float64: random pages a few 1e-4 apart can swap places)."""
    torch.manual_seed(11)
    cfg = FreeKVConfig(budget=48, sink=16, window=32, page_size=16, tau=1.0, dense_layers=0, selection=selection,
                       hysteresis=0.0)
    eng = make_engine(cfg, H=2, G=4, L=1)
    slot = eng.add_request()
    n = 300
    eng.begin_prefill(slot, n)
    K, V = torch.randn(n, 2, D), torch.randn(n, 2, D)
    eng.prefill_layer(slot, 0, K.to(DEV), V.to(DEV), torch.randn(8, D, device=DEV))
    o = Oracle(cfg, 2, 4, 1.0)
    o.prefill(K, V, None)
    for _ in range(10):
        plan = eng.begin_step([slot])
        q, k, v = torch.randn(1, 8, D), torch.randn(1, 2, D), torch.randn(1, 2, D)
        eng.attend(plan, 0, q.to(DEV), k.to(DEV), v.to(DEV))
        eng.end_step()
        o.K, o.V = torch.cat([o.K, k]), torch.cat([o.V, v])
        _, _, cands, p = o.pages(o.K.shape[0])
        want = o.select(q[0], cands, p)
        got = eng.slot_table[0, slot]
        for h, score in enumerate(o.scores(q[0], cands, p)):
            held = set(got[h].tolist()) - {-1}
            assert len(held) == len(want[h])
            chosen = torch.tensor([i in held for i in cands])
            if not chosen.all():
                assert score[chosen].min() >= score[~chosen].max() * (1 - 1e-2), (sorted(held), sorted(want[h]))


def test_batch_equals_each_request_alone():
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1)
    H, G, L, lens, steps = 2, 3, 2, [90, 161, 47], 20
    torch.manual_seed(1)
    prompts = [[(torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV), torch.randn(H * G, D, device=DEV))
                for _ in range(L)] for n in lens]
    inputs = [[[(torch.randn(H * G, D, device=DEV), torch.randn(H, D, device=DEV), torch.randn(H, D, device=DEV))
                for _ in range(L)] for _ in lens] for _ in range(steps)]

    def run(which):
        eng = make_engine(cfg, H, G, L)
        slots = []
        for i in which:
            s = eng.add_request()
            eng.begin_prefill(s, lens[i])
            for layer in range(L):
                eng.prefill_layer(s, layer, *prompts[i][layer])
            slots.append(s)
        outs = []
        for t in range(steps):
            plan = eng.begin_step(slots)
            per_layer = []
            for layer in range(L):
                q, k, v = (torch.stack([inputs[t][i][layer][x] for i in which]) for x in range(3))
                per_layer.append(eng.attend(plan, layer, q, k, v))
            eng.end_step()
            outs.append(per_layer)
        return outs

    together = run([0, 1, 2])
    for b, i in enumerate([0, 1, 2]):
        alone = run([i])
        for t in range(steps):
            for layer in range(L):
                torch.testing.assert_close(together[t][layer][b], alone[t][layer][0], atol=1e-6, rtol=1e-6)


def test_leave_and_join_reuse_slots_cleanly():
    """A request joining a slot another request left behaves exactly like one in a fresh engine."""
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16, tau=0.7, dense_layers=1)
    H, G, L = 2, 4, 2
    eng = make_engine(cfg, H, G, L, max_requests=2)
    fresh = make_engine(cfg, H, G, L, max_requests=2)

    def prefill(e, n, data):
        s = e.add_request()
        e.begin_prefill(s, n)
        for layer in range(L):
            e.prefill_layer(s, layer, *data[layer])
        return s

    def data(n):
        return [(torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV), torch.randn(H * G, D, device=DEV))
                for _ in range(L)]

    a, b = prefill(eng, 150, data(150)), prefill(eng, 70, data(70))
    for _ in range(12):
        plan = eng.begin_step([a, b])
        for layer in range(L):
            eng.attend(plan, layer, torch.randn(2, H * G, D, device=DEV), torch.randn(2, H, D, device=DEV),
                       torch.randn(2, H, D, device=DEV))
        eng.end_step()
    free_before = eng.host.free_pages
    eng.remove_request(a)
    assert eng.host.free_pages > free_before
    c_data = data(120)
    c = prefill(eng, 120, c_data)
    assert c == a  # the slot is reused
    c_alone = prefill(fresh, 120, c_data)
    for _ in range(12):
        plan, plan_f = eng.begin_step([b, c]), fresh.begin_step([c_alone])
        for layer in range(L):
            q, k, v = torch.randn(H * G, D, device=DEV), torch.randn(H, D, device=DEV), torch.randn(H, D, device=DEV)
            out = eng.attend(plan, layer, torch.stack([torch.randn_like(q), q]),
                             torch.stack([torch.randn_like(k), k]), torch.stack([torch.randn_like(v), v]))
            ref = fresh.attend(plan_f, layer, q[None], k[None], v[None])
            torch.testing.assert_close(out[1], ref[0], atol=1e-6, rtol=1e-6)
        eng.end_step()
        fresh.end_step()


def test_bad_usage_is_refused():
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16)
    eng = make_engine(cfg, 2, 2, 2, max_requests=1, max_context=64)
    s = eng.add_request()
    with pytest.raises(RuntimeError, match="slots are in use"):
        eng.add_request()
    with pytest.raises(ValueError, match="no prompt"):
        eng.begin_step([s])
    with pytest.raises(ValueError, match="does not fit"):
        eng.begin_prefill(s, 64)
    with pytest.raises(ValueError, match="not in use"):
        eng.begin_step([3])
    with pytest.raises(ValueError, match="method"):
        make_engine(cfg, 2, 2, 2, method="bogus")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU side is test_cuda_graph.py's step timing test")
def test_step_timing_needs_a_gpu():
    eng = make_engine(FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16), 2, 2, 2)
    assert eng.enable_step_timing() is False and eng.step_times() is None


def test_step_timer_samples_layers_over_the_depth():
    from freekv_sglang.streams import StepTimer

    t = StepTimer(list(range(1, 32)), 4)  # Llama-3.1-8B: 31 sparse layers, the server's 4 timed
    assert t.layers == {4, 12, 20, 28} and t.scale == 31 / 4
    t = StepTimer([1, 2, 3], None)
    assert t.layers == {1, 2, 3} and t.scale == 1
    assert StepTimer([1, 2, 3], 8).layers == {1, 2, 3}


@pytest.mark.slow
@pytest.mark.parametrize("tau", [0.6])
def test_triton_kernels_match_oracle(tau):
    """The same oracle check with every op from the Triton kernels (interpreter on CPU, CUDA on GPU). Taus 0 and 1
    under Triton: test_replayed_correction_rate_overrides_tau (the same decode with every head, or none, flagged)."""
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16, tau=tau, dense_layers=1)
    run_and_check(cfg, H=2, G=4, prompt_lens=[90, 37], steps=8, L=2, backend="triton", atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_attention_matches_oracle(backend):
    """--kv-attention fused (attend_pages, one launch after the recall before attention): the oracle's attention at
    every step, with corrections before attention (tau 0.6) and rows of unequal length."""
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1,
                       attention="fused")
    run_and_check(cfg, H=2, G=4, prompt_lens=[90, 37], steps=6, L=2, backend=backend, atol=1e-4)


@pytest.mark.parametrize("attention", ["fused", "split"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_own_attention_applies_kv_scales(attention, backend):
    """A checkpoint's KV scales reach the engine's own attention as SGLang's decode kernels apply them: with a budget
    covering the context, attend(q, kv_scale=(ks, vs)) is attend(q * ks) * vs (scoring aside, every page is
    attended either way)."""
    cfg = FreeKVConfig(selection="sketch", budget=64, sink=16, window=16, page_size=16, tau=0.6, attention=attention)
    H, G, L, ks, vs = 2, 3, 2, 0.37, 1.9
    engines = [make_engine(cfg, H, G, L, backend=backend) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    slots = []
    for eng in engines:
        torch.manual_seed(3)
        slot = eng.add_request()
        eng.begin_prefill(slot, 60)
        for layer in range(L):
            eng.prefill_layer(slot, layer, *(torch.randn(60, H, D).to(DEV) for _ in range(2)),
                              torch.randn(H * G, D).to(DEV))
        slots.append(slot)
    for _ in range(3):
        plans = [eng.begin_step([s]) for eng, s in zip(engines, slots)]
        for layer in range(1, L):  # layer 0 is dense
            q, k, v = (torch.randn(1, n, D, generator=gen).to(DEV) for n in (H * G, H, H))
            scaled = engines[0].attend(plans[0], layer, q, k, v, kv_scale=(ks, vs))
            plain = engines[1].attend(plans[1], layer, q * ks, k, v)
            assert scaled.isfinite().all()
            torch.testing.assert_close(scaled, plain * vs, atol=1e-5, rtol=1e-4)
        for eng in engines:
            eng.end_step()


def test_framework_slots_padding_and_outside_dense_layers():
    """SGLang's usage: its own slot ids (req_pool_idx), row 0 for padding, dense layers run elsewhere,
    lengths given by the caller; a padded batch must not disturb the real rows."""
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1)
    H, G, L = 2, 3, 2
    shape = ModelShape(num_layers=L, num_q_heads=H * G, num_kv_heads=H, head_dim=D)
    eng = FreeKVEngine(cfg, shape, max_requests=6, max_context=512, dtype=torch.float32, device=DEV,
                       backend="torch", pad_slot=0, dense_outside=True)
    assert eng.k_cache[0].numel() == 0  # no dense pool
    ref = make_engine(cfg, H, G, L, max_requests=2)
    slots, ref_slots, lens = [4, 2], [], [130, 75]
    for s, n in zip(slots, lens):
        eng.add_request(s)
        eng.begin_prefill(s, n)
        r = ref.add_request()
        ref.begin_prefill(r, n)
        ref_slots.append(r)
        for layer in range(L):
            k, v = torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV)
            ref.prefill_layer(r, layer, k, v, None)
            if layer:
                eng.prefill_layer(s, layer, k, v)
    with pytest.raises(ValueError, match="in use"):
        eng.add_request(4)
    with pytest.raises(ValueError, match="served outside"):
        eng.prefill_layer(4, 0, torch.zeros(130, H, D, device=DEV), torch.zeros(130, H, D, device=DEV))
    for step in range(1, 25):
        eng.prepare_step(slots, pad_to=4, lens=[n + step for n in lens])
        plan = eng.plan(4)
        ref_plan = ref.begin_step(ref_slots)
        q = torch.randn(4, H * G, D, device=DEV)
        k, v = torch.randn(4, H, D, device=DEV), torch.randn(4, H, D, device=DEV)
        ref.attend(ref_plan, 0, q[:2], k[:2], v[:2])
        out = eng.attend(plan, 1, q, k, v)
        torch.testing.assert_close(out[:2], ref.attend(ref_plan, 1, q[:2], k[:2], v[:2]), atol=1e-6, rtol=1e-6)
        eng.end_step()
        ref.end_step()
    with pytest.raises(ValueError, match="caller says"):
        eng.prepare_step(slots, lens=[1, 1])


def head_major_attention(cfg, H, G, order_log=None, triton_lists=True):
    """An outside attention kernel as SGLang's FlashInfer path uses it: every (row, KV head) is a request
    with one KV head over the flat token list of head_token_index (written by the first call, as the engine's
    selection has committed), attended in list order by the call it returns (after the recall)."""

    def attend(q, kc, vc, plan, slots):
        D_ = q.shape[-1]
        n = plan.row_tokens.tolist()
        out_idx = torch.full((sum(n) * H,), -7, dtype=torch.int32, device=q.device)
        (head_token_index if triton_lists else naive_head_token_index)(
            slots, plan.req_slots, plan.row_table, plan.n_sink, plan.n_slots, plan.slot_pages, plan.row_tokens,
            plan.row_start, cfg.page_size, out_idx)

        def finish():
            k_flat, v_flat = kc.reshape(-1, D_), vc.reshape(-1, D_)
            o, pos = torch.empty_like(q), 0
            for b, nb in enumerate(n):
                for h in range(H):
                    rows = out_idx[pos:pos + nb].long()
                    pos += nb
                    if order_log is not None:
                        order_log.append((b, h, rows))
                    qh = q[b, h * G:(h + 1) * G].double()
                    w = torch.softmax(qh @ k_flat[rows].double().T / math.sqrt(D_), dim=-1)
                    o[b, h * G:(h + 1) * G] = (w @ v_flat[rows].double()).to(q.dtype)
            assert pos == sum(n) * H
            return o
        return finish

    return attend


@pytest.mark.parametrize("tau", [0.0, 0.6, 1.0])
def test_head_major_token_lists_match_oracle(tau):
    """The flat (row, head) token lists the FlashInfer path attends to hold exactly FreeKV's tokens."""
    cfg = FreeKVConfig(selection="sketch", budget=48, sink=16, window=16, page_size=16, tau=tau, dense_layers=1)
    run_and_check(cfg, H=2, G=3, prompt_lens=[90, 37, 150], steps=20, L=2,
                  attention=head_major_attention(cfg, 2, 3))


@pytest.mark.parametrize("triton_lists", [True, False])
@pytest.mark.parametrize("page_size", [16, 32])
def test_head_major_lists_are_the_context_in_order_when_the_budget_covers_it(page_size, triton_lists):
    """With every page selected, each (row, head) list is the whole context in token order: the order an
    order-sensitive kernel (FlashInfer) reads full attention in, so both round alike."""
    p = page_size
    cfg = FreeKVConfig(selection="sketch", budget=12 * p, sink=p, window=2 * p, page_size=p, tau=0.5, dense_layers=1)
    H, G, L = 3, 2, 2
    eng = make_engine(cfg, H, G, L, max_requests=3, max_context=16 * p)
    slots, lens = [], [5, 3 * p + 7, 9 * p + 1]
    for n in lens:
        s = eng.add_request()
        eng.begin_prefill(s, n)
        for layer in range(L):
            # K encodes (token, head): the attended rows can be read back as positions.
            tok = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, H, D) + 1000 * torch.arange(H)[None, :, None]
            eng.prefill_layer(s, layer, tok.to(DEV), tok.to(DEV), torch.randn(H * G, D, device=DEV))
        slots.append(s)
    for step in range(3 * p):
        plan = eng.begin_step(slots)
        lens = [n + 1 for n in lens]
        assert plan.row_tokens.tolist() == [row_tokens(cfg, n) for n in lens] == lens
        log = []
        for layer in range(L):
            kv = (torch.tensor(lens, dtype=torch.float32) - 1)[:, None, None] + 1000 * torch.arange(H)[None, :, None]
            kv = kv.expand(len(lens), H, D).contiguous().to(DEV)
            eng.attend(plan, layer, torch.randn(len(lens), H * G, D, device=DEV), kv, kv,
                       attention=head_major_attention(cfg, H, G, log, triton_lists) if layer else None)
        eng.end_step()
        for b, h, rows in log:
            got = eng.k_cache[1].reshape(-1, D)[rows, 0].cpu()
            assert got.tolist() == [t + 1000 * h for t in range(lens[b])], (step, b, h)


def test_row_tokens_on_the_host_match_the_plan_past_the_budget():
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1)
    eng = make_engine(cfg, 2, 2, 2, max_requests=2, max_context=1024)
    s = eng.add_request()
    eng.begin_prefill(s, 1)
    for n in range(2, 300):
        eng.prepare_step([s])
        assert eng.plan(1).row_tokens.tolist() == [row_tokens(cfg, n)]
        assert row_tokens(cfg, n, retrieval=False) <= row_tokens(cfg, n) <= min(n, 16 + 32 + 32 + 16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_kv_head_and_many_candidates(backend):
    """One KV head (MQA, or GQA split by tensor parallelism) with more candidates than a warp: once a stride-0
    head index made the Triton recall write outside its pages."""
    cfg = FreeKVConfig(selection="sketch", budget=96 * 32, sink=32, window=64, page_size=32, tau=0.8, dense_layers=1)
    run_and_check(cfg, H=1, G=8, prompt_lens=[1201, 700], steps=3, L=2, backend=backend, atol=1e-4,
                  expect_dense=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replayed_correction_rate_overrides_tau(backend):
    """cfg.replay_correction_rate (benchmarks): rate 0 decodes as pure speculation and rate 1 as no speculation,
    whatever tau."""
    base = dict(budget=48, sink=16, window=16, page_size=16, dense_layers=1, selection="sketch")
    run_and_check(FreeKVConfig(**base, tau=1.0, replay_correction_rate=0.0), H=2, G=2, prompt_lens=[150, 97],
                  steps=3, L=2, backend=backend, oracle_tau=0.0)
    run_and_check(FreeKVConfig(**base, tau=0.0, replay_correction_rate=1.0), H=2, G=2, prompt_lens=[150, 97],
                  steps=3, L=2, backend=backend, oracle_tau=1.0)


def test_replayed_correction_rate_flags_that_share():
    """A replayed rate in between flags about that share of the checks, fresh draws every step."""
    cfg = FreeKVConfig(selection="sketch", budget=48, sink=16, window=16, page_size=16, dense_layers=0, tau=0.9,
                       replay_correction_rate=0.3)
    eng = make_engine(cfg, H=8, G=1, L=1)
    slots = [eng.add_request() for _ in range(4)]
    for slot in slots:
        eng.begin_prefill(slot, 80)
        k, v = (torch.randn(80, 8, D, device=DEV) for _ in range(2))
        eng.prefill_layer(slot, 0, k, v, torch.randn(8, D, device=DEV))
    q = torch.randn(4, 8, D, device=DEV)
    flagged = []
    for _ in range(25):  # the same query every step: the similarity test would flag nothing at tau 0.9
        plan = eng.begin_step(slots)
        eng.attend(plan, 0, q, *(torch.randn(4, 8, D, device=DEV) for _ in range(2)))
        eng.end_step()
        flagged.append(eng.stats()["flagged"])
    rate = eng.stats()["correction_rate"][0]  # 800 checks: a standard error of 0.016
    assert 0.22 < rate < 0.38, rate
    per_step = [b - a for a, b in zip(flagged, flagged[1:])]
    assert len(set(per_step)) > 3, f"the draws repeat: {per_step}"


def churn_run(rate, backend, steps, H=8, R=4, prompt=1600, seed=5, selection="sketch"):
    """Decode R requests of `prompt` tokens with cfg.replay_churn = rate under pure speculation (tau 0: every head
    selects once a step, after attention); returns the engine and its recalled head-pages after each step."""
    torch.manual_seed(seed)
    cfg = FreeKVConfig(selection=selection, budget=128, sink=16, window=16, page_size=16, dense_layers=0, tau=0.0,
                       replay_churn=rate)
    eng = make_engine(cfg, H=H, G=2, L=1, backend=backend)
    slots = [eng.add_request() for _ in range(R)]
    for slot in slots:
        eng.begin_prefill(slot, prompt)
        k, v = (torch.randn(prompt, H, D, device=DEV) for _ in range(2))
        eng.prefill_layer(slot, 0, k, v, torch.randn(2 * H, D, device=DEV))
    recalled = []
    for _ in range(steps):
        plan = eng.begin_step(slots)
        eng.attend(plan, 0, torch.randn(R, 2 * H, D, device=DEV), *(torch.randn(R, H, D, device=DEV) for _ in range(2)))
        eng.end_step()
        st = eng.stats()
        recalled.append(st["recall_pages_now"] + st["recall_pages_speculative"])
    return eng, recalled


def test_replayed_churn_changes_that_share_of_the_budget():
    """cfg.replay_churn (benchmarks): each selection replaces about that share of a head's 8 budget pages, whatever
    the queries (random here: they would trade near-equal pages every step); 0 keeps every held page."""
    _, still = churn_run(0.0, "torch", steps=12)
    assert still[-1] == still[1] > 0, still  # the first selection fills the slots, then nothing changes
    _, moving = churn_run(0.25, "torch", steps=61)
    per_step = (moving[-1] - moving[0]) / 60 / (4 * 8 * 8)  # changed share of R x H x 8 slots
    assert 0.225 < per_step < 0.275, per_step  # ~3840 changes, a standard error of ~1.6%


def test_replayed_churn_is_the_same_from_the_kernels():
    """The churn replaces the scores, so the Triton path selects exactly the pages the torch path does."""
    ref, _ = churn_run(0.3, "torch", steps=4, H=2, R=2, prompt=700)
    out, _ = churn_run(0.3, "triton", steps=4, H=2, R=2, prompt=700)
    assert torch.equal(ref.slot_table[0].cpu(), out.slot_table[0].cpu())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_selection_picks_what_a_scoring_selection_picks_under_the_replay(backend):
    """Selection "replay" (benchmarks) scores nothing, yet under replay_churn it holds exactly the sketch's pages: the
    replay replaces every candidate's score, so only the candidate ranges matter, and those it gets right."""
    ref, ref_recalled = churn_run(0.3, backend, steps=4, H=2, R=2, prompt=400)
    out, out_recalled = churn_run(0.3, backend, steps=4, H=2, R=2, prompt=400, selection="replay")
    assert torch.equal(ref.slot_table[0].cpu(), out.slot_table[0].cpu())
    assert out_recalled == ref_recalled and out_recalled[-1] > out_recalled[0]


def test_replay_selection_needs_the_churn_replay():
    with pytest.raises(ValueError, match="--kv-bench-churn"):
        FreeKVConfig(selection="replay")
    with pytest.raises(ValueError, match="--kv-bench-churn"):
        FreeKVConfig(selection="replay", replay_churn=0.1, retrieval="louiskv")
    assert FreeKVConfig(selection="replay", replay_churn=0.1).selection == "replay"


def test_recall_all_ablation_attends_alike_and_recalls_more():
    """--kv-recall all (the no-delta ablation) attends to the same pages as delta recall, and recalls more."""
    base = dict(budget=48, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, selection="sketch")
    torch.manual_seed(3)
    delta, _ = run_and_check(FreeKVConfig(**base), H=2, G=2, prompt_lens=[150, 97], steps=12, L=2)
    torch.manual_seed(3)
    full, _ = run_and_check(FreeKVConfig(**base, recall="all"), H=2, G=2, prompt_lens=[150, 97], steps=12, L=2)
    d, f = delta.stats(), full.stats()
    assert d["correction_rate"] == f["correction_rate"]
    assert f["recall_bytes_now"] > d["recall_bytes_now"]
    assert f["recall_bytes_speculative"] > d["recall_bytes_speculative"]


def test_head_indptr_matches_the_device_token_lists():
    """The host offsets FlashInfer is planned with equal where head_token_index puts each (row, head) list."""
    cfg = FreeKVConfig(selection="sketch", budget=32, sink=16, window=32, page_size=16, tau=0.5, dense_layers=1)
    H, lens = 3, [1, 17, 90, 300, 64]
    indptr = head_indptr(cfg, lens, H)
    n = [row_tokens(cfg, x) for x in lens]
    assert indptr.tolist() == [0] + torch.tensor([x for x in n for _ in range(H)]).cumsum(0).tolist()
    starts = [H * sum(n[:b]) + h * n[b] for b in range(len(lens)) for h in range(H)]
    assert indptr[:-1].tolist() == starts


@pytest.mark.slow
@pytest.mark.parametrize("method,selection,recall,factor,victim", [
    ("freekv", "means", "all", 0, 0), ("freekv", "rerank", "delta", 2, 0), ("freekv", "means", "delta", 0, 32),
    ("freekv", "quest", "delta", 0, 0), ("streaming", "rerank", "delta", 0, 0)])
def test_triton_backend_equals_torch_backend(method, selection, recall, factor, victim, prefill_alike, decode_alike):
    """The rerank selection (the sketch's best 2k, which runs the sketch's kernels first), MeanS with the recall-all
    ablation and with a victim cache, and the Quest / StreamingLLM baselines: the Triton kernels and the torch
    references give the same outputs, slot tables, victim entries and recall statistics step by step (a padding row
    included). The rerank of every page (rerank_factor 0) interprets for ~80 s on CPU: its kernel against the
    reference is tests/kernels/test_page_rerank.py's full-scan cases, its launches test_launches.py's."""
    cfg = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, recall=recall,
                       selection=selection, rerank_factor=factor, victim=victim)
    H, G, L, lens = 2, 3, 2, [150, 97]
    engines = [make_engine(cfg, H, G, L, method=method, backend=b) for b in ("torch", "triton")]
    torch.manual_seed(5)
    slots = prefill_alike(engines, lens, device=DEV)
    st = decode_alike(engines, slots, 10 if victim else 6, device=DEV)  # hits need evictions to return first
    if method != "streaming":
        assert st["recall_bytes_now"] > 0
    if victim:  # the stats (hits included) are equal; the entries too, and some pages came back from them
        assert st["victim_hits_now"] + st["victim_hits_speculative"] > 0
        assert all(torch.equal(a, b) for a, b in zip(engines[0].victims, engines[1].victims) if a is not None)
