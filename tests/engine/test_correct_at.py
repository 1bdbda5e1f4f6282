"""cfg.correct_at "previous_mlp": FreeKVEngine.anticipate selects the heads whose predicted query turned one layer
early, and attend's check corrects against the query each head's selection follows: a perfect prediction leaves
nothing to correct on the critical path and attends as the paper's correction does; a wrong one is corrected there.
"previous_mlp_only": anticipate's check is the only one; a wrong prediction is not corrected before attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freekv_kernels.page_select import PHASE_LATER
from freekv_kernels.testing import device
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_sglang.streams import CRITICAL_PRIORITY, Streams

DEV = device()
CFG = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.05, dense_layers=1, victim=32)


def make_engine(cfg: FreeKVConfig) -> FreeKVEngine:
    shape = ModelShape(num_layers=4, num_q_heads=6, num_kv_heads=2, head_dim=32)
    return FreeKVEngine(cfg, shape, max_requests=3, max_context=1024, dtype=torch.float32, device=DEV,
                        backend="torch")


def decode(engines, predict, slots, steps):
    """Steps of the slots plus a padding row, the same random queries and K/V in every engine; an engine with
    correct_at "previous_mlp"(_only) is handed predict(q) for each sparse layer before attending it. Each step the
    outputs (real rows) and the pages each head's slots hold must match the first engine's. Returns every engine's
    statistics."""
    shape, n = engines[0].shape, len(slots)
    L, Hq, H, D = shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    for _ in range(steps):
        q = torch.randn(L, n + 1, Hq, D, device=DEV)
        kv = torch.randn(2, L, n + 1, H, D, device=DEV)
        outs = []
        for e in engines:
            plan, out = e.begin_step(slots, pad_to=n + 1), []
            for layer in range(L):
                if e.cfg.anticipates and not e.dense[layer]:
                    e.anticipate(plan, layer, predict, (q[layer],))
                out.append(e.attend(plan, layer, q[layer], kv[0, layer], kv[1, layer]))
            e.end_step()
            outs.append(out)
        for out, e in zip(outs[1:], engines[1:]):
            for layer in range(L):
                torch.testing.assert_close(out[layer][:n], outs[0][layer][:n], atol=1e-4, rtol=1e-4)
            # The same pages; a head selected twice in a step may hold them in other slots.
            assert torch.equal(engines[0].slot_table[:, slots].sort(-1).values, e.slot_table[:, slots].sort(-1).values)
    return [e.stats() for e in engines]


@pytest.mark.parametrize("at", ["previous_mlp", "previous_mlp_only"])
@pytest.mark.parametrize("selection", ["channels", "means"])
def test_a_perfect_prediction_corrects_early_what_the_layer_would(selection, at, prefill_alike):
    """Predicted queries equal to the real ones: the same outputs and slots every step, the early corrections are
    the paper's corrections and none is left for the check after the projection (previous_mlp: the first step's
    rows, which have no previous query, excepted; previous_mlp_only has no such check), and the same pages are
    recalled before attention."""
    cfg = dataclasses.replace(CFG, selection=selection)
    engines = [make_engine(dataclasses.replace(cfg, correct_at=c)) for c in ("layer", at)]
    torch.manual_seed(5)
    slots = prefill_alike(engines, [200, 90], device=DEV)
    first = [e.stats() for e in engines]
    late, early = decode(engines, lambda q: q, slots, 12)
    assert early["flagged_early"] - first[1]["flagged_early"] == late["flagged"] - first[0]["flagged"] > 0
    assert early["flagged"] == first[1]["flagged"]
    if at == "previous_mlp_only":
        assert early["flagged"] == 0
    assert early["recall_pages_now"] == late["recall_pages_now"] > 0
    assert late["flagged_early"] == 0


def test_a_wrong_prediction_is_corrected_before_attention(prefill_alike):
    """Predicted queries unrelated to the real ones, every head checked as turned (tau 1): each is selected with the
    prediction first and corrected with the real query after the projection, so attention reads the paper's
    selection (no hysteresis keeps a predicted page)."""
    cfg = dataclasses.replace(CFG, tau=1.0, hysteresis=0.0)
    engines = [make_engine(dataclasses.replace(cfg, correct_at=at)) for at in ("layer", "previous_mlp")]
    torch.manual_seed(6)
    slots = prefill_alike(engines, [200, 90], device=DEV)
    late, early = decode(engines, torch.randn_like, slots, 6)
    assert early["flagged"] == late["flagged"] > 0 and early["flagged_early"] > 0
    assert early["recall_pages_now"] > late["recall_pages_now"]  # the predicted selection's pages, recalled in vain


def test_a_wrong_prediction_alone_is_not_corrected(prefill_alike):
    """previous_mlp_only with predicted queries unrelated to the real ones, every head turned (tau 1): every head
    selects with the prediction one layer early and attends with that selection (no check after the projection), so
    the outputs leave the paper's; previous_mlp, with the same predictions, corrects them back."""
    cfg = dataclasses.replace(CFG, tau=1.0, hysteresis=0.0)
    stats = {}
    for at in ("previous_mlp", "previous_mlp_only"):
        engines = [make_engine(dataclasses.replace(cfg, correct_at=c)) for c in ("layer", at)]
        torch.manual_seed(6)  # the same prompts, queries and predictions for both pairs
        slots = prefill_alike(engines, [200, 90], device=DEV)
        gen = torch.Generator(device=DEV).manual_seed(1)

        def predict(q):
            return torch.randn(q.shape, generator=gen, device=q.device)

        if at == "previous_mlp":
            stats[at] = decode(engines, predict, slots, 6)[1]  # attends as the paper's correction: checked inside
        else:
            with pytest.raises(AssertionError):
                decode(engines, predict, slots, 6)
            stats[at] = engines[1].stats()
    assert stats["previous_mlp"]["flagged"] > 0
    only = stats["previous_mlp_only"]
    assert only["flagged"] == 0 and only["flagged_early"] == only["checks"] > 0


