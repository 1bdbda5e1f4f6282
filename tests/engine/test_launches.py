"""Device launches per sparse layer of a decode step, counted on any device: every aten op that would launch a
kernel and every Triton launch inside `attend`, by the stream it is issued on. The decode step of a sparse layer
is launch-bound, so a glue kernel creeping back in fails here rather than in a GPU profile."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from freekv_kernels.page_select import triton as page_select_triton
from freekv_kernels.testing import device
from freekv_kernels.token_index import head_token_index
from torch.utils._python_dispatch import TorchDispatchMode

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_sglang.layout import row_tokens

DEV = device()
H, G, D, L = 2, 4, 16, 3
# aten ops that launch nothing on a GPU: views, metadata, allocation.
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "slice", "select", "unsqueeze",
             "squeeze", "as_strided", "t", "alias", "detach", "empty", "empty_strided", "permute", "transpose",
             "unbind", "split", "is_pinned", "scalar_tensor", "lift_fresh"}


class Launches(TorchDispatchMode):
    """Records (stream, name) of every launch while `on`; Triton's own host work (the interpreter's copies) is
    not counted."""

    def __init__(self):
        super().__init__()
        self.on, self.stream = False, "compute"
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.on and name not in NO_LAUNCH:
            self.seen[(self.stream, "aten." + name)] += 1
        return func(*args, **(kwargs or {}))

    def triton_run(self, run):
        def counted(kernel, *args, **kwargs):
            if self.on:
                self.seen[(self.stream, kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)] += 1
            was, self.on = self.on, False
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self.on = was
        return counted

    @contextlib.contextmanager
    def stream_named(self, name):
        old, self.stream = self.stream, name
        try:
            yield
        finally:
            self.stream = old


def recorder(monkeypatch, eng):
    """A Launches mode counting every Triton launch (all kernels share one JITFunction class) and aten op of
    eng, by the stream it is issued on."""
    rec = Launches()
    kernel_cls = type(page_select_triton._select_slots_kernel)
    monkeypatch.setattr(kernel_cls, "run", rec.triton_run(kernel_cls.run))
    monkeypatch.setattr(eng.streams, "on", rec.stream_named)
    return rec


def count_step(monkeypatch, method=None, outside=False, recall="delta", tau=0.5, selection="sketch", factor=None,
               retrieval="freekv", head_dim=D, correct_at="layer", borrow=False, attention="backend"):
    """Launches per sparse layer of the third decode step of two requests (slots filled, some heads flagged)."""
    D = head_dim
    cfg = FreeKVConfig(budget=64, sink=16, window=32, page_size=16, tau=tau, dense_layers=1, recall=recall,
                       selection=selection, rerank_factor=FreeKVConfig().rerank_factor if factor is None else factor,
                       retrieval=retrieval, boundary_tau=tau, correct_at=correct_at, attention=attention)
    eng = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=3, max_context=512, dtype=torch.float32,
                       device=DEV, backend="triton", method=method, pad_slot=0, dense_outside=True)
    calibrate_synthetic(eng, gaussian_sample(eng))
    rec = recorder(monkeypatch, eng)
    slots = [1, 2]
    for s, n in zip(slots, [200, 140]):
        eng.add_request(s)
        eng.begin_prefill(s, n)
        for layer in range(1, L):
            eng.prefill_layer(s, layer, torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV),
                              torch.randn(H * G, D, device=DEV))
    indices = torch.zeros(4096, dtype=torch.int32, device=DEV)
    out = torch.zeros(len(slots), H * G, D, device=DEV)

    def attention(q, kc, vc, plan, slots):
        head_token_index(slots, plan.req_slots, plan.row_table, plan.n_sink, plan.n_slots, plan.slot_pages,
                         plan.row_tokens, plan.row_start, cfg.page_size, indices)
        return lambda: out  # stands for the outside kernel (FlashInfer), one launch more

    with rec:
        for step in range(3):
            eng.prepare_step(slots)
            plan = eng.plan(len(slots))
            inputs = [[torch.randn(len(slots), n, D, device=DEV) for n in (H * G, H, H)] for _ in range(L)]
            predicted = [q + 0.1 * torch.randn_like(q) for q, _, _ in inputs]
            rec.on = step == 2
            for layer in range(1, L):
                if correct_at != "layer":  # the prediction, a given query (predict's own launches are the model's)
                    eng.anticipate(plan, layer, lambda q: q, (predicted[layer],), borrow=borrow)
                    eng.inputs_read(layer)
                eng.attend(plan, layer, *inputs[layer], attention=attention if outside else None)
            rec.on = False
            eng.end_step()
    total = collections.defaultdict(collections.Counter)
    for (stream, name), n in rec.seen.items():
        total[stream][name] = n
    # The last sparse layer's speculative selection, recall and offload run on the select stream
    # (engine._after_attention): counted back to the speculate and recall streams, one layer's worth of each, so each
    # stream's launches are the same in every layer.
    for lane in ("speculate", "recall"):
        for name, n in list(total[lane].items()):
            assert n % (L - 2) == 0, (lane, name, n)
            total["select"][name] -= n // (L - 2)
            total[lane][name] += n // (L - 2)
    per_layer = collections.defaultdict(collections.Counter)
    for stream, counts in total.items():
        for name, n in counts.items():
            assert n % (L - 1) == 0, (stream, name, n)
            if n:
                per_layer[stream][name] = n // (L - 1)
    return {stream: dict(c) for stream, c in per_layer.items()}


MEANS = {"_page_logits_kernel": 1, "_pool_scores_kernel": 1, "_select_slots_kernel": 1, "_recall_pages_kernel": 1}
# The rerank with rerank_factor 0: every page's code log-sum-exps and their pooled scores, then the same selection
# and recall.
EVERY_PAGE = {"_rerank_lse_kernel": 1, "_rerank_pool_kernel": 1, "_select_slots_kernel": 1, "_recall_pages_kernel": 1}
# The rerank: the sketch's log-sum-exps (its byte picks come with the similarity check), pooled scores and top
# candidates first.
RERANK = {**EVERY_PAGE, "_sketch_lse_kernel": 1, "_rerank_pool_kernel": 2, "_top_pages_kernel": 1}
# The sketch alone (the default in sessions 16-23): its log-sum-exps, pooled scores, then the selection and recall.
SELECT = {"_sketch_lse_kernel": 1, "_rerank_pool_kernel": 1, "_select_slots_kernel": 1, "_recall_pages_kernel": 1}
# After attention: the selection on the speculate stream, its recall and the offload on the recall stream.
RECALL = {"_recall_pages_kernel": 1, "_offload_pages_kernel": 1}


def speculative(select: dict) -> dict:
    return {k: v for k, v in select.items() if k != "_recall_pages_kernel"}


def test_early_correction_launches(monkeypatch):
    """The correction one layer early (correct_at "previous_mlp"): anticipate copies its input on the compute stream,
    then on the early stream one launch tests the predicted query's turn and moves the flagged heads' previous
    queries (query_similarity's early mode), the selection and the recall; attention's own check and chain follow
    on the select stream as without it."""
    got = count_step(monkeypatch, selection="channels", head_dim=32, correct_at="previous_mlp")
    channels = {"_channel_lse_kernel": 1, "_select_chain_kernel": 1, "_recall_pages_kernel": 1}
    assert got == {
        "compute": {"aten.clone": 1, "_query_similarity_kernel": 1, "_attend_kept_kernel": 1,
                    "_attend_recalled_kernel": 1},
        "early": {**channels, "_query_similarity_kernel": 1},
        "select": channels,
        "speculate": speculative(channels),
        "recall": RECALL,
    }


@pytest.mark.parametrize("borrow", [False, True])
def test_early_correction_alone_launches(monkeypatch, borrow):
    """correct_at "previous_mlp_only": the early lane as above, and nothing of the correction on the compute stream's
    path: the similarity check there only stores the query and writes the step's K/V. Lent (borrow, as SGLang's
    backend lends its mid residual), the prediction's input is not copied: no launch for it at all."""
    got = count_step(monkeypatch, selection="channels", head_dim=32, correct_at="previous_mlp_only", borrow=borrow)
    channels = {"_channel_lse_kernel": 1, "_select_chain_kernel": 1, "_recall_pages_kernel": 1}
    assert got == {
        "compute": {**({} if borrow else {"aten.clone": 1}), "_query_similarity_kernel": 1, "_attend_kept_kernel": 1,
                    "_attend_recalled_kernel": 1},
        "early": {**channels, "_query_similarity_kernel": 1},
        "speculate": speculative(channels),
        "recall": RECALL,
    }


