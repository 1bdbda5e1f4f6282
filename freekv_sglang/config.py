"""The one configuration object of FreeKV: every knob of the method, validated once."""

from __future__ import annotations

import dataclasses
import math

import torch

from freekv_kernels.page_select.naive import MAX_VICTIM_ENTRIES

RECALL_MODES = ("delta", "all")
ATTENTIONS = ("backend", "split", "fused")
# Page selectors (freekv_sglang/selectors.py): the servable ones, then the accuracy harness's exact upper bound.
SERVABLE_SELECTIONS = ("sketch", "rerank", "channels", "means", "quest")
# The selections that score from 2-bit key codes (written at offload, head_dim / 4 GPU bytes per token and KV head).
CODE_SELECTIONS = ("sketch", "rerank")
# The sketch's channels unless sketch_channels says otherwise (capped at the head dim): with 32 the one-stage sketch
# matched oracle selection on SmolLM2 (head dim 64; 16 channels: within a sample but a lower hit rate), and on the
# Llama-3.1-8B shape (head dim 128) it costs what rerank/2 with 16 did at 16 x 32K (docs/results/session16).
DEFAULT_SKETCH_CHANNELS = 32
# "replay" scores nothing (benchmarks only, with replay_churn): a step with it against one with a real selection is
# what that selection's scoring costs the step, with the same pages recalled.
BENCH_SELECTIONS = ("replay",)
SELECTIONS = (*SERVABLE_SELECTIONS, "oracle", *BENCH_SELECTIONS)
# Retrieval policies over the one engine: FreeKV (speculative page selection with correction, scored by `selection`)
# and LouisKV (freekv_sglang/louiskv.py: retrieval at semantic boundaries of clusters and segments).
RETRIEVALS = ("freekv", "louiskv")
# Prefill: "full" (every layer sees the whole prompt) or FastKV's token-selective propagation (tsp_layer, tsp_keep).
PREFILLS = ("full", "tsp")
# The hysteresis of FreeKV's attention-mass selections unless set: on SmolLM2 (7.5K tokens of text, budget 512) a
# resident page counting twice its mass halves the pages the sketch changes per step (0.29 -> 0.15 of the budget)
# with the same attention mass covered (0.689 -> 0.690) and the same passkey / multikey scores at 4K and 8K; 3 cut
# the changes to 0.09 but lost 0.02 of the mass (docs/results/session21).
DEFAULT_HYSTERESIS = 1.0
# How host pages hold K and V: "auto" in the KV cache's dtype, "fp8_e4m3" as e4m3 rows with a power-of-two scale each
# (freekv_kernels.fp8_rows).
HOST_DTYPES = ("auto", "fp8_e4m3")
SPECULATE_AT = ("attention", "next_recall")
CORRECT_AT = ("layer", "previous_mlp", "previous_mlp_only")
EARLY_WEIGHTS = ("model", "fp8")
# FastKV's observation window: the last prompt tokens, whose queries score the prompt and which always propagate
# (freekv_kernels.tsp_select.WINDOW; a test keeps the two equal).
TSP_WINDOW = 8


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class FreeKVConfig:
    """FreeKV knobs. All sizes are in tokens and must be whole pages.

    budget: tokens of *selected* pages per KV head and request, in addition to the sink and the
        window (so a decoding request attends to at most sink + budget + window + one partial page).
    sink: the first tokens of every request, always attended.
    window: the most recent full pages, always attended, plus the page being filled.
    victim: tokens per KV head and request of pages its selection evicted, kept on the GPU beside the slots (0, the
        default: none). A selection that returns to one of them copies it HBM to HBM instead of recalling it from
        the host, so only its other new pages cross the link; the oldest evicted page gives way. It costs its size
        of GPU pages per sparse layer and request, as the budget's slots do, and is never attended. A real model's
        selection returns often: with one budget of it, 58% of SmolLM2-135M's and 46% of Qwen2.5-Coder-0.5B's
        recalls would have been such copies, with two 67% / 55%, with four 70% / 60% (benchmarks/churn.py). More than
        one budget did not pay at 16 x 32K on an H200: 20% / 30% fewer host bytes, and the selection's victim moves,
        on the critical chain, cost +7 / +22 µs a layer (docs/results/session38). A multiple of page_size; not with
        recall "all".
    page_size: tokens per KV page; the unit of selection, offload and recall.
    tau: correction threshold on the group-mean cosine similarity of adjacent queries.
        0 disables correction (pure speculation), 1 corrects every head every step (no speculation);
        in between a KV head is reselected and recalled before attention when its similarity < tau.
    dense_layers: the first layers attend densely over the whole context.
    recall: "delta" recalls only the pages a new selection adds to a head's slots; "all" recalls every
        selected page of a reselected head (an ablation: what delta recall saves).
    selection: how pages are scored, as attention mass: per query head the log-sum-exp of the page's logits, softmax
        over pages, group mean. "channels" (default): from 4-bit codes of sketch_channels key channels per KV head
        (default 32: 16 GPU bytes per token and KV head), chosen and quantised once per model by a calibration pass
        over a fixed text (FreeKVModel.calibrate; the server runs it at start-up), the same steps for every page,
        nothing elsewhere (freekv_kernels.channel_sketch): one tensor-core product per request and KV head. It needs
        a head dim of at least 32 and rotate-half RoPE. "sketch": from the page summaries and 2-bit per-channel key
        codes (head_dim / 4 bytes per token and KV head, in the page's min / max range); one stage; every page's
        keys are its mid-range except on the sketch_channels channels the group's query weighs most, which decode
        from their codes. "rerank": two stages; that sketch's best rerank_factor x (budget pages) are rescored
        from all their codes (rerank_factor 0: every page). "means": the paper's group-consistent MeanS on the
        summaries alone. "quest": max over the group of the summaries' upper bounds. "oracle": exact attention
        mass from the host copy of the keys (the accuracy harness's upper bound; not servable). "replay": no
        scoring, every candidate page ties (benchmarks only, with replay_churn, whose draws are then the whole
        selection): the baseline that prices a selection's scoring in a step.
        SmolLM2, passkey and multikey at 4K / 8K, budgets 512 / 1024, 20 samples: channels and the sketch score
        the oracle's score in every cell; served under a real model's churn, the channels' step is within 5% of
        MeanS's and the sketch's up to 18% above it (docs/results/session24, session16).
    rerank_factor: N > 0 (default 2): the rerank's best N x (budget pages) of its sketch are rescored from all
        their codes; 0 rescores every page.
    sketch_channels: key channels the sketch (of "sketch" and "rerank") reads per KV head (a multiple of 4, at
        most head_dim): the group's largest |q| ones, 4 per code byte; 0 (default): min(32, head_dim). With
        "channels": the calibrated channels (a multiple of 32, at most head_dim; 0: 32).
    retrieval: the policy. "freekv" (default): everything above. "louiskv" (LouisKV, freekv_sglang/louiskv.py):
        a request's layer retrieves only at a semantic boundary, where the mean cosine similarity over all query
        heads of the adjacent queries falls below boundary_tau, scoring k-means clusters of the prompt's keys and
        temporal segments of later tokens by their centroids; tau, selection, rerank_factor, sketch_channels,
        recall_programs and speculate_at are FreeKV's and unused by it (it selects nothing after attention).
    prefill: "full" (default) or "tsp", FastKV's token-selective propagation: layers 0..tsp_layer prefill the whole
        prompt; at tsp_layer the last TSP_WINDOW prompt queries score every prompt token (softmax per query head,
        summed over the window, averaged over the heads, 7-wide average pool; freekv_kernels.tsp_select) and only
        the best tsp_keep tokens (the window included) go on, so layers after tsp_layer compute and store K/V for
        those tokens only, at their own positions for RoPE. Those layers' KV is the propagated tokens compacted
        in position order (logical token i of such a layer is the i-th propagated token; decode tokens follow),
        and FreeKV selects over it as over any prompt: its sink is the first propagated tokens, its pages are
        pages of propagated tokens. A prompt of at most tsp_keep tokens propagates whole (exactly a full prefill).
    tsp_layer: the layer whose attention picks the propagated tokens (the paper's 15 for 32-layer Llama-3.1-8B);
        it must leave later layers.
    tsp_keep: tokens that propagate past tsp_layer, the observation window included (the paper's TSP length,
        2048 at 128K).
    boundary_tau: LouisKV's threshold (the paper's default 0.7; it uses 0.85 on long-input tasks); 0 retrieves
        only to fill empty slots, 1 at every step.
    cluster_size: LouisKV's mean tokens per prompt cluster (the paper's 16): a prompt's n offloaded tokens form
        n / cluster_size clusters per KV head; a divisor of page_size.
    segment: LouisKV's longest temporal segment in tokens, a multiple of page_size. The paper cuts segments only
        at boundaries (mean length 14-18 tokens at tau 0.7, a long tail to 128); the cap, ours, keeps one centroid
        from averaging a long stretch without boundaries.
    kmeans_iters: Lloyd iterations of LouisKV's prompt clustering (the paper gives none; ours).
    recall_programs: GPU programs of the speculative recall, which reads host memory beside the model's GEMMs
        (each program strides over the pages to recall); 0 launches one per (request, head, slot), which holds
        an SM slot per page through its PCIe round trip. The last sparse layer's always takes one per slot: the
        step's end waits for it, beside the LM head alone.
    recall_block: slots per GPU program of the recall before attention (0 or a power of two). 0 (default): one
        program per (request, head, slot), ~8,000 at 16 requests and budget 2048 with a few hundred pages to recall;
        they run in several waves, each waiting on a PCIe round trip. B: one program per block of B slots, which
        recalls its block's pages one after another (session 36's trace: 81 us a layer at 16 requests for ~1.5 MB
        from the host; to be measured with --kv-recall-block).
    score_programs: GPU programs of the channels selection's speculative scoring, which runs after a layer's
        attention beside the model's GEMMs (each program strides over (request, head, chunk of pages) items); 0
        (default) launches one per item, ~4,000 at 16 x 32K, which queue ahead of the output projection (session 30's
        trace: it waited ~40 us a layer). The scoring before attention always uses one per item.
    speculate_at: where a sparse layer's speculative selection (and so its recall lane) starts. "attention": right
        after the layer's attention, as the paper does; its scoring's programs (~4,000 at 16 x 32K) then fill the SMs
        ahead of the layer's output projection, whose GEMM waits ~40 us a layer for them (session 42's trace, H200).
        "next_recall" (default): once the next sparse layer has committed its selection before attention, beside that
        layer's recall from the host, which leaves the SMs idle (the critical chain's higher stream priority keeps the
        scoring's programs behind it); the last sparse layer's starts after its own attention. The selections and
        recalls are the same either way; only their time in the step moves (session 43, H200: the median step -4.2% at
        16 x 32K, within 1% at 1 request and on the Qwen2.5-7B shape).
    correct_at: where the correction (a KV head's selection with the present query, recalled before attention)
        starts. "layer" (default): the paper's, after the layer's QKV projection, on the critical path: at a
        correction rate of 0.3 that chain is ~100 us a layer at 16 x 32K on the Llama-3.1-8B shape (sessions 43-49).
        "previous_mlp": also one layer early, while the previous layer's MLP runs: the caller predicts the layer's
        query from the previous layer's mid residual (after its attention; FreeKVEngine.anticipate), heads whose
        predicted query turned are selected with it and recalled then, and the check after the QKV projection
        compares the real query with the query each head's selection was made with, so only the heads the
        prediction missed are corrected on the critical path (benchmarks/cross_layer_query.py, SmolLM2-135M at
        7.5K: predicted queries 0.96-0.97 cosine to the real ones, previous steps' 0.83-0.86; 5% of heads corrected
        late against 32-74%, covered attention mass within 0.002 of the paper's correction). FreeKV's channels,
        means, quest and oracle selections, which score with the query itself (not the sketch's picks).
        Served on an H200 (session 51) it is slower than "layer": the check after the projection costs nearly as much
        with 5% of heads flagged as with 30% (its launches and stream hops, not its share of heads, set its length).
        "previous_mlp_only": the correction one layer early alone, with no check after the QKV projection: nothing of
        the correction stays on the critical path; a head whose predicted query missed its turn keeps last step's
        selection for this step (session 50's study: attention mass within 0.002-0.003 of the paper's correction,
        85-90% of what the correction adds over the speculative selection alone). The heads the prediction selects
        are selected again with the real query after attention, as every head is.
    early_weights: with correct_at previous_mlp(_only) in a server, the W_q the predicted query is projected with.
        "model" (default): the model's own (bf16), re-read by every layer's early lane (32 MB a layer on the
        Llama-3.1-8B shape, ~9 µs of a one-request layer on an H200, session 55). "fp8": an e4m3 copy with one
        power-of-two scale an output row (freekv_kernels.fp8_rows), made at startup and counted in the GPU memory plan
        (~0.5 GB on that shape), read by freekv_kernels.fp8_linear: half the bytes (alone on an H200, session 57: 7.5
        µs a layer against bf16's 14.1 at one request). Served there with "fused" attention (Llama-3.1-8B shape, 32K,
        previous_mlp_only): one request 5.47 ms a step against the model's W_q's 5.72 (full KV 5.92), sixteen level.
        On SmolLM2-135M (CPU, session 57, benchmarks/cross_layer_query.py --quant fp8_rows, 6K, budget 512) this codec
        selects as bf16 does: covered mass 0.9300 / 0.9001 / 0.9052 on text / passkey / multikey, as bf16's, and
        correction rates within 0.003. After a weight update (update_weights_from_*) the next decode re-derives
        the copies (freekv_patches.weight_update_refresh, EarlyQuery.refresh_weights). It stays opt-in: GPUs below
        sm_89 refuse it, and its memory is about 0.6 of a 32K request's GPU KV on that shape.
    attention: how a served sparse layer attends. "fused" (default): FreeKV's own kernel in one launch after the
        recall before attention (freekv_kernels.split_attention.attend_pages), reading the slot table's pages
        directly: no token lists, no second launch to merge the splits. It rounds as a different kernel does, and its
        splits follow the batch's size. Served on an H200 (session 57, Llama-3.1-8B shape, 32K, budget 2048,
        previous_mlp_only, one machine): one request 5.72 ms a step against "backend"'s 6.09 (full KV 5.92), sixteen
        10.37 against 10.91 (full KV 19.97). "backend": through the wrapped backend's own decode kernel (FlashInfer's
        or SGLang's Triton one), one row per (request, KV head), so with a budget that covers the context the answers
        match a full-KV server token for token; it starts after the recall before attention. The only one allowed
        with --enable-deterministic-inference (batch-invariant rounding). "split": FreeKV's own kernels
        (freekv_kernels.split_attention): the pages that stay are attended beside that recall and the recalled slots
        merged in after it; not faster at 16 x 32K on an H200 (session 32): beside the recall, that attention shares
        HBM and SMs with the step's other work. A backend without a FreeKV row kernel (neither FlashInfer nor Triton)
        takes "split" when "backend" is asked for.
    hysteresis: h >= 0: in a head's reselection its resident pages count (1 + h) times their score, so a page
        must hold more than (1 + h) times a resident page's attention mass to displace it. Pages near the top-k's
        edge hold similar mass and trade places on small query changes; every trade is a recall. 0 is the paper's
        top-k. None (default): DEFAULT_HYSTERESIS for FreeKV's sketch, rerank and means, 0 for quest (whose
        scores are logits, not masses), oracle (the harness's upper bound) and LouisKV (which reselects only at
        semantic boundaries); a non-zero value is refused for quest and LouisKV.
    host_dtype: how the host pages (and so the recall's PCIe reads) hold K and V. "auto" (default): in the KV cache's
        dtype. "fp8_e4m3": each row of head_dim values (one token of one KV head, K or V) as e4m3 values times a
        power-of-two scale, one int8 exponent per row beside them (freekv_kernels.fp8_rows): 129 bytes per 128-wide
        row instead of bf16's 256, so the arena holds twice the tokens and every recall reads about half the bytes.
        Offload rounds each value to e4m3 (relative error at most 2**-4, round to nearest even); the page summaries and
        selection codes come from the exact keys, and the GPU's sink, window and fresh pages stay exact. Refused with
        an FP8 KV cache (--kv-cache-dtype), which has nothing left to narrow.
    replay_correction_rate: benchmarks only (None, the default: off). FreeKV flags each (request, KV head) check of a
        sparse layer with this probability, drawn per step, instead of by the similarity test; selection, recall and
        the rest of the step are unchanged. A model with random weights has unrealistic query churn: adjacent
        queries nearly uncorrelated (the Llama-3.1-8B shape flags 99% of checks at tau 0.9) or nearly constant (the
        Qwen2.5-7B shape: 0.1%). This replays a real model's rate instead: FreeKV's paper reports 0.04-0.14 at tau
        0.8 and 0.17-0.43 at 0.9 on Llama-3.1-8B, SmolLM2-135M 0.13-0.16 at 0.8 and 0.5-0.8 at 0.9.
    replay_late_rate: benchmarks only (None, the default: off), with correct_at "previous_mlp" and
        replay_correction_rate (then the early corrections' rate): the check after the QKV projection flags each
        (request, KV head) with this probability, drawn apart from the early ones, instead of by the similarity of
        the real query to the one its selection follows (random weights predict nothing). SmolLM2-135M: 0.048-0.056
        of the checks at tau 0.9 and 0.8 (benchmarks/cross_layer_query.py, the accuracy harness).
    replay_returns: benchmarks only (None, the default: off), with replay_churn and victim: about this share of the
        pages replay_churn promotes come back from the head's victim entries (the measured shares above), as a real
        model's selection returns to pages it evicted lately; replay_churn alone draws new pages at random and so
        never returns to one.
    replay_churn: benchmarks only (None, the default: off). Each head's selection replaces about this share of its
        budget's pages, at random, instead of the pages its scores rank (scoring still runs, then replay_churn
        replaces the scores): random weights churn unrealistically (random keys trade near-equal pages every step,
        or none with hysteresis). SmolLM2-135M's default selection changes 0.15 of its budget per step (0.29
        without hysteresis; benchmarks/churn.py). With replay_correction_rate it replays both of a real model's
        costs: selection before attention and recall.
    """

    budget: int = 2048
    sink: int = 128
    window: int = 512
    victim: int = 0
    page_size: int = 32
    tau: float = 0.9
    dense_layers: int = 1
    recall: str = "delta"
    recall_programs: int = 32
    recall_block: int = 0
    score_programs: int = 0
    speculate_at: str = "next_recall"
    correct_at: str = "layer"
    early_weights: str = "model"
    attention: str = "fused"
    selection: str = "channels"
    rerank_factor: int = 2
    sketch_channels: int = 0
    retrieval: str = "freekv"
    boundary_tau: float = 0.7
    cluster_size: int = 16
    segment: int = 128
    kmeans_iters: int = 10
    prefill: str = "full"
    tsp_layer: int = 15
    tsp_keep: int = 2048
    hysteresis: float | None = None
    host_dtype: str = "auto"
    replay_correction_rate: float | None = None
    replay_churn: float | None = None
    replay_returns: float | None = None
    replay_late_rate: float | None = None

    def __post_init__(self) -> None:
        p = self.page_size
        if not _is_int(p) or p < 1 or p & (p - 1):
            raise ValueError(f"page_size must be a positive power of two, got {p!r}")
        for name in ("budget", "sink", "window", "victim"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0 or v % p:
                raise ValueError(f"{name} must be a non-negative multiple of page_size={p}, got {v!r}")
        if self.budget == 0:
            raise ValueError("budget must be at least one page; use plain dense attention instead of budget=0")
        if self.window == 0:
            raise ValueError(f"window must be at least one page ({p} tokens): the newest full page is always attended")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be a number in [0, 1], got {self.tau!r}")
        if not _is_int(self.dense_layers) or self.dense_layers < 0:
            raise ValueError(f"dense_layers must be a non-negative integer, got {self.dense_layers!r}")
        if self.recall not in RECALL_MODES:
            raise ValueError(f"recall must be one of {', '.join(RECALL_MODES)}, got {self.recall!r}")
        if self.victim and self.recall == "all":
            raise ValueError("recall 'all' recalls every selected page from the host, so a victim cache saves "
                             "nothing: drop --kv-victim or use --kv-recall delta")
        if self.victim_pages > MAX_VICTIM_ENTRIES:
            raise ValueError(f"victim holds at most {MAX_VICTIM_ENTRIES} pages, got {self.victim_pages}: lower "
                             f"--kv-victim")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if not _is_int(self.rerank_factor) or self.rerank_factor < 0:
            raise ValueError(f"rerank_factor must be a non-negative integer, got {self.rerank_factor!r}")
        if not _is_int(self.sketch_channels) or self.sketch_channels < 0 or self.sketch_channels % 4:
            raise ValueError(f"sketch_channels must be 0 (the default, min({DEFAULT_SKETCH_CHANNELS}, head_dim)) or a "
                             f"positive multiple of 4 (channels per code byte), got {self.sketch_channels!r}")
        if self.selection == "channels" and self.sketch_channels % 32:
            raise ValueError(f"selection 'channels' codes a multiple of 32 channels (16 bytes a token per 32), got "
                             f"sketch_channels={self.sketch_channels}")
        if self.selection in (*CODE_SELECTIONS, "channels") and self.retrieval == "freekv" and p < 16:
            raise ValueError(f"page_size must be at least 16 tokens for selection {self.selection!r} (its kernels "
                             f"multiply on tensor cores), got {p}; or choose selection 'means'")
        if self.selection in BENCH_SELECTIONS and (self.replay_churn is None or self.retrieval != "freekv"):
            raise ValueError(f"selection {self.selection!r} scores nothing: it is a benchmark baseline for FreeKV's "
                             f"replay_churn (--kv-bench-churn); set it, or pick another --kv-selection")
        if not _is_int(self.recall_programs) or self.recall_programs < 0:
            raise ValueError(f"recall_programs must be a non-negative integer, got {self.recall_programs!r}")
        if not _is_int(self.recall_block) or self.recall_block < 0 or self.recall_block & (self.recall_block - 1):
            raise ValueError(f"recall_block must be 0 or a power of two, got {self.recall_block!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if not _is_int(self.score_programs) or self.score_programs < 0:
            raise ValueError(f"score_programs must be a non-negative integer, got {self.score_programs!r}")
        if self.score_programs and self.selection != "channels":
            raise ValueError(f"score_programs shapes the 'channels' selection's scoring, not {self.selection!r}'s: "
                             "drop --kv-score-programs or use --kv-selection channels")
        if self.speculate_at not in SPECULATE_AT:
            raise ValueError(f"speculate_at must be one of {', '.join(SPECULATE_AT)}, got {self.speculate_at!r}")
        if self.correct_at not in CORRECT_AT:
            raise ValueError(f"correct_at must be one of {', '.join(CORRECT_AT)}, got {self.correct_at!r}")
        if self.early_weights not in EARLY_WEIGHTS:
            raise ValueError(f"early_weights must be one of {', '.join(EARLY_WEIGHTS)}, got {self.early_weights!r}")
        if self.early_weights != "model" and not self.anticipates:
            raise ValueError(f"early_weights {self.early_weights!r} stores the W_q of the correction one layer early, "
                             "which correct_at 'layer' does not run: set correct_at previous_mlp(_only) or drop "
                             "early_weights")
        if self.anticipates and self.retrieval != "freekv":
            raise ValueError(f"correct_at {self.correct_at!r} moves FreeKV's correction, which retrieval "
                             f"{self.retrieval!r} does not run: drop correct_at")
        if self.anticipates and self.sketches:
            raise ValueError(f"correct_at {self.correct_at!r} selects with a predicted query, which FreeKV's channels, "
                             f"means, quest and oracle selections score with; not {self.selection!r}, whose scoring "
                             f"reads the picks the similarity check made: drop correct_at or pick another selection")
        if self.anticipates and self.prefill == "tsp":
            raise ValueError(f"correct_at {self.correct_at!r} predicts queries within one engine's layers; with "
                             "prefill 'tsp' the layers after the TSP layer run in another: drop correct_at "
                             "(--kv-correct-at)")
        late = self.correct_at == "previous_mlp"  # early corrections with a check after the projection
        if (self.replay_late_rate is not None) != (late and self.replay_correction_rate is not None):
            raise ValueError("correct_at 'previous_mlp' replays its early corrections at replay_correction_rate "
                             "(--kv-bench-correction-rate) and the late ones at replay_late_rate "
                             "(--kv-bench-late-correction-rate): set both or neither, and the latter only with "
                             "--kv-correct-at previous_mlp")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {', '.join(RETRIEVALS)}, got {self.retrieval!r}")
        bt = self.boundary_tau
        if isinstance(bt, bool) or not isinstance(bt, (int, float)) or not 0.0 <= bt <= 1.0:
            raise ValueError(f"boundary_tau must be a number in [0, 1], got {bt!r}")
        if not _is_int(self.kmeans_iters) or self.kmeans_iters < 1:
            raise ValueError(f"kmeans_iters must be a positive integer, got {self.kmeans_iters!r}")
        louis = self.retrieval == "louiskv"  # the unit sizes are checked against the page where they apply
        if not _is_int(self.cluster_size) or self.cluster_size < 1 or louis and p % self.cluster_size:
            raise ValueError(f"cluster_size must be a positive divisor of page_size={p} (each page's share of a "
                             f"prompt's clusters is a whole number of unit-table rows), got {self.cluster_size!r}")
        if not _is_int(self.segment) or self.segment < 1 or louis and (self.segment < p or self.segment % p):
            raise ValueError(f"segment must be a positive multiple of page_size={p}, got {self.segment!r}")
        if self.prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {', '.join(PREFILLS)}, got {self.prefill!r}")
        if not _is_int(self.tsp_layer) or self.tsp_layer < 0:
            raise ValueError(f"tsp_layer must be a non-negative integer, got {self.tsp_layer!r}")
        if not _is_int(self.tsp_keep) or self.tsp_keep <= TSP_WINDOW:
            raise ValueError(f"tsp_keep must be an integer above the {TSP_WINDOW}-token observation "
                             f"window, which always propagates; got {self.tsp_keep!r}")
        if self.host_dtype not in HOST_DTYPES:
            raise ValueError(f"host_dtype must be one of {', '.join(HOST_DTYPES)}, got {self.host_dtype!r}")
        hy = self.hysteresis
        if hy is not None and (isinstance(hy, bool) or not isinstance(hy, (int, float)) or not 0.0 <= hy < math.inf):
            raise ValueError(f"hysteresis must be a finite number >= 0 or None, got {hy!r}")
        if hy and (self.retrieval != "freekv" or self.selection == "quest"):
            raise ValueError(f"hysteresis applies to FreeKV's attention-mass selections (sketch, rerank, means, "
                             f"channels), not "
                             f"to {self.retrieval if self.retrieval != 'freekv' else 'quest'}: drop hysteresis "
                             f"(--kv-hysteresis 0)")
        for name, replays in (("replay_correction_rate", "FreeKV's correction"),
                              ("replay_churn", "FreeKV's per-step selection"),
                              ("replay_returns", "FreeKV's returns to evicted pages"),
                              ("replay_late_rate", "the corrections an early prediction misses")):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1] or None, got {v!r}")
            if self.retrieval != "freekv":
                raise ValueError(f"{name} replays {replays}; LouisKV retrieves at semantic boundaries instead: "
                                 f"drop {name}")

        if self.replay_returns is not None and (self.replay_churn is None or not self.victim):
            raise ValueError("replay_returns (--kv-bench-returns) draws returns to the victim cache's pages among "
                             "replay_churn's: set --kv-bench-churn and --kv-victim too")

    @property
    def selection_hysteresis(self) -> float:
        """The hysteresis select_slots applies (see `hysteresis`)."""
        if self.hysteresis is not None:
            return float(self.hysteresis)
        mass_scored = self.retrieval == "freekv" and self.selection in ("sketch", "rerank", "means", "channels")
        return DEFAULT_HYSTERESIS if mass_scored else 0.0

    def host_torch_dtype(self, kv_dtype):
        """The host arena's torch dtype for a KV cache of kv_dtype."""
        if self.host_dtype == "auto":
            return kv_dtype
        if kv_dtype.itemsize < 2:
            raise ValueError(f"host_dtype {self.host_dtype!r} narrows a 16- or 32-bit KV cache, not {kv_dtype}: drop "
                             f"--kv-host-dtype or serve a bf16 KV cache")
        return torch.float8_e4m3fn

    @property
    def sink_pages(self) -> int:
        return self.sink // self.page_size

    @property
    def window_pages(self) -> int:
        return self.window // self.page_size

    @property
    def select_pages(self) -> int:
        return self.budget // self.page_size

    @property
    def victim_pages(self) -> int:
        return self.victim // self.page_size

    @property
    def resident_pages(self) -> int:
        """GPU pages a decoding request holds per sparse layer: sink, slots, window ring (window + partial)."""
        return self.sink_pages + self.select_pages + self.window_pages + 1

    @property
    def units_per_page(self) -> int:
        """LouisKV: unit-table rows per host page (a prompt's clusters fill those of its offloaded pages)."""
        return self.page_size // self.cluster_size

    @property
    def rerank_pages(self) -> int:
        return self.select_pages * self.rerank_factor

    @property
    def sketches(self) -> bool:
        """Whether selection runs the sketch over every candidate page (its byte picks made with the similarity
        check): the sketch selection, and the rerank unless rerank_factor 0 rescores every page instead."""
        return self.retrieval == "freekv" and (self.selection == "sketch" or
                                               (self.selection == "rerank" and self.rerank_factor > 0))

    @property
    def anticipates(self) -> bool:
        """Whether the correction runs one layer early (FreeKVEngine.anticipate): correct_at previous_mlp(_only)."""
        return self.correct_at != "layer"

    @property
    def checks_late(self) -> bool:
        """Whether the similarity check after the QKV projection corrects on the critical path (all but
        correct_at previous_mlp_only)."""
        return self.correct_at != "previous_mlp_only"

    def sketch_bytes(self, head_dim: int) -> int:
        """Code bytes (4 channels each) the sketch reads per KV head for a model of this head dim."""
        return (self.sketch_channels or min(DEFAULT_SKETCH_CHANNELS, head_dim)) // 4

    @property
    def channel_count(self) -> int:
        """The calibrated channels of selection "channels"."""
        return self.sketch_channels or 32

    def check_model(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int | None = None) -> None:
        """Refuse model shapes FreeKV cannot serve, naming the knob to change."""
        if head_dim is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
            raise ValueError(f"FreeKV's kernels (page scoring, attention, and the rerank selection's four 2-bit key "
                             f"codes per byte) need a power-of-two head dim >= 16; this model's is {head_dim}")
        if head_dim is not None and self.selection == "channels" and self.retrieval == "freekv" and \
                self.channel_count > head_dim:
            fix = "pick another --kv-selection" if head_dim < 32 else "lower --kv-sketch-channels (a multiple of 32)"
            raise ValueError(f"selection 'channels' codes {self.channel_count} key channels, more than the model's "
                             f"head dim {head_dim}: {fix}")
        if head_dim is not None and self.selection in CODE_SELECTIONS and self.retrieval == "freekv" and \
                self.sketch_channels > head_dim:
            raise ValueError(f"sketch_channels={self.sketch_channels} exceeds the model's head dim {head_dim}: "
                             f"lower --kv-sketch-channels")
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
        if self.dense_layers > num_layers:
            raise ValueError(f"dense_layers={self.dense_layers} exceeds the model's {num_layers} layers")
        if self.prefill == "tsp" and self.tsp_layer >= num_layers - 1:
            raise ValueError(f"tsp_layer={self.tsp_layer} (--kv-tsp-layer) leaves no later layer to propagate to: "
                             f"the model has {num_layers} layers (0..{num_layers - 1})")