def test_replayed_early_rate_alone(prefill_alike):
    """Benchmarks, previous_mlp_only: anticipate flags at replay_correction_rate, nothing after the projection."""
    cfg = dataclasses.replace(CFG, selection="means", correct_at="previous_mlp_only", replay_correction_rate=0.3)
    eng = make_engine(cfg)
    torch.manual_seed(7)
    slots = prefill_alike([eng], [200, 90, 150], device=DEV)
    before = eng.stats()
    decode([eng], lambda q: q, slots, 60)
    st = eng.stats()
    checks = st["checks"] - before["checks"]
    assert abs((st["flagged_early"] - before["flagged_early"]) / checks - 0.3) < 0.04
    assert st["flagged"] == 0


def test_anticipate_needs_the_previous_mlp_correction_and_a_sparse_layer(prefill_alike):
    eng = make_engine(CFG)
    slots = prefill_alike([eng], [100], device=DEV)
    plan, q = eng.begin_step(slots), torch.randn(1, 6, 32, device=DEV)
    with pytest.raises(ValueError, match="correct_at 'previous_mlp' or 'previous_mlp_only', got 'layer'"):
        eng.anticipate(plan, 1, lambda x: x, (q,))
    eng = make_engine(dataclasses.replace(CFG, correct_at="previous_mlp"))
    slots = prefill_alike([eng], [100], device=DEV)
    with pytest.raises(ValueError, match="got a dense layer"):
        eng.anticipate(eng.begin_step(slots), 0, lambda x: x, (q,))


@pytest.mark.parametrize("change, match", [
    (dict(correct_at="mlp"), "correct_at must be one of layer, previous_mlp, previous_mlp_only"),
    (dict(correct_at="previous_mlp", selection="sketch"), "not 'sketch'"),
    (dict(correct_at="previous_mlp", retrieval="louiskv"), "retrieval .louiskv. does not run"),
    (dict(correct_at="previous_mlp", replay_correction_rate=0.3), "--kv-bench-late-correction-rate"),
    (dict(replay_correction_rate=0.3, replay_late_rate=0.05), "only with --kv-correct-at previous_mlp"),
    (dict(correct_at="previous_mlp", replay_late_rate=0.05), "set both or neither"),
    (dict(correct_at="previous_mlp_only", replay_correction_rate=0.3, replay_late_rate=0.05), "only with"),
    (dict(correct_at="previous_mlp", replay_correction_rate=0.3, replay_late_rate=1.5), "replay_late_rate must be"),
])
def test_refused_settings(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **change)