def test_fused_attention_launches(monkeypatch):
    """--kv-attention fused with the correction one layer early alone, as served: the compute stream's whole sparse
    layer is the similarity check's store (with the KV write) and one attention launch."""
    got = count_step(monkeypatch, selection="channels", head_dim=32, correct_at="previous_mlp_only", borrow=True,
                     attention="fused")
    channels = {"_channel_lse_kernel": 1, "_select_chain_kernel": 1, "_recall_pages_kernel": 1}
    assert got == {
        "compute": {"_query_similarity_kernel": 1, "_attend_pages_kernel": 1},
        "early": {**channels, "_query_similarity_kernel": 1},
        "speculate": speculative(channels),
        "recall": RECALL,
    }


@pytest.mark.parametrize("recall", ["delta", "all"])
def test_freekv_layer_launches(monkeypatch, recall):
    """12 launches per sparse layer with the sketch selection: 3 on the compute stream (similarity with the
    sketch's byte picks and the KV write, the attention over the pages that stay, beside the recall, and the one
    that merges the recalled slots in after it), 4 on the select stream before attention,
    3 on the speculate stream and 2 on the recall stream after it; no torch glue anywhere."""
    got = count_step(monkeypatch, recall=recall)
    assert got == {
        "compute": {"_query_similarity_kernel": 1, "_attend_kept_kernel": 1, "_attend_recalled_kernel": 1},
        "select": SELECT,
        "speculate": speculative(SELECT),
        "recall": RECALL,
    }


def test_channels_layer_launches(monkeypatch):
    """The default selection, the channel sketch (head dim 32: it codes 32 channels): its log-sum-exps, then one
    launch pools them and selects (select_chain); the offload writes the codes of the page leaving the window in its
    own launch: 10 per sparse layer."""
    got = count_step(monkeypatch, selection="channels", head_dim=32)
    channels = {"_channel_lse_kernel": 1, "_select_chain_kernel": 1, "_recall_pages_kernel": 1}
    assert got == {
        "compute": {"_query_similarity_kernel": 1, "_attend_kept_kernel": 1, "_attend_recalled_kernel": 1},
        "select": channels,
        "speculate": speculative(channels),
        "recall": RECALL,
    }


def test_outside_attention_layer_launches(monkeypatch):
    """With an outside attention kernel (SGLang's FlashInfer path) the compute stream builds the per-head token
    lists from the slot table in one launch."""
    got = count_step(monkeypatch, outside=True)
    assert got["compute"] == {"_query_similarity_kernel": 1, "_head_token_index_kernel": 1}
    assert got["select"] == SELECT


@pytest.mark.slow
def test_means_quest_and_streaming_layer_launches(monkeypatch):
    """The rerank (18 launches: the sketch's best candidates rescored), the rerank of every page (no sketch: 3
    launches fewer per selection), MeanS (12 launches), Quest (max pooling: no pooling kernel) and StreamingLLM
    (nothing selected: no side-stream selection)."""
    rerank = count_step(monkeypatch, selection="rerank")
    assert rerank["select"] == RERANK and rerank["speculate"] == speculative(RERANK)
    every = count_step(monkeypatch, selection="rerank", factor=0)
    assert every["select"] == EVERY_PAGE and every["speculate"] == speculative(EVERY_PAGE)
    means = count_step(monkeypatch, selection="means")
    assert means["select"] == MEANS and means["speculate"] == speculative(MEANS)
    quest = count_step(monkeypatch, selection="quest")
    no_pool = {k: v for k, v in MEANS.items() if k != "_pool_scores_kernel"}
    assert quest["select"] == no_pool and quest["speculate"] == speculative(no_pool)
    for got in (rerank, every, means, quest):
        assert got["recall"] == RECALL
    streaming = count_step(monkeypatch, method="streaming")
    assert "select" not in streaming and "speculate" not in streaming
    assert streaming["recall"] == {"_offload_pages_kernel": 1}
    assert streaming["compute"] == {"_query_similarity_kernel": 1, "_attend_kept_kernel": 1,
                                    "_attend_recalled_kernel": 1}


@pytest.mark.slow
def test_louiskv_layer_launches(monkeypatch):
    """LouisKV: the trigger replaces the similarity check; before attention the unit scores, selection and recall
    (the kernels exit at once for rows without a boundary); after it the offload and the segment upkeep, nothing
    speculative; no torch glue (so no host sync either: a step stays capturable)."""
    got = count_step(monkeypatch, retrieval="louiskv")
    assert got == {
        "compute": {"_semantic_boundary_kernel": 1, "_write_kv_kernel": 1, "_attend_kept_kernel": 1,
                    "_attend_recalled_kernel": 1},
        "select": {"_unit_partials_kernel": 1, "_unit_pages_kernel": 1, "_select_slots_kernel": 1,
                   "_recall_pages_kernel": 1},
        "recall": {"_offload_pages_kernel": 1, "_segment_pages_kernel": 1},
    }


@pytest.mark.parametrize("dense_outside", [True, False])
def test_plan_is_one_launch(monkeypatch, dense_outside):
    """The step's index tensors, before the first layer, come from one kernel on the compute stream (the dense
    outputs only when the engine runs the dense layers itself)."""
    cfg = FreeKVConfig(selection="sketch", budget=64, sink=16, window=32, page_size=16, dense_layers=1)
    eng = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=3, max_context=512, dtype=torch.float32,
                       device=DEV, backend="triton", dense_outside=dense_outside)
    rec = recorder(monkeypatch, eng)
    s = eng.add_request()
    eng.begin_prefill(s, 300)
    eng.prepare_step([s], pad_to=2)
    with rec:
        rec.on = True
        plan = eng.plan(2)
        rec.on = False
    assert rec.seen == {("compute", "_plan_step_kernel"): 1}
    assert (plan.dense_table is None) == dense_outside
    assert plan.row_tokens.tolist() == [row_tokens(cfg, 301), 1]