def test_the_harness_runs_channels_and_means_once_per_correct_at():
    from freekv_sglang.accuracy.methods import Geometry, parse_methods

    specs = parse_methods("channels,means,quest", [0.9], correct_at=["layer", "previous_mlp"])
    assert [s.name for s in specs] == ["channels(tau=0.9)", "channels/early(tau=0.9)", "means(tau=0.9)",
                                       "means/early(tau=0.9)", "quest"]
    assert [s.config(256, Geometry(), 30).correct_at for s in specs] == ["layer", "previous_mlp"] * 2 + ["layer"]


def test_the_harness_table_gives_late_then_early_corrections():
    from freekv_sglang.accuracy.report import correction_table

    stats = [dict(method="channels(tau=0.9)", length=8192, budget=512, mean_correction_rate=0.49,
                  mean_early_correction_rate=0.0),
             dict(method="channels/early(tau=0.9)", length=8192, budget=512, mean_correction_rate=0.048,
                  mean_early_correction_rate=0.5)]
    rows = correction_table({"engine_stats": stats}).splitlines()[2:]
    assert rows == ["| channels(tau=0.9) | 0.490 |", "| channels/early(tau=0.9) | 0.048 (early 0.500) |"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream priorities need a GPU")
def test_the_early_lane_runs_above_the_critical_chain():
    """The early stream's CTAs are dispatched ahead of the critical chain's (the MLP beside it), whose are ahead of
    the speculative lanes': a priority that PyTorch clamped to the critical one would silently undo it."""
    st = Streams(torch.device("cuda"))
    assert st.early.priority < st.select.priority == CRITICAL_PRIORITY < st.speculate.priority == st.recall.priority


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")
def test_a_lent_input_is_read_before_the_caller_overwrites_it(prefill_alike):
    """borrow=True on a GPU: a prediction held back on the early stream (a sleep before it reads) still reads the
    caller's tensor as it was, since the caller's overwrite after inputs_read waits for that read."""
    eng = make_engine(dataclasses.replace(CFG, selection="means", correct_at="previous_mlp_only"))
    slots = prefill_alike([eng], [150, 120], device=DEV)
    plan = eng.begin_step(slots)
    mid = torch.randn(2, 6, 32, device=DEV)
    want, seen = mid.clone(), []

    def predict(x):
        torch.cuda._sleep(50_000_000)  # ~25 ms at GPU clocks: the overwrite would land first without the wait
        seen.append(x.clone())
        return seen[-1]

    eng.anticipate(plan, 1, predict, (mid,), borrow=True)
    eng.inputs_read(1)
    mid.fill_(float("nan"))  # the caller's in-place write (SGLang's fused add-and-norm)
    eng.attend(plan, 1, torch.randn(2, 6, 32, device=DEV), *torch.randn(2, 2, 2, 32, device=DEV))
    eng.end_step()
    torch.cuda.synchronize()
    assert torch.equal(seen[0], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("borrow", [False, True])
@pytest.mark.parametrize("correct_at", ["previous_mlp", "previous_mlp_only"])
def test_graph_replay_of_the_early_correction_equals_eager(prefill_alike, correct_at, borrow):
    """A decode step that anticipates every sparse layer (the prediction's projection on the early stream), captured
    in a CUDA graph, replays like the same engine run eagerly: outputs, slots and early corrections. borrow: the
    inputs are lent, and the compute stream waits for their read before the layer (SGLang's serving path)."""
    H, G, D, L, bs = 2, 4, 64, 3, 4
    cfg = FreeKVConfig(budget=64, sink=32, window=32, page_size=32, tau=0.8, dense_layers=1, selection="means",
                       correct_at=correct_at)
    shape = ModelShape(L, H * G, H, D)
    eager, graphed = (FreeKVEngine(cfg, shape, max_requests=bs, max_context=2048, dtype=torch.bfloat16,
                                   device="cuda", backend="triton") for _ in range(2))
    slots = prefill_alike([eager, graphed], [700, 1031, 300], dtype=torch.bfloat16, device="cuda")
    q = torch.zeros(L, bs, H * G, D, device="cuda", dtype=torch.bfloat16)
    mix = torch.zeros_like(q)  # the prediction: q plus noise, made inside predict() as a projection would be
    k, v = (torch.zeros(L, bs, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step(e, plan, rows):
        out = []
        for layer in range(L):
            if layer >= cfg.dense_layers:
                e.anticipate(plan, layer, lambda a, b: a + 0.5 * b, (q[layer, :rows], mix[layer, :rows]),
                             borrow=borrow)
                e.inputs_read(layer)
            out.append(e.attend(plan, layer, q[layer, :rows], k[layer, :rows], v[layer, :rows]))
        e.end_step()
        return torch.stack(out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) on an all-padding batch
        graphed.prepare_step([], pad_to=bs)
        step(graphed, graphed.plan(bs), bs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graphed.prepare_step([], pad_to=bs)
    with torch.cuda.graph(graph):
        static_out = step(graphed, graphed.plan(bs), bs)
    for _ in range(30):
        for t in (q, mix, k, v):
            t.normal_()
        ref = step(eager, eager.begin_step(slots), 3)
        graphed.prepare_step(slots, pad_to=bs)
        graph.replay()
        torch.testing.assert_close(static_out[:, :3], ref, atol=2e-2, rtol=2e-2)
    torch.cuda.synchronize()
    assert torch.equal(eager.slot_table[:, slots].sort(-1).values, graphed.slot_table[:, slots].sort(-1).values)
    se, sg = eager.stats(), graphed.stats()
    assert se["flagged_early"] == sg["flagged_early"] > 0 and se["flagged"] == sg["flagged"]


def test_replayed_early_and_late_rates(prefill_alike):
    """Benchmarks (random weights predict nothing): anticipate flags at replay_correction_rate, the check after the
    projection at replay_late_rate, from draws of their own; the prediction is still made every time."""
    cfg = dataclasses.replace(CFG, selection="means", correct_at="previous_mlp", replay_correction_rate=0.3,
                              replay_late_rate=0.05)
    eng = make_engine(cfg)
    torch.manual_seed(7)
    slots = prefill_alike([eng], [200, 90, 150], device=DEV)
    before = eng.stats()
    predicted = []
    steps = 60

    def predict(q):
        predicted.append(1)
        return q

    decode([eng], predict, slots, steps)
    st = eng.stats()
    checks = st["checks"] - before["checks"]
    assert checks == steps * 3 * 3 * 2 and len(predicted) == steps * 3
    assert abs((st["flagged_early"] - before["flagged_early"]) / checks - 0.3) < 0.04
    assert abs((st["flagged"] - before["flagged"]) / checks - 0.05) < 0.02


def test_anticipate_predicts_from_copies_held_until_the_steps_join(prefill_alike):
    """The caller's tensors may change after anticipate returns (SGLang's next fused add-and-norm overwrites the
    residual in place): predict reads copies, which stay referenced until end_step has joined the side streams."""
    eng = make_engine(dataclasses.replace(CFG, selection="means", correct_at="previous_mlp"))
    slots = prefill_alike([eng], [150, 120], device=DEV)
    plan = eng.begin_step(slots)
    mid = torch.randn(2, 6, 32, device=DEV)
    seen = []
    eng.anticipate(plan, 1, lambda x: (seen.append(x), x)[1], (mid,))
    assert torch.equal(seen[0], mid) and seen[0].data_ptr() != mid.data_ptr() and eng._held
    for layer in range(4):
        eng.attend(plan, layer, torch.randn(2, 6, 32, device=DEV), *torch.randn(2, 2, 2, 32, device=DEV))
    eng.end_step()
    assert eng._held == []


def test_anticipate_borrows_inputs_until_the_caller_waits_for_their_read(prefill_alike):
    """borrow=True (SGLang's mid residual): predict reads the caller's tensor itself, held until the step's join; the
    caller calls inputs_read before overwriting it, and a step that lent inputs without that wait fails at end_step."""
    eng = make_engine(dataclasses.replace(CFG, selection="means", correct_at="previous_mlp_only"))
    slots = prefill_alike([eng], [150, 120], device=DEV)
    for release in (True, False):
        plan = eng.begin_step(slots)
        mid = torch.randn(2, 6, 32, device=DEV)
        seen = []
        for layer in range(1, 4):
            eng.anticipate(plan, layer, lambda x: (seen.append(x), x)[1], (mid,), borrow=True)
            if release:
                eng.inputs_read(layer)
            eng.attend(plan, layer, torch.randn(2, 6, 32, device=DEV), *torch.randn(2, 2, 2, 32, device=DEV))
        assert all(x is mid for x in seen) and eng._held
        if release:
            eng.end_step()
        else:
            with pytest.raises(RuntimeError, match=r"layers \[1, 2, 3\] lent their inputs"):
                eng.end_step()
        assert eng._held == []
    eng.inputs_read(1)  # nothing lent: nothing to wait for


@pytest.mark.parametrize("early_rate", [0.0, 1.0])
def test_replayed_early_heads_are_not_churned_again_after_attention(early_rate, prefill_alike, monkeypatch):
    """Benchmarks: a head corrected early selects again after attention, as served, but at a churn of 0 (the replay
    would churn it twice a step), so it keeps its pages; with every head corrected early and none late nothing is
    recalled after attention."""
    cfg = dataclasses.replace(CFG, selection="means", correct_at="previous_mlp", replay_correction_rate=early_rate,
                              replay_late_rate=0.0, replay_churn=0.5)
    eng = make_engine(cfg)
    torch.manual_seed(8)
    slots = prefill_alike([eng], [300, 260], device=DEV)
    before = eng.stats()
    kept, select_chain = [], eng.ops.select_chain

    def spy(scores, slots, req_slots, heads, phase, *args, replay=None, **kwargs):
        if phase == PHASE_LATER:  # every head of the real rows this phase selects is kept (row 2 pads)
            later = ~heads[:2]
            kept.append(replay.keep is not None and bool(replay.keep[:2][later].all()) and bool(later.any()))
        return select_chain(scores, slots, req_slots, heads, phase, *args, replay=replay, **kwargs)

    monkeypatch.setattr(eng.ops, "select_chain", spy)
    decode([eng], lambda q: q, slots, 4)
    assert len(kept) == 4 * 3 and all(kept) == (early_rate == 1.0)
    st = eng.stats()
    speculative = st["recall_pages_speculative"] - before["recall_pages_speculative"]
    assert (speculative == 0) == (early_rate == 1.0)
    assert (st["flagged_early"] - before["flagged_early"] == st["checks"] - before["checks"]) == (early_rate == 1.0)


@pytest.mark.parametrize("at", ["previous_mlp", "previous_mlp_only"])
def test_replayed_churn_alone_does_not_churn_early_heads_twice(at, prefill_alike):
    """Benchmarks with the churn replayed and the flags by tau (1: every head turns): the heads anticipate selected
    select again after attention at a churn of 0, as in the replay of both rates; nothing is recalled speculatively."""
    cfg = dataclasses.replace(CFG, selection="means", correct_at=at, tau=1.0, replay_churn=0.5)
    eng = make_engine(cfg)
    torch.manual_seed(9)
    slots = prefill_alike([eng], [300, 260], device=DEV)
    before = eng.stats()
    decode([eng], lambda q: q, slots, 4)
    st = eng.stats()
    assert st["recall_pages_speculative"] == before["recall_pages_speculative"]
    assert st["flagged_early"] - before["flagged_early"] == st["checks"] - before["checks"] > 0


def test_a_sparse_layer_that_is_not_anticipated_is_checked_after_its_projection(prefill_alike):
    """previous_mlp_only with a sparse first layer, which nothing before it predicts: that layer's check stays after
    its projection and its corrections are counted as such, the anticipated layers' as early ones."""
    eng = make_engine(dataclasses.replace(CFG, selection="means", correct_at="previous_mlp_only", tau=1.0,
                                          dense_layers=0))
    torch.manual_seed(10)
    slots = prefill_alike([eng], [200, 90], device=DEV)
    n, (L, Hq, H, D) = len(slots), (4, 6, 2, 32)
    before = eng.stats()
    for _ in range(3):
        plan = eng.begin_step(slots)
        for layer in range(L):
            q = torch.randn(n, Hq, D, device=DEV)
            if layer:
                eng.anticipate(plan, layer, lambda x: x, (q,))
            eng.attend(plan, layer, q, *torch.randn(2, n, H, D, device=DEV))
        eng.end_step()
    st = eng.stats()
    assert st["correction_rate"][0] == 1.0 and st["early_correction_rate"][0] == 0.0
    assert all(st["correction_rate"][i] == 0.0 and st["early_correction_rate"][i] == 1.0 for i in (1, 2, 3))
    assert st["flagged"] > before["flagged"]


def test_a_layer_anticipated_but_not_attended_is_an_error(prefill_alike):
    eng = make_engine(dataclasses.replace(CFG, selection="means", correct_at="previous_mlp_only"))
    slots = prefill_alike([eng], [150], device=DEV)
    plan = eng.begin_step(slots)
    eng.anticipate(plan, 2, lambda x: x, (torch.randn(1, 6, 32, device=DEV),))
    with pytest.raises(RuntimeError, match=r"layers \[2\] were anticipated this step but not attended"):
        eng.end_step()
