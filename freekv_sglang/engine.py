"""The batched FreeKV decode engine, independent of any serving framework.

State is indexed by request slot, never by batch position, so requests of different lengths share a
batch and join or leave between steps. A decode step is `prepare_step` (host bookkeeping and small
uploads, outside any CUDA graph), then `plan` (the step's index tensors, one launch on the compute
stream) and `attend` once per layer (device work only, capturable), then `end_step` (joins the side
streams); `begin_step` is prepare_step and plan.

Per sparse layer l of a step, in stream order (see streams.py), one launch per line item:
  compute: query_similarity: cosine similarity of q_i and q_{i-1} per KV head -> correction flags,
           and the heads that select now -- flagged, or holding fewer pages than there are candidates
           (a new request, a context still shorter than the budget); in the same launch the new K/V
           (a sink or window page, never a slot page); record E_q
  select:  wait E_q; for the heads that select now (the other heads' programs exit at once):
           the selector's scoring with q_i (selectors.py; channels: its log-sum-exps, one launch; sketch:
           sketch_pages, MeanS: score_pages, two launches each; rerank five), select_chain (the channels'
           pooling, the benchmarks' churn replay and select_slots: top-k, delta against the resident slots,
           commit, recall codes, in one launch); record E_sel; recall_pages of the changed slots of flagged heads
           and the empty slots being filled; record E_now
  compute: the engine's own attention over sink | slots | window: wait E_sel; attend_kept, over every page but the
           slots being recalled, runs beside that recall; wait E_now; attend_recalled merges those slots in.
           Or an outside kernel (SGLang's --kv-attention backend): wait E_now; head_token_index, which lists each
           head's tokens straight from the slot table, and the kernel. Record E_attn
  speculate: wait E_attn; the scoring + select_chain with q_i for the remaining heads (speculative, used by
           step i+1); record E_spec
  recall:  wait E_spec; recall_pages of every other changed slot; offload_pages summarises and offloads the
           page leaving the window. Layer l's recall runs beside layer l+1's speculative selection.
  The last sparse layer's speculate and recall items run on the select stream instead, its recall with one program
  per slot (see _after_attention).
  With cfg.speculate_at "next_recall", layer l's speculate and recall items wait for layer l+1's E_sel instead of
  E_attn (l+1's E_sel follows l's attention): the scoring then runs beside l+1's recall before attention, which
  leaves the SMs idle, instead of ahead of l's output projection, whose GEMM waits for the scoring's programs.
  With cfg.correct_at "previous_mlp"(_only), anticipate(l) runs the check, selection and recall of the heads whose
  predicted query turned on the early stream, beside layer l-1's MLP; attend(l) waits for its commit (and its
  recall: before attention, and before the select stream's own chain under "previous_mlp").
  end_step: compute joins the side streams.
So only flagged heads' selection and recall sit on the critical path, as in the paper.
That is the FreeKV policy; the engine's retrieval policy is its selector (selectors.py): which heads select before
attention (its trigger, the first launch), how pages are scored, whether the other heads select speculatively after
attention, the page order of a prompt's offload and any upkeep after the offload. LouisKV (louiskv.py) triggers at
semantic boundaries per request (semantic_boundary, then write_kv), scores clusters and segments (unit_page_scores),
selects nothing after attention and forms segments after the offload (segment_pages). Recall never
writes a slot this step's attention reads: the speculative recall waits for E_attn through E_spec (ordering,
not double buffering), and the join orders it before the next step's correction recall and before the KV
write that reuses the ring page being offloaded. Speculative work of layer l overlaps layers l+1.. of
the same step; only the last layer's is exposed at the join.
Tensors that cross streams are either consumed before the consumer's event is waited on by their
producer stream (the flags), or live in persistent buffers: the step plan (written on compute before the
first layer, read by the side streams until the join), the current query in prev_q, the heads that
select before attention (_now_heads, written on compute, read by the side streams) and the recall code
of every (row, head, slot) (_recall, written by the select or early stream, completed by the speculate stream,
read by the recall stream), so the caching allocator never hands a block to one stream while another still reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW
from freekv_kvstore import ArenaGeometry
from freekv_kernels.select_chain import Replay

from .config import RETRIEVALS, FreeKVConfig
from .host_pool import HostPool, LayerSlice, LocalHostPool
from .layout import Layout, StepPlan
from .ops import load_ops
from .selectors import CandidateKeys, make_selector, picks_bytes_per_slot, sketch_bytes_per_token
from .streams import StepTimer, Streams, upload


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


# An outside attention kernel for sparse layers, in two calls: (q, k_cache, v_cache, plan, slots) does what needs only
# the layer's slot table [R, H, k] (the token lists) and returns the call that attends, () -> output. The engine makes
# the first beside the recall before attention and the second after it (see FreeKVEngine.attend).
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepPlan, torch.Tensor], Callable[[], torch.Tensor]]

# The retrieval policies of cfg.retrieval (FreeKV: selection by cfg.selection, speculative with correction; LouisKV:
# retrieval at semantic boundaries) and StreamingLLM-style dropping (sink + window only, nothing selected).
METHODS = (*RETRIEVALS, "streaming")
# Programs of a prefill's offload, which runs beside the model's GEMMs: one per (page, head) slowed an 8192-token
# chunk's GEMMs by 8.2% on an H200, 16 by 3.1% at the same 91-93% of the link (benchmarks/prefill_offload.py).
PREFILL_OFFLOAD_PROGRAMS = 16


def engine_gpu_bytes(cfg: FreeKVConfig, shape: ModelShape, *, num_slots: int, max_context: int, host_pages: int,
                     dtype_bytes: int) -> int:
    """GPU bytes a FreeKVEngine(dense_outside=True) holds with num_slots request slots, including the per-head
    token lists of SGLang's FlashInfer path: the sizing of a FreeKV server reserves this much."""
    L, H, Hq, D, p, k = shape.num_layers, shape.num_kv_heads, shape.num_q_heads, shape.head_dim, cfg.page_size, \
        cfg.select_pages
    sparse = L - cfg.dense_layers
    pages = 1 + num_slots * (cfg.resident_pages + cfg.victim_pages)
    kv = sparse * pages * p * H * D * 2 * dtype_bytes
    victims = sparse * num_slots * H * (cfg.victim_pages * 8 + k * 4) if cfg.victim_pages else 0  # entries, stamps, ops
    sketches = sparse * host_pages * p * sketch_bytes_per_token(cfg, H, D, dtype_bytes)  # summaries (+ codes)
    tables = num_slots * (-(-max_context // p) * 4 + L * H * k * 4 + L * Hq * D * dtype_bytes + L + 8
                          + sparse * picks_bytes_per_slot(cfg, H, shape.group, shape.head_dim))
    masks = sparse * num_slots * H * (1 + k)
    plan = num_slots * ((cfg.resident_pages + k + 9) * 4 + 8 + 1)  # StepPlan.buffers without the dense fields
    token_lists = num_slots * H * (cfg.resident_pages * p + 2) * 4
    if cfg.prefill == "tsp":  # the later layers' engine (tsp_engines) plans its own steps and lists its own tokens
        plan, token_lists = 2 * plan, 2 * token_lists
    louiskv = 0
    if cfg.retrieval == "louiskv":  # boundary marks and open segments per slot, one scoring scratch (louiskv.py)
        pages = -(-max_context // p)
        louiskv = sparse * num_slots * (pages + H * (D * 4 + 12)) + num_slots * H * pages * cfg.units_per_page * 4
    return int(kv + sketches + tables + masks + plan + token_lists + louiskv + victims)


def tsp_engines(cfg: FreeKVConfig, shape: ModelShape, host_pool: HostPool | None = None, *, max_requests: int,
                max_context: int, **kw) -> tuple["FreeKVEngine", "FreeKVEngine"]:
    """FastKV's token-selective propagation (cfg.prefill "tsp"): layers 0..tsp_layer in one engine, the later layers,
    whose sequence is the propagated tokens and then the decode tokens (never longer), in a second one over the same
    slot ids that writes into the first one's host pages (its own layers of each page). Add a request to both with
    the same slot and grow the first one first (begin_prefill / stage_prefill, prepare_step). host_pool: every layer
    (default: a LocalHostPool)."""
    cfg.check_model(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
    if cfg.prefill != "tsp":
        raise ValueError(f"tsp_engines is for prefill 'tsp', not {cfg.prefill!r}")
    L, split, p = shape.num_layers, cfg.tsp_layer + 1, cfg.page_size
    if host_pool is None:
        host_pool = LocalHostPool(kw.pop("host_pages", None) or max_requests * -(-max_context // p), L,
                                  shape.num_kv_heads, p, shape.head_dim, cfg.host_torch_dtype(kw.get("dtype")))
    kw.pop("host_pages", None)
    early = FreeKVEngine(dataclasses.replace(cfg, prefill="full", dense_layers=min(cfg.dense_layers, split)),
                         dataclasses.replace(shape, num_layers=split), host_pool=LayerSlice(host_pool, 0, split),
                         max_requests=max_requests, max_context=max_context, **kw)
    late = FreeKVEngine(dataclasses.replace(cfg, prefill="full", dense_layers=max(cfg.dense_layers - split, 0)),
                        dataclasses.replace(shape, num_layers=L - split),
                        host_pool=LayerSlice(host_pool, split, L - split), max_requests=max_requests,
                        max_context=max_context, pages_of=early, **kw)
    return early, late


def merged_stats(parts: list[tuple["StatsSnapshot", int]]) -> dict:
    """stats() of engines that hold consecutive layers of one model, (a snapshot of the engine, its first model
    layer) each: per-layer entries under model layer numbers, totals summed."""
    out: dict = {}
    for snap, first in parts:
        for key, val in snap.stats().items():
            if isinstance(val, dict):
                out.setdefault(key, {}).update({first + layer: x for layer, x in val.items()})
            elif key in ("steps", "recall_page_bytes"):  # the same in every engine
                out[key] = val
            else:
                out[key] = out.get(key, 0) + val
    return out


@dataclasses.dataclass
class StatsSnapshot:
    """An engine's counters taken without waiting for the device (FreeKVEngine.stats_snapshot): its device counters
    copied to host memory behind the work already queued on the current stream, its host counters as they stood.
    A server logs them once ready(): a host sync between steps would idle the GPU for the scheduler's whole step."""

    engine: "FreeKVEngine"
    sim: torch.Tensor  # host copies of _stat_sim, _stat_recall and _stat_early
    recall: torch.Tensor
    early: torch.Tensor
    steps: int
    checks: int
    copied: "torch.cuda.Event | None"  # None: the copies were synchronous

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def stats(self) -> dict:
        """FreeKVEngine.stats() as of the snapshot; waits for the copies if they have not landed."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.engine._stats_of(self)


class FreeKVEngine:
    def __init__(self, cfg: FreeKVConfig, shape: ModelShape, *, max_requests: int, max_context: int,
                 dtype: torch.dtype, device: torch.device | str, host_pool: HostPool | None = None,
                 host_pages: int | None = None, backend: str | None = None, method: str | None = None,
                 collect_stats: bool = True, pad_slot: int | None = None, dense_outside: bool = False,
                 pages_of: "FreeKVEngine | None" = None):
        """max_requests request slots. By default one extra slot absorbs padding rows; a framework with
        its own slot ids (SGLang's req_pool_idx) passes pad_slot, the one id it pads with, instead.
        dense_outside: the caller runs the dense layers itself (no dense KV pool here). method: cfg.retrieval (the
        default) or "streaming".
        pages_of: another engine over the same slot ids and host pages whose sequences are never shorter (FastKV's
        later layers, pages_of holding the earlier ones): this engine then allocates no host page, it writes its
        logical page j into the host page of pages_of's logical page j (its own layers of that page, host_pool
        being the arena's view of them) and shares pages_of's page table, so no host page is spent twice."""
        cfg.check_model(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
        method = method or cfg.retrieval
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method in RETRIEVALS and method != cfg.retrieval:
            raise ValueError(f"method {method!r} contradicts the config's retrieval {cfg.retrieval!r}")
        if max_requests < 1 or max_context < 1:
            raise ValueError("max_requests and max_context must be positive")
        self.cfg, self.shape, self.method = cfg, shape, method
        self.device = torch.device(device)
        self.dtype = dtype
        self.ops = load_ops(backend or ("triton" if self.device.type == "cuda" else "torch"))
        p = cfg.page_size
        L, H, Hq, D = shape.num_layers, shape.num_kv_heads, shape.num_q_heads, shape.head_dim
        self.max_pages = -(-max_context // p)
        self.layout = Layout(cfg, self.max_pages)
        R = max_requests + 1 if pad_slot is None else max_requests
        self.pad_slot = max_requests if pad_slot is None else pad_slot
        if not 0 <= self.pad_slot < R:
            raise ValueError(f"pad_slot {pad_slot} outside [0, {max_requests})")
        self.num_slots = R  # including the padding slot
        self.max_requests = R - 1
        self.scale = 1.0 / math.sqrt(D)
        self.tau = cfg.tau
        self.retrieval = method != "streaming"

        host_dtype = cfg.host_torch_dtype(dtype)
        if host_pool is None:
            host_pool = LocalHostPool(host_pages or max_requests * self.max_pages, L, H, p, D, host_dtype)
        want = (host_pool.arena.shape[1:], host_pool.arena.dtype)
        if want != (torch.Size([L, H, 2, p, D]), host_dtype):
            raise ValueError(f"host pool arena {tuple(host_pool.arena.shape)} {host_pool.arena.dtype} does not "
                             f"match the model: [P, {L}, {H}, 2, {p}, {D}] {host_dtype}")
        self.host = host_pool
        num_host = host_pool.arena.shape[0]

        kw = dict(dtype=dtype, device=self.device)
        self.dense = [layer < cfg.dense_layers for layer in range(L)]
        self.dense_outside = dense_outside
        pages = [0 if d and dense_outside else self.layout.dense_pool_pages(R) if d else self.layout.sparse_pool_pages(R)
                 for d in self.dense]
        self.k_cache = [torch.zeros(n * p, H, D, **kw) for n in pages]
        self.v_cache = [torch.zeros(n * p, H, D, **kw) for n in pages]
        # Summaries are indexed by host page, so they follow a page wherever a request goes.
        self.summaries = [None if d else torch.zeros(num_host, H, 2, D, **kw) for d in self.dense]
        self._pages_of = pages_of
        if pages_of is None:
            self.page_table = torch.full((R, self.max_pages), -1, dtype=torch.int32, device=self.device)
        else:
            if (pages_of.num_slots, pages_of.pad_slot, pages_of.max_pages, pages_of.cfg.page_size,
                    pages_of.cfg.sink_pages) != (R, self.pad_slot, self.max_pages, p, cfg.sink_pages):
                raise ValueError("an engine sharing another's host pages needs its slots, padding slot, max_context, "
                                 "page size and sink")
            if pages_of.host.arena.shape[0] != num_host:
                raise ValueError("an engine sharing another's host pages needs a view of the same arena")
            self.page_table = pages_of.page_table
        k = cfg.select_pages
        self.slot_table = torch.full((L, R, H, k), -1, dtype=torch.int32, device=self.device)
        self.prev_q = torch.zeros(L, R, Hq, D, **kw)
        self.has_prev = torch.zeros(L, R, dtype=torch.bool, device=self.device)
        self.selector = make_selector(cfg, self)
        self.candidate_keys = CandidateKeys(self)  # exact keys for the oracle and diagnostics (eager, on demand)
        # Eager diagnostics (the accuracy harness): called as probe(layer, plan, q, slots) right after attention.
        self.probe: Callable | None = None

        self.streams = Streams(self.device)
        # cfg.speculate_at "next_recall": a sparse layer's speculative selection (and so its recall lane) waits for the
        # next sparse layer's selection before attention, to run beside that layer's recall instead of holding the SMs
        # ahead of its own output projection; _pending is the layer waiting. The last sparse layer has no next one.
        self._defer_speculation = cfg.speculate_at == "next_recall" and self.retrieval and self.selector.speculative
        self._last_sparse = max((i for i, d in enumerate(self.dense) if not d), default=-1)
        self._pending: tuple[StepPlan, int] | None = None
        self.timer: StepTimer | None = None  # enable_step_timing
        # Step inputs live in static buffers so a captured step replays with new values.
        self._step_slots = torch.full((R,), self.pad_slot, dtype=torch.int32, device=self.device)
        self._step_lens = torch.ones(R, dtype=torch.int32, device=self.device)
        # The plan's outputs, written in place every step; the dense ones only if a dense layer runs here.
        self._plan = StepPlan.buffers(self.layout, self._step_slots, dense=any(self.dense) and not dense_outside)
        # Per sparse layer, by batch row: which heads select before attention (query_similarity writes it), and
        # the phase in which each (head, slot) is recalled this step (select_slots writes it; 0: not recalled).
        self._now_heads = [None if d else torch.zeros(R, H, dtype=torch.bool, device=self.device)
                           for d in self.dense]
        self._recall = [None if d else torch.zeros(R, H, k, dtype=torch.int8, device=self.device)
                        for d in self.dense]
        # cfg.attention "fused": attend_pages' counters, one per (row, KV head), zero between its calls
        self._tickets = torch.zeros(R * H, dtype=torch.int32, device=self.device)
        # cfg.correct_at "previous_mlp"(_only): per sparse layer, by batch row, the heads anticipate() selected with the
        # predicted query; and its events, per layer anticipated this step (attend waits for them).
        self._early_heads = [None if d or not cfg.anticipates or not self.retrieval else
                             torch.zeros(R, H, dtype=torch.bool, device=self.device) for d in self.dense]
        self._anticipated: dict[int, tuple] = {}  # layer -> anticipate()'s events: selection committed, recalled
        self._held: list[tuple[torch.Tensor, ...]] = []  # anticipate()'s inputs (or copies), until the step's join
        self._lent: dict[int, torch.cuda.Event | None] = {}  # layer -> read: anticipate(borrow=True)'s prediction
        # cfg.victim: per sparse layer the victim cache's entries (the logical page each holds, -1 empty) and their
        # insertion stamps by request slot, and the victim op of every (row, head, slot) recalled this step (by batch
        # row, written with the recall codes and read by the same recalls).
        # One block per kind over the sparse layers, viewed per layer: a request's removal clears its row of every
        # layer in one launch (62 on the Llama shape, most of ~3 ms of host time per finished request).
        V = cfg.victim_pages if self.retrieval else 0
        sparse = [layer for layer, d in enumerate(self.dense) if not d]
        self._victim_blocks = [torch.full((len(sparse), R, H, V), -1, dtype=torch.int32, device=self.device)
                               for _ in range(2)] if V and sparse else []
        self.victims, self._victim_age = ([None] * L for _ in range(2))
        for i, layer in enumerate(sparse if self._victim_blocks else ()):
            self.victims[layer], self._victim_age[layer] = (block[i] for block in self._victim_blocks)
        self._victim_ops = [None if t is None else torch.zeros(R, H, k, dtype=torch.int32, device=self.device)
                            for t in self.victims]
        # cfg.replay_correction_rate, cfg.replay_churn (benchmarks): every step's uniform draws per (layer, row, KV
        # head), made by plan(): the correction flags and the churn's seeds.
        self._replay_u = None
        if (cfg.replay_correction_rate is not None or cfg.replay_churn is not None) and self.retrieval:
            self._replay_u = torch.ones(L, R, H, dtype=torch.float32, device=self.device)
        # With the churn replayed, the heads corrected early this step (by layer) select again after attention at a
        # churn of 0: the scoring's cost is paid as served, while the same draws would churn them twice. A real
        # model's reselection with the real query (~0.96 cosine to the predicted one) changes little.
        self._keep_early: set[int] = set()
        # cfg.replay_late_rate: the late check's own draws (anticipate's early flags take _replay_u's).
        self._replay_late = None if cfg.replay_late_rate is None or not self.retrieval else \
            torch.ones(L, R, H, dtype=torch.float32, device=self.device)
        self._free_slots = [s for s in range(R - 1, -1, -1) if s != self.pad_slot]
        self._len = [0] * R
        self._host_pages: list[list[int]] = [[] for _ in range(R)]
        self._owner = [0] * R  # host-pool owner id of the request in each slot
        self._next_owner = 1
        # Shared prefixes (docs/radix.md), per slot: leading logical pages mapped to shared host pages, the host pages
        # of its sink pages (only once exported or shared), and the leading pages complete in the arena (every layer).
        self._shared = [0] * R
        self._sink_host: list[list[int]] = [[] for _ in range(R)]
        self._complete = [0] * R

        self.collect_stats = collect_stats
        z = dict(dtype=torch.float64, device=self.device)
        # Per layer, accumulated by query_similarity: flagged (row, KV head) checks, the sum of group-mean
        # cosine similarities of rows with a previous query, and their count.
        self._stat_sim = torch.zeros(L, 3, **z)
        # Per layer, accumulated by select_slots: (page, head) chunks put into slots before attention, and after it;
        # then those of them taken from the victim cache instead of the host.
        self._stat_recall = torch.zeros(L, 4, **z)
        # Per layer, accumulated by anticipate(): as _stat_sim, of its checks of the predicted query (previous_mlp
        # counts only the flagged ones: its check covers rows with a previous query, and attend's check follows).
        self._stat_early = torch.zeros(L, 3, **z)
        self._stat_checks = 0  # (row, KV head) checks per sparse layer
        self._stat_steps = 0

    # ---- request lifecycle -------------------------------------------------------------------

    def add_request(self, slot: int | None = None, owner: int | None = None) -> int:
        """Take a free request slot (the given one, or any). owner: the request's host-pool owner id when the caller
        already holds pages under it (a radix hit's prefix, pinned at match time), else a new one."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.max_requests} request slots are in use")
        if slot is None:
            slot = self._free_slots.pop()
        elif slot in self._free_slots:
            self._free_slots.remove(slot)
        else:
            raise ValueError(f"request slot {slot} is in use or out of range")
        if owner is None:
            owner, self._next_owner = self._next_owner, self._next_owner + 1
        self._owner[slot] = owner
        return slot

    def remove_request(self, slot: int, free_host: bool = True) -> int | None:
        """Free a slot. Returns the owner of its host pages, which the caller frees itself when not free_host (several
        slots' in one kvstore call); None when this engine does not hold them."""
        self._check_slot(slot)
        owner = None
        if self._pages_of is None:  # else pages_of frees the pages and clears the shared page table
            owner = self._owner[slot]
            if free_host:
                self.host.free(owner)
            self.page_table[slot] = -1
        self._host_pages[slot] = []
        self._shared[slot], self._sink_host[slot], self._complete[slot] = 0, [], 0
        self._len[slot] = 0
        self.slot_table[:, slot] = -1
        self._clear_victims(slot)
        self.has_prev[:, slot] = False
        self._free_slots.append(slot)
        return owner

    def _clear_victims(self, slot: int, layer: int | None = None) -> None:
        """Empty a slot's victim cache (a new request must not take back another's pages): every layer, or one."""
        if layer is None:
            for block in self._victim_blocks:
                block[:, slot] = -1
        elif self.victims[layer] is not None:
            self.victims[layer][slot] = -1
            self._victim_age[layer][slot] = -1

    def seq_len(self, slot: int) -> int:
        return self._len[slot]

    def uncalibrated_layers(self) -> list[int]:
        """The sparse layers whose selector still waits for its calibration (selection "channels": its calibrate()
        before the first prompt; freekv_sglang.calibration)."""
        return getattr(self.selector, "uncalibrated", list)()

    @property
    def needs_calibration(self) -> bool:
        return bool(self.uncalibrated_layers())

    def is_active(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and slot != self.pad_slot and slot not in self._free_slots

    def _check_slot(self, slot: int) -> None:
        if not self.is_active(slot):
            raise ValueError(f"request slot {slot} is not in use")

    def _ensure_host_pages(self, slot: int, num_pages: int, updates: list[tuple[int, int, int]]) -> None:
        """Host pages for logical pages [sink_pages, num_pages) of a slot (sink pages stay on the GPU)."""
        if self._pages_of is not None:
            src = self._pages_of
            if not src.is_active(slot) or src.cfg.sink_pages + len(src._host_pages[slot]) < num_pages:
                raise ValueError(f"request slot {slot}: {num_pages} pages wanted, more than the engine whose host "
                                 "pages this one shares holds (its sequence must be at least as long, grown first)")
            self._host_pages[slot] = src._host_pages[slot]
            return
        have = self.cfg.sink_pages + len(self._host_pages[slot])
        if num_pages > have:
            new = self.host.alloc(self._owner[slot], num_pages - have)
            updates.extend((slot, have + i, hp) for i, hp in enumerate(new))
            self._host_pages[slot].extend(new)

    def _upload_page_table(self, updates: list[tuple[int, int, int]]) -> None:
        if updates:
            idx = upload(updates, torch.int64, self.device)
            self.page_table[idx[:, 0], idx[:, 1]] = idx[:, 2].int()

    # ---- prefill -----------------------------------------------------------------------------

    def begin_prefill(self, slot: int, num_tokens: int) -> None:
        """Reserve host pages for a prompt of num_tokens; then call prefill_layer for every layer."""
        self._check_slot(slot)
        if self._len[slot]:
            raise ValueError(f"slot {slot} already holds {self._len[slot]} tokens")
        if not 0 < num_tokens < self.max_pages * self.cfg.page_size:
            raise ValueError(f"prompt of {num_tokens} tokens does not fit max_context "
                             f"{self.max_pages * self.cfg.page_size} (one token must remain to decode)")
        updates: list[tuple[int, int, int]] = []
        self._ensure_host_pages(slot, -(-num_tokens // self.cfg.page_size), updates)
        self._upload_page_table(updates)
        self._len[slot] = num_tokens

    def prefill_layer(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                      q_last: torch.Tensor | None = None) -> None:
        """Store the prompt's post-RoPE K/V [n, H, D] of one layer (its attention ran densely elsewhere).

        Sink and window pages go to their GPU pages; pages no longer in the window when the next token
        arrives are summarised and offloaded. q_last [Hq, D], the last prompt token's query, seeds the
        first decode step's similarity check; without it that step corrects every head.
        """
        cfg, p = self.cfg, self.cfg.page_size
        n = self._len[slot]
        a = self._shared[slot]  # a request started from a shared prefix passes only its suffix, from token a * p
        if k.shape[0] != n - a * p or v.shape[0] != n - a * p:
            raise ValueError(f"prefill of slot {slot} expects {n - a * p} tokens, got {k.shape[0]}")
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        c = (n - 1) // p
        if self.dense[layer]:
            if self.dense_outside:
                raise ValueError(f"layer {layer} is dense and served outside the engine")
            first = self.layout.dense_base(slot) * p
            kc[first + a * p:first + n] = k
            vc[first + a * p:first + n] = v
            return
        resident = [j for j in range(a, c + 1) if j < cfg.sink_pages or j >= c - cfg.window_pages]
        for j in resident:
            row = self.layout.resident_page(slot, j) * p
            t = min(p, n - j * p)
            kc[row:row + t] = k[(j - a) * p:(j - a) * p + t]
            vc[row:row + t] = v[(j - a) * p:(j - a) * p + t]
        offload = self._prompt_offload(slot)
        lo = (offload.start - a) * p  # in the suffix tensor
        self._offload_prompt(slot, layer, k[lo:lo + len(offload) * p], v[lo:lo + len(offload) * p], offload)
        if q_last is not None:
            self.prev_q[layer, slot] = q_last
        self.has_prev[layer, slot].fill_(q_last is not None)  # not `= bool`: copying a host scalar waits for the device
        self.slot_table[layer, slot] = -1
        self._clear_victims(slot, layer)

    def seed_last_queries(self, layer: int, slots: torch.Tensor, q: torch.Tensor) -> None:
        """prefill_layer's q_last for prompts stored from an outside cache (store_staged): slots [B] int64 on the
        device, q [B, Hq, D] their last queries, kept in prev_q's dtype (the KV cache's). Queues device work only:
        an index put of a Python scalar (has_prev[layer][slots] = True) copies the value to the device and waits for
        the stream, which in an extend made every layer wait for the one before (session 35)."""
        self.prev_q[layer].index_copy_(0, slots, q.to(self.prev_q.dtype))
        self.has_prev[layer].index_fill_(0, slots, True)

    def _prompt_offload(self, slot: int) -> range:
        """The logical pages of a prompt (from its shared prefix on) that are offloaded at prefill: every full page
        past the sink and before the window the first decode step holds."""
        cfg, n = self.cfg, self._len[slot]
        return range(max(cfg.sink_pages, self._shared[slot]), n // cfg.page_size - cfg.window_pages)

    def _offload_prompt(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor, pages: range) -> None:
        """Offload a prompt's pages `pages`, whose K/V are k, v [len(pages) * page_size, H, D], in the selector's
        order (LouisKV's clusters), to their host pages."""
        k, v = self.selector.prompt_pages(slot, layer, k, v, pages)
        if pages:
            i32 = dict(dtype=torch.int32, device=self.device)
            src = torch.arange(len(pages), **i32)
            dst = self.page_table[slot, pages.start:pages.stop]
            valid = torch.ones(len(pages), dtype=torch.bool, device=self.device)
            self._offload(layer, k.contiguous(), v.contiguous(), src, dst, valid, PREFILL_OFFLOAD_PROGRAMS)

    def _offload(self, layer: int, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                 valid: torch.Tensor, programs: int = 0) -> None:
        """offload_pages of a sparse layer's pages (src rows of k, v to host pages dst where valid) with their
        summaries and the selector's codes, in one launch."""
        self.ops.offload_pages(k, v, self.host.arena[:, layer], self.summaries[layer], src, dst, valid,
                               self.cfg.page_size, programs=programs, codes=self.selector.codes(layer),
                               channels=self.selector.code_channels(layer), host_scales=self.host_scales(layer))

    def host_scales(self, layer: int) -> torch.Tensor | None:
        """The row exponents [P, H, 2, p] of a layer of an FP8 host arena (freekv_kernels.fp8_rows), None otherwise:
        the host_scales of every op that reads or writes the arena."""
        return None if self.host.scales is None else self.host.scales[:, layer]

    # ---- shared prefixes (radix prefix sharing, docs/radix.md) --------------------------------

    def owner(self, slot: int) -> int:
        """The host-pool owner id of a slot's request: pages held for it (a kvstore LOOKUP with this request id,
        LocalHostPool.hold) are let go with its other pages when the request is removed."""
        self._check_slot(slot)
        return self._owner[slot]

    def _check_shareable(self, slot: int) -> None:
        self._check_slot(slot)
        if self._pages_of is not None:
            raise ValueError("an engine writing into another's host pages (FastKV's later layers) holds a sequence "
                             "of its own in them: its pages cannot be exported or shared as a prefix")
        if self.selector.needs_whole_prompt:
            raise ValueError(f"retrieval {self.cfg.retrieval!r} writes a prompt's host pages in cluster order, not by "
                             "position: they cannot be shared between requests")

    def export_prefix(self, slot: int, num_pages: int,
                      staged: tuple[Callable[[int], tuple[torch.Tensor, torch.Tensor]], list[int]] | None = None
                      ) -> list[int]:
        """Make the full logical pages [0, num_pages) of a prefilled slot complete in the host arena, every layer (its
        sink pages get host pages, its resident window pages are offloaded with their summaries, engine-held dense
        layers are copied; pages already complete are left alone) and return their host pages, for the caller to
        retain under the prefix key. Call between steps (after end_step). With dense_outside the caller writes the
        dense layers' slices of these host pages itself. The writes are queued on the current stream: the caller
        retains the pages once they have landed (a synchronisation or an event after them).

        staged: for a prompt still being prefilled outside the engine (stage_prefill, store_staged), where its pages
        are: (kv, pages), kv(layer) giving a sparse layer's outside paged cache k, v [T, H, D] and pages the staging
        page of each logical page. Its sink pages are only there until the prompt completes (store_staged then copies
        them to the engine's GPU pages) and store_staged offloaded its full pages past the sink as chunks filled, so
        only the sink pages are written. The caller orders these writes after the forward that filled the staging
        pages (the current stream waits for it)."""
        if staged is not None and not self.dense_outside:
            raise ValueError("a staged prompt's dense layers are the caller's: export from staging needs dense_outside")
        pages = self.export_pages(slot, num_pages)
        self.write_exports([(slot, num_pages, pages)], staged)
        return list(pages)

    def write_exports(self, items: list[tuple[int, int, list[int]]], staged=None) -> None:
        """export_prefix's arena writes for (slot, num_pages, its export_pages) items, one launch a layer for all of
        them: requests that finish together are exported together. staged: as export_prefix's, for one item."""
        cfg, p, s = self.cfg, self.cfg.page_size, self.cfg.sink_pages
        src_pages, dst_pages, dense_pages, host_rows = [], [], [], []
        for slot, num_pages, pages in items:
            todo = range(self._complete[slot], num_pages)
            if staged is None:
                c = (self._len[slot] - 1) // p
                gpu = [j for j in todo if j < s or j >= c - cfg.window_pages]  # the others are offloaded already
                src_pages += [self.layout.resident_page(slot, j) for j in gpu]
            else:
                gpu = [j for j in todo if j < s]
                src_pages += [staged[1][j] for j in gpu]
            dst_pages += [pages[j] for j in gpu]
            dense_pages += [self.layout.dense_base(slot) + j for j in todo]
            host_rows += [pages[j] for j in todo]
        if not dense_pages:
            return
        self.streams.join()  # the offloads queued on the side streams are in before these writes
        H, D = self.shape.num_kv_heads, self.shape.head_dim
        src, dst = upload(src_pages, torch.int32, self.device), upload(dst_pages, torch.int32, self.device)
        valid = torch.ones(len(src_pages), dtype=torch.bool, device=self.device)
        rows, host = self.page_rows(dense_pages), upload(host_rows, torch.int32, self.device)
        for layer in range(self.shape.num_layers):
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            if self.dense[layer]:
                if not self.dense_outside:
                    self.ops.pages_to_host(kc.view(-1, H, D), vc.view(-1, H, D), rows, self.host.arena[:, layer], host,
                                           host_scales=self.host_scales(layer))
            elif src_pages:
                if staged is not None:
                    kc, vc = staged[0](layer)
                self._offload(layer, kc, vc, src, dst, valid, PREFILL_OFFLOAD_PROGRAMS)
        if self.device.type == "cuda" and not self.dense_outside:
            torch.cuda.synchronize(self.device)  # the arena is read next by other requests (and the CPU)
        for slot, num_pages, _ in items:
            self._complete[slot] = max(self._complete[slot], num_pages)

    def export_pages(self, slot: int, num_pages: int) -> list[int]:
        """The host pages of a slot's full logical pages [0, num_pages), the sink's taken from the host pool now if it
        has none yet (a request's sink pages get host pages only to be exported or shared)."""
        self._check_shareable(slot)
        n, p = self._len[slot], self.cfg.page_size
        if not 0 < num_pages <= n // p:
            raise ValueError(f"slot {slot} holds {n} tokens: 1..{n // p} full pages can be exported, not {num_pages}")
        need = min(self.cfg.sink_pages, num_pages) - len(self._sink_host[slot])
        if need > 0:
            self._sink_host[slot].extend(self.host.alloc_extra(self._owner[slot], need))
        return (self._sink_host[slot] + self._host_pages[slot])[:num_pages]

    def exported_by_caller(self, slot: int, num_pages: int) -> list[int]:
        """export_prefix for pages the caller wrote itself, every layer of them, into export_pages' host pages, with
        that work complete on the device: marks them complete and returns their host pages."""
        pages = self.export_pages(slot, num_pages)
        self._complete[slot] = max(self._complete[slot], num_pages)
        return pages

    def begin_prefill_shared(self, slot: int, prefix_pages: list[int], num_tokens: int) -> None:
        """Start a prompt of num_tokens whose first len(prefix_pages) full pages are a shared prefix: prefix_pages are
        the host pages of logical pages 0.. (export_prefix's list), already held for owner(slot). They are mapped,
        never written; the sink pages and the prefix pages in this request's window are recalled from the arena into
        its own GPU pages (every sparse layer; engine-held dense layers copy the whole prefix). Then call
        prefill_layer with the suffix only, tokens [len(prefix_pages) * page_size, num_tokens)."""
        self._check_shareable(slot)
        cfg, p, s = self.cfg, self.cfg.page_size, self.cfg.sink_pages
        if self._len[slot]:
            raise ValueError(f"slot {slot} already holds {self._len[slot]} tokens")
        prefix = [int(x) for x in prefix_pages]
        P, num_host = len(prefix), self.host.arena.shape[0]
        if not 0 < P * p < num_tokens < self.max_pages * p:
            raise ValueError(f"a shared prefix of {P} pages needs a prompt longer than {P * p} tokens (its own "
                             f"suffix) and shorter than max_context {self.max_pages * p}, got {num_tokens}")
        if len(set(prefix)) != P or not all(0 <= hp < num_host for hp in prefix):
            raise ValueError(f"shared prefix pages must be distinct host pages in [0, {num_host}): {prefix}")
        self._sink_host[slot], self._host_pages[slot] = prefix[:s], prefix[s:]
        updates = [(slot, j, prefix[j]) for j in range(s, P)]
        self._ensure_host_pages(slot, -(-num_tokens // p), updates)
        self._upload_page_table(updates)
        self._len[slot], self._shared[slot], self._complete[slot] = num_tokens, P, P
        c = (num_tokens - 1) // p
        res = [j for j in range(P) if j < s or j >= c - cfg.window_pages]
        H, D = self.shape.num_kv_heads, self.shape.head_dim
        sparse = (upload([prefix[j] for j in res], torch.int32, self.device),
                  self.page_rows([self.layout.resident_page(slot, j) for j in res]))
        dense = (upload(prefix, torch.int32, self.device),
                 self.page_rows(range(self.layout.dense_base(slot), self.layout.dense_base(slot) + P)))
        for layer in range(self.shape.num_layers):
            if self.dense[layer] and self.dense_outside:
                continue
            host, rows = dense if self.dense[layer] else sparse
            self.ops.pages_from_host(self.host.arena[:, layer], host, self.k_cache[layer].view(-1, H, D),
                                     self.v_cache[layer].view(-1, H, D), rows, host_scales=self.host_scales(layer))

    def page_rows(self, pages) -> torch.Tensor:
        """The token rows [len(pages) * page_size] of whole pages of a paged [T, H, D] cache, on the engine's device
        (pages: a sequence, or an int64 tensor already there)."""
        p = self.cfg.page_size
        first = pages if isinstance(pages, torch.Tensor) else upload([int(x) for x in pages], torch.int64, self.device)
        return (first[:, None] * p + torch.arange(p, device=self.device)).flatten()

    def load_prefix_summaries(self, host_pages: list[int]) -> None:
        """Rebuild the page summaries (and key codes) of host pages from the arena: a prefix retained by an earlier
        server, whose sketches were GPU state, before its first use here (rewrites the same bytes)."""
        pages = [int(x) for x in host_pages]
        if not pages:
            return
        H, D, p = self.shape.num_kv_heads, self.shape.head_dim, self.cfg.page_size
        i32 = dict(dtype=torch.int32, device=self.device)
        src, dst = torch.arange(len(pages), **i32), upload(pages, torch.int32, self.device)
        valid = torch.ones(len(pages), dtype=torch.bool, device=self.device)
        rows = self.page_rows(range(len(pages)))
        k, v = (torch.empty(len(pages) * p, H, D, dtype=self.dtype, device=self.device) for _ in range(2))
        for layer in range(self.shape.num_layers):
            if self.dense[layer]:
                continue
            self.ops.pages_from_host(self.host.arena[:, layer], dst, k, v, rows, host_scales=self.host_scales(layer))
            self._offload(layer, k, v, src, dst, valid, PREFILL_OFFLOAD_PROGRAMS)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stage_prefill(self, slot: int, num_tokens: int) -> None:
        """A prompt prefilled outside the engine, chunk by chunk, has grown to num_tokens: reserve its host
        pages. Its K/V pages arrive through store_staged, one layer at a time (and store_staged_prompt)."""
        self._check_slot(slot)
        p = self.cfg.page_size
        if not self._len[slot] < num_tokens < self.max_pages * p:
            raise ValueError(f"slot {slot}: a prompt cannot grow from {self._len[slot]} to {num_tokens} tokens "
                             f"within max_context {self.max_pages * p} (one token must remain to decode)")
        updates: list[tuple[int, int, int]] = []
        self._ensure_host_pages(slot, -(-num_tokens // p), updates)
        self._upload_page_table(updates)
        self._len[slot] = num_tokens

    def host_page(self, slot: int, page: int) -> int:
        """Host page of logical page `page` (past the sink pages) of a slot."""
        return self._host_pages[slot][page - self.cfg.sink_pages]

    def store_staged(self, layer: int, k_src: torch.Tensor, v_src: torch.Tensor, offload_src: torch.Tensor,
                     offload_dst: torch.Tensor, offload_valid: torch.Tensor, resident_src: torch.Tensor,
                     resident_dst: torch.Tensor) -> None:
        """Take one sparse layer's prompt pages from an outside paged cache k_src/v_src [T, H, D]: summarise
        pages offload_src and write them to host pages offload_dst; copy pages resident_src to the engine's
        GPU pages resident_dst (the sink and window of prompts that completed). Runs on the recall stream
        after the work queued so far, so it overlaps the next layers; end_step joins it."""
        if self.selector.needs_whole_prompt and offload_src.numel():
            raise ValueError(f"retrieval {self.cfg.retrieval!r} orders a prompt's pages by clusters of all its keys: "
                             "offload a staged prompt whole with store_staged_prompt once its last chunk is in")
        st, p, D = self.streams, self.cfg.page_size, self.shape.head_dim
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        e = st.record()
        with st.on("recall"):
            st.wait(e)
            self._offload(layer, k_src, v_src, offload_src, offload_dst, offload_valid, PREFILL_OFFLOAD_PROGRAMS)
            H = self.shape.num_kv_heads
            kc.view(-1, p, H, D)[resident_dst] = k_src.view(-1, p, H, D)[resident_src]
            vc.view(-1, p, H, D)[resident_dst] = v_src.view(-1, p, H, D)[resident_src]

    def store_staged_prompt(self, layer: int, slot: int, k_src: torch.Tensor, v_src: torch.Tensor,
                            staged: torch.Tensor) -> None:
        """One sparse layer of a prompt whose last chunk is in, whole in an outside paged cache k_src/v_src
        [T, H, D] (staged: the staging page of each of its logical pages, a device tensor): offload the pages
        prefill_layer would, in the selector's order. For a selector that needs the whole prompt (LouisKV clusters
        all its keys), instead of store_staged's offload as chunks fill. Recall stream, like store_staged."""
        st, p, H, D = self.streams, self.cfg.page_size, self.shape.num_kv_heads, self.shape.head_dim
        pages = self._prompt_offload(slot)
        e = st.record()
        with st.on("recall"):
            st.wait(e)
            src = staged[pages.start:pages.start + len(pages)].long()
            k = k_src.view(-1, p, H, D)[src].flatten(0, 1)
            v = v_src.view(-1, p, H, D)[src].flatten(0, 1)
            self._offload_prompt(slot, layer, k, v, pages)

    @property
    def fills_at_prefill(self) -> bool:
        """Whether fill_slots selects anything: speculative retrieval only (LouisKV selects at its boundaries)."""
        return self.retrieval and self.selector.speculative

    def fill_slots(self, slots: list[int],
                   staged: tuple[Callable[[int], tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None = None
                   ) -> None:
        """Select every KV head's pages of prompts just stored (prefill_layer, store_staged) with the query their
        prefill left in prev_q (q_last), and fill their slots with them: the first decode step then starts as every
        later one does, from the pages chosen one step earlier, its correction checking q_1 against q_last. Without
        it that step recalls each head's whole budget from the host before attention. Counts no recall in stats().

        staged: where the prompts' pages still are on the GPU, (kv, pages): kv(layer) gives a sparse layer's outside
        paged cache k, v [T, H, D], pages [len(slots), W] int64 the staging page of each slot's logical pages
        [0, W); the slots are filled HBM to HBM from there. None: they are recalled from the host arena.
        Call after the prompts' offloads are in (end_step) and with every slot's prev_q seeded; a no-op unless
        fills_at_prefill."""
        if not slots or not self.fills_at_prefill:
            return
        for s in slots:
            self._check_slot(s)
        B, p = len(slots), self.cfg.page_size
        if staged is not None and tuple(staged[1].shape[:1]) != (B,):
            raise ValueError(f"staged pages must hold one row per slot ({B}), got {tuple(staged[1].shape)}")
        self._upload_step(slots, [self._len[s] + 1 for s in slots])
        plan = self.plan(B)  # the first decode step's candidates; that step plans again
        queries = self.prev_q[:, plan.req_slots.long()]  # [L, B, Hq, D]
        heads = torch.ones(B, self.shape.num_kv_heads, dtype=torch.bool, device=self.device)  # every head selects
        for layer in range(self.shape.num_layers):
            if self.dense[layer]:
                continue
            recall, q = self._recall[layer][:B], queries[layer]
            self.ops.select_chain(self.selector.fill_input(plan, layer, q, heads, PHASE_NOW), self.slot_table[layer],
                                  plan.req_slots, heads, PHASE_NOW, heads, recall, self.cfg.recall == "all", None,
                                  self.pad_slot)
            if staged is None:
                self.ops.recall_pages(self.host.arena[:, layer], self.k_cache[layer], self.v_cache[layer],
                                      self.page_table, self.slot_table[layer], plan.req_slots, plan.slot_pages, recall,
                                      PHASE_NOW, p, host_scales=self.host_scales(layer))
                continue
            self.ops.staged_to_slots(*staged[0](layer), staged[1], self.slot_table[layer], plan.req_slots,
                                     plan.slot_pages, self.k_cache[layer], self.v_cache[layer], p)

    # ---- decode ------------------------------------------------------------------------------

    def begin_step(self, slots: list[int], pad_to: int | None = None) -> StepPlan:
        """Append one token to each slot's sequence and plan the step (eager decoding)."""
        self.prepare_step(slots, pad_to)
        return self.plan(pad_to or len(slots))

    def plan(self, batch: int) -> StepPlan:
        """Device-side planning from the static step buffers into the static plan buffers, one launch (two with
        cfg.replay_correction_rate or cfg.replay_churn): capturable in a CUDA graph. The plan returned is a view,
        valid until the next plan."""
        cfg, plan = self.cfg, self._plan.rows(batch)
        self.ops.plan_step(plan.req_slots, self._step_lens[:batch], self.page_table, cfg.page_size, cfg.sink_pages,
                           cfg.window_pages, self.pad_slot, self.retrieval, **plan.outputs())
        if self._replay_u is not None:
            self._replay_u[:, :batch].uniform_()  # one launch a step; graph capture replays fresh draws
        if self._replay_late is not None:
            self._replay_late[:, :batch].uniform_()
        return plan

    def prepare_step(self, slots: list[int], pad_to: int | None = None, lens: list[int] | None = None) -> None:
        """Host bookkeeping of a step (host pages, lengths) and upload into the static step buffers.
        Runs outside CUDA graphs; rows past len(slots) up to pad_to are padding. `lens`, when the caller
        tracks lengths itself, must be each slot's length after this step's token (checked)."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a request slot appears twice in the batch: {slots}")
        updates: list[tuple[int, int, int]] = []
        lens_out: list[int] = []
        for s in slots:
            self._check_slot(s)
            if not self._len[s]:
                raise ValueError(f"slot {s} has no prompt: call begin_prefill first")
            n = self._len[s] + 1
            if lens is not None and lens[len(lens_out)] != n:
                raise ValueError(f"slot {s}: the caller says {lens[len(lens_out)]} tokens, the engine holds {n}")
            if n > self.max_pages * self.cfg.page_size:
                raise ValueError(f"slot {s} reached max_context={self.max_pages * self.cfg.page_size}")
            self._ensure_host_pages(s, -(-n // self.cfg.page_size), updates)
            self._len[s] = n
            lens_out.append(n)
        self._upload_page_table(updates)
        pad = (pad_to or len(slots)) - len(slots)
        if pad < 0 or len(slots) + pad > self.num_slots:
            raise ValueError(f"pad_to={pad_to} must lie in [{len(slots)}, {self.num_slots}]")
        if len(slots) + pad > self._step_slots.shape[0]:
            raise ValueError(f"batch of {len(slots) + pad} rows exceeds {self._step_slots.shape[0]}")
        self._upload_step(slots + [self.pad_slot] * pad, lens_out + [1] * pad)
        self._stat_checks += len(slots) * self.shape.num_kv_heads
        self._stat_steps += 1

    def _upload_step(self, slots: list[int], lens: list[int]) -> None:
        """The first len(slots) rows of the static step buffers: request slots and their lengths after the step."""
        host = torch.tensor([slots, lens], dtype=torch.int32)
        self._step_slots[:len(slots)].copy_(host[0], non_blocking=True)
        self._step_lens[:len(slots)].copy_(host[1], non_blocking=True)

    def attend(self, plan: StepPlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention: Attention | None = None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """Store this step's K/V [B, H, D] and return the attention output [B, Hq, D] for q [B, Hq, D].

        attention: for a sparse layer, an outside kernel (engine.Attention) instead of the engine's own: called as
        attention(q, k_cache, v_cache, plan, slots) once the selection before attention has committed, beside its
        recall, slots being the layer's slot table [R, H, k] (the logical page each selection slot of a request's
        head holds, -1 if empty); the call it returns attends after that recall. SGLang's FlashInfer wrapper uses
        it so FreeKV attention rounds exactly as the server's full attention does: freekv_kernels.token_index lists
        each head's tokens from it in logical order (the request's whole context in order when every page is
        selected).
        kv_scale: a sparse layer's (k_scale, v_scale) as SGLang's attention layers carry them (a checkpoint's KV
        scales; 1.0 without), applied by the engine's own attention as SGLang's decode kernels apply them: the
        logits times k_scale, the output times v_scale. An outside kernel applies its own."""
        p, ops = self.cfg.page_size, self.ops
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if self.dense[layer]:
            if self.dense_outside:
                raise ValueError(f"layer {layer} is dense and served outside the engine")
            ops.write_kv(k, v, kc, vc, plan.dense_loc)
            return ops.sparse_decode_attention(q, kc, vc, plan.dense_table, plan.dense_pages, plan.last_page_len,
                                               self.scale, p)
        st = self.streams
        # With retrieval, also which heads select before attention (flagged, or with slots to fill). The same launch
        # writes the step's K/V: into a sink or window page, which no selection or recall touches.
        kv = (k, v, kc, vc, plan.sparse_loc)
        early = self.retrieval and layer in self._anticipated
        only = early and not self.cfg.checks_late  # anticipate() made the layer's only check
        recalled = None
        if self.retrieval:
            if early:  # the check reads the previous queries and slots anticipate() wrote
                commit, recalled = self._anticipated.pop(layer)
                st.wait(commit)
            now = self._now_heads[layer][:q.shape[0]]
            if early and self.cfg.replay_churn is not None:
                self._keep_early.add(layer)
            if only:
                # Stores q for the speculative selection after attention and writes the step's K/V; at tau 0 it flags
                # nothing, as anticipate's check gave every row a previous query and filled every head's slots.
                ops.query_similarity(q, self.prev_q[layer], plan.req_slots, self.has_prev[layer], 0.0,
                                     self.shape.group, None, self.pad_slot, self.slot_table[layer], plan.n_slots, now,
                                     kv=kv)
            else:
                flags = self.selector.trigger(plan, layer, q, now, kv)
        else:
            ops.query_similarity(q, self.prev_q[layer], plan.req_slots, self.has_prev[layer], self.tau,
                                 self.shape.group, self._stat_sim[layer] if self.collect_stats else None, self.pad_slot,
                                 kv=kv)
        e_q = e_sel = e_now = st.record() if self.retrieval else None
        if only:
            e_now = recalled  # the slot table was final at anticipate's commit
            self._flush_speculation(e_sel)
        elif self.retrieval:
            with st.on("select"):
                st.wait(e_q, recalled)  # the check's recall after anticipate's, whose slots it may reselect
                self._select(plan, layer, q, PHASE_NOW, flags)
                e_sel = st.record()
                self._recall_phase(plan, layer, PHASE_NOW)
                e_now = st.record()
            self._flush_speculation(e_sel)  # the previous layer's, beside this layer's recall before attention
        # The slot table is final once the selection has committed: the attention's first call runs beside the
        # recall, which writes only the pages of the slots coded PHASE_NOW, and its second after it.
        st.wait(e_sel)
        scale = self.scale * kv_scale[0]
        own = functools.partial(self._attend_fused, scale=scale) if self.cfg.attention == "fused" else \
            functools.partial(self._attend_split, layer, scale=scale)
        finish = (attention or own)(q, kc, vc, plan, self.slot_table[layer])
        st.wait(e_now)
        out = finish()
        if attention is None and kv_scale[1] != 1.0:
            out = out * kv_scale[1]
        if self.probe is not None:
            self.probe(layer, plan, q, self.slot_table[layer])
        e_attn = st.record()
        if self._defer_speculation and layer != self._last_sparse:
            self._pending = (plan, layer)
        else:
            self._after_attention(plan, layer, e_attn)
        return out

    def anticipate(self, plan: StepPlan, layer: int, predict: Callable[..., torch.Tensor],
                   inputs: tuple[torch.Tensor, ...] = (), borrow: bool = False) -> None:
        """cfg.correct_at "previous_mlp"(_only): predict(*inputs) -> [B, Hq, D], a prediction of sparse layer `layer`'s
        query this step, made while the layer before runs its MLP (from that layer's mid residual); it is called on
        the early stream (above the MLP's in priority), so its projection runs beside that MLP too. `inputs` (the
        tensors it reads) are copied on the caller's stream first and held until the step's join: the next layer's
        fused add-and-norm overwrites SGLang's residual in place, and a tensor freed on the caller's stream could be
        reused while the early stream still reads it. borrow: they are held but not copied, and the caller calls
        inputs_read(layer) before it overwrites them (a wait that the MLP between normally covers, where the copy
        is a launch on the critical path). There the heads whose predicted query turned (group-mean
        cosine to the previous query below tau) select with it and recall now, off the critical path.
        "previous_mlp": their previous query becomes the predicted one, which their selection now follows;
        attend(layer)'s check then compares the real query with the query each head's selection was made with, so
        it corrects only the heads the prediction missed. Rows without a previous query are left to that check.
        "previous_mlp_only": this is the layer's only check (the paper's, with the predicted query: rows without a
        previous query and heads with slots to fill select too, and it keeps the statistics attend's check keeps
        otherwise); attend(layer) only waits for its recall.
        Either way the speculative selection after attention selects with the real query. Call before attend(layer)."""
        if self._early_heads[layer] is None:
            got = "a dense layer" if self.dense[layer] else "no retrieval" if not self.retrieval else \
                repr(self.cfg.correct_at)
            raise ValueError(f"layer {layer}: anticipate needs a sparse layer with retrieval and correct_at "
                             f"'previous_mlp' or 'previous_mlp_only', got {got}")
        G, st = self.shape.group, self.streams
        if not borrow:
            inputs = tuple(t.clone() for t in inputs)
        self._held.append(inputs)
        e = st.record()
        with st.on("early"):
            st.wait(e)
            q = predict(*inputs)
            if borrow:
                self._lent[layer] = st.record()
            B = q.shape[0]
            replay = None  # benchmarks: drawn at the replayed rate (the prediction is still made, as its cost is real)
            if self.cfg.replay_correction_rate is not None:
                replay = (self._replay_u[layer, :B], self.cfg.replay_correction_rate)
            heads = self._early_heads[layer][:B]
            if self.cfg.checks_late:  # query_similarity's early mode: only flagged heads' previous queries become q
                flags = self.ops.query_similarity(q, self.prev_q[layer], plan.req_slots, self.has_prev[layer],
                                                  self.tau, G,
                                                  self._stat_early[layer, :1] if self.collect_stats else None,
                                                  self.pad_slot, replay=replay, early=True, out=heads)
            else:
                flags = self.ops.query_similarity(q, self.prev_q[layer], plan.req_slots, self.has_prev[layer],
                                                  self.tau, G, self._stat_early[layer] if self.collect_stats else None,
                                                  self.pad_slot, self.slot_table[layer], plan.n_slots, heads,
                                                  replay=replay)
            self._select(plan, layer, q, PHASE_NOW, flags, heads=heads)
            commit = st.record()
            self._recall_phase(plan, layer, PHASE_NOW)
            self._anticipated[layer] = (commit, st.record())

    def inputs_read(self, layer: int) -> None:
        """The caller's stream waits until anticipate(layer, borrow=True)'s prediction has read its inputs, which the
        caller is about to overwrite; nothing to wait for if the layer lent none this step."""
        if layer in self._lent:
            self.streams.wait(self._lent.pop(layer))

    def _after_attention(self, plan: StepPlan, layer: int, anchor: torch.cuda.Event | None) -> None:
        """A layer's side-stream work after its attention, once `anchor` (recorded after that attention) is reached:
        the speculative selection with q_i, then on the recall stream its recall, the offload and the selector's
        upkeep."""
        st, e_spec = self.streams, anchor
        speculative = self.retrieval and self.selector.speculative
        # The last sparse layer's lane runs on the select stream, at the critical chain's priority, and recalls with
        # every program it can: no later layer's work hides it and the step's join waits for it. On the speculate
        # stream the output projection, MLP and LM head (all ahead of it in priority) starved its scoring (16 x 32K:
        # the join held the step's sampling ~186 us; session 43's trace), and on the recall stream it queued behind
        # the previous layers' recalls, capped at recall_programs (another ~200 us; session 44's).
        last = layer == self._last_sparse
        if speculative:
            with st.on("select" if last else "speculate"):
                st.wait(anchor)
                self._select(plan, layer, self.prev_q[layer], PHASE_LATER)  # q_i, stored by the trigger
                e_spec = st.record()
        with st.on("select" if last else "recall"):
            st.wait(e_spec)
            if speculative:
                self._recall_phase(plan, layer, PHASE_LATER, programs=0 if last else self.cfg.recall_programs)
            self._offload(layer, self.k_cache[layer], self.v_cache[layer], plan.offload_src, plan.offload_dst,
                          plan.offload_valid)
            if self.retrieval:
                self.selector.after_offload(plan, layer)

    def _flush_speculation(self, anchor: torch.cuda.Event | None = None) -> None:
        """cfg.speculate_at "next_recall": the deferred layer's work after attention, anchored at `anchor` (the next
        sparse layer's commit of its selection before attention, which follows the deferred attention on the compute
        stream), or at the compute stream's present point."""
        if self._pending is not None:
            (plan, layer), self._pending = self._pending, None
            self._after_attention(plan, layer, anchor if anchor is not None else self.streams.record())

    def _attend_fused(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: StepPlan,
                      slots: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
        """cfg.attention "fused" as an Attention: nothing beside the recall before attention; after it, attend_pages
        over the row's pages in one launch (the layers' calls run one after another on the compute stream, so they
        share one set of its counters)."""
        return lambda: self.ops.attend_pages(q, kc, vc, plan.row_table, plan.row_pages, plan.last_page_len, scale,
                                             self.cfg.page_size, self._tickets)

    def _attend_split(self, layer: int, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: StepPlan,
                      slots: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
        """The engine's own sparse attention as an Attention: attend_kept over the pages that stay (it skips the slots
        coded PHASE_NOW, which the recall writes); the returned call merges the recalled slots in."""
        recall, ops, p = self._recall[layer][:q.shape[0]], self.ops, self.cfg.page_size
        kept = ops.attend_kept(q, kc, vc, plan.row_table, plan.row_pages, plan.last_page_len, plan.n_sink,
                               plan.n_slots, recall, PHASE_NOW, scale, p)
        return lambda: ops.attend_recalled(q, kc, vc, plan.slot_pages, plan.n_slots, recall, PHASE_NOW, scale, p, kept)

    def _select(self, plan: StepPlan, layer: int, q: torch.Tensor, phase: int, flags: torch.Tensor | None = None,
                heads: torch.Tensor | None = None):
        """Select with q for the heads of `phase` (PHASE_NOW: those with _now_heads set, PHASE_LATER: the others,
        with q by request slot) and commit their slots; _recall_phase then recalls them (PHASE_NOW's on the select
        stream, PHASE_LATER's on the recall stream). Before attention: flagged heads attend with q_i's selection, and so
        does every head whose selection grew into an empty slot (attention must not miss pages it could hold), so
        those slots are recalled now; the other changed slots (the latter heads' evictions) wait for the recall after
        attention, with the speculative heads'."""
        ops, B = self.ops, plan.req_slots.shape[0]
        heads = self._now_heads[layer][:B] if heads is None else heads  # anticipate(): the heads it flagged
        recall = self._recall[layer][:B]
        timer = self.timer
        if timer is not None:
            timer.mark(layer, phase, 0)
        scores = self.selector.select_input(plan, layer, q, heads, phase)
        victims = self.victims[layer]
        cache = (None, None, None) if victims is None else (victims, self._victim_age[layer],
                                                            self._victim_ops[layer][:B])
        keep = None
        if phase == PHASE_LATER and layer in self._keep_early:
            self._keep_early.discard(layer)
            keep = self._early_heads[layer][:B]
        replay = None if self.cfg.replay_churn is None else Replay(self._replay_u[layer, :B], self.cfg.replay_churn,
                                                                   self.cfg.replay_returns or 0.0, keep)
        ops.select_chain(scores, self.slot_table[layer], plan.req_slots, heads, phase, flags, recall,
                         self.cfg.recall == "all", self._stat_recall[layer] if self.collect_stats else None,
                         self.pad_slot, self.cfg.selection_hysteresis, *cache, replay=replay)
        if timer is not None:
            timer.mark(layer, phase, 1)

    def _recall_phase(self, plan: StepPlan, layer: int, phase: int, programs: int = 0) -> None:
        """Recall the slots that the phase's selection marked in _recall; programs as recall_pages takes it (0: one
        per slot)."""
        timer = self.timer
        if timer is not None:
            timer.mark(layer, phase, 2)
        B = plan.req_slots.shape[0]
        cache = {} if self.victims[layer] is None else dict(
            victim_ops=self._victim_ops[layer][:B], victim_base=self.layout.victim_base(self.num_slots),
            victim_entries=self.cfg.victim_pages)
        self.ops.recall_pages(self.host.arena[:, layer], self.k_cache[layer], self.v_cache[layer], self.page_table,
                              self.slot_table[layer], plan.req_slots, plan.slot_pages, self._recall[layer][:B], phase,
                              self.cfg.page_size, programs=programs,
                              slot_block=0 if phase == PHASE_LATER else self.cfg.recall_block,
                              host_scales=self.host_scales(layer), **cache)
        if timer is not None:
            timer.mark(layer, phase, 3)

    def end_step(self) -> None:
        self._flush_speculation()
        self.streams.join()
        self._held.clear()  # the side streams that read them are joined
        self._keep_early.clear()
        # Both cleared before either error: the next step must not wait on this one's events.
        unattended, unread = sorted(self._anticipated), sorted(self._lent)
        self._anticipated, self._lent = {}, {}
        if unattended:
            raise RuntimeError(f"layers {unattended} were anticipated this step but not attended")
        if unread:
            raise RuntimeError(f"layers {unread} lent their inputs to anticipate this step, and nothing waited for "
                               "the prediction to read them (inputs_read) before they could be overwritten")

    # ---- statistics --------------------------------------------------------------------------

    def enable_step_timing(self, sample_layers: int | None = None) -> bool:
        """Time decode steps' selection and recall from now on (StepTimer; before a CUDA graph is captured, so that
        the graph holds the events): in every sparse layer, or in sample_layers of them spread over the depth, their
        times scaled to all. Only on a GPU: returns whether timing is on."""
        if self.device.type == "cuda" and self.timer is None:
            sparse = [layer for layer in range(self.shape.num_layers) if not self.dense[layer]]
            self.timer = StepTimer(sparse, sample_layers)
        return self.timer is not None

    def step_times(self) -> dict[str, dict[str, float]] | None:
        """The last decode step's seconds of selection (scoring and slot commit) and of recall, summed over the sparse
        layers (estimated from the timed ones where enable_step_timing sampled), by phase ("before_attention",
        "speculative"): {"selection": {...}, "recall": {...}}; None without timing or before the first step.
        Synchronises."""
        times = None if self.timer is None else self.timer.read()
        if times is None:
            return None
        names = {PHASE_NOW: "before_attention", PHASE_LATER: "speculative"}
        return {kind: {names[phase]: t[i] for phase, t in times.items()}
                for i, kind in enumerate(("selection", "recall"))}

    def stats(self) -> dict:
        """Per sparse layer: correction rate (flagged KV-head checks; with cfg.correct_at "previous_mlp" the ones
        the prediction missed, and early_correction_rate the heads anticipate() selected), mean adjacent-query
        cosine, and recalled bytes (before attention / speculative), counted in pages of one KV head
        (`recall_page_bytes` each: its K and V as the host arena holds them). The raw totals over the sparse layers too: (row, KV head) checks, the flagged ones,
        and the pages of one KV head recalled from the host before attention / speculatively, and those taken from
        the victim cache (cfg.victim) instead, which cross no link (all cumulative since the engine was built).
        LouisKV counts a boundary as every KV head of its row flagged (so the correction rate is the share of
        (row, layer) steps that retrieve at a boundary) and its cosine once per row (the mean over all query
        heads). Synchronises: call between steps (stats_snapshot() does not)."""
        return self.stats_snapshot().stats()

    def stats_snapshot(self) -> StatsSnapshot:
        """The counters of stats() copied without a wait; StatsSnapshot.stats() reads them."""
        counters, copied = (self._stat_sim, self._stat_recall, self._stat_early), None
        if self._stat_sim.is_cuda:
            counters = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True).copy_(c, non_blocking=True)
                        for c in counters]
            copied = torch.cuda.Event()
            copied.record()
        else:
            counters = [c.clone() for c in counters]
        return StatsSnapshot(self, *counters, self._stat_steps, self._stat_checks, copied)

    def _stats_of(self, snap: StatsSnapshot) -> dict:
        layers = [layer for layer in range(self.shape.num_layers) if not self.dense[layer]]
        checks = max(snap.checks, 1)
        # Bytes one KV head's page reads from the host: a one-layer, one-head arena page (FP8 rows' exponents included).
        chunk = ArenaGeometry(1, 1, self.cfg.page_size, self.shape.head_dim, self.host.arena.dtype).page_bytes
        flags, cos, cos_n = snap.sim.T.tolist()
        early, early_cos, early_n = snap.early.T.tolist()
        # previous_mlp_only: the cosines of its anticipated layers are the predicted query's to the previous one.
        cos, cos_n = [a + b for a, b in zip(cos, early_cos)], [a + b for a, b in zip(cos_n, early_n)]
        placed_now, placed_later, hits_now, hits_later = snap.recall.T.tolist()
        now = [a - b for a, b in zip(placed_now, hits_now)]
        later = [a - b for a, b in zip(placed_later, hits_later)]
        return {
            "steps": snap.steps,
            "correction_rate": {layer: flags[layer] / checks for layer in layers},
            "early_correction_rate": {layer: early[layer] / checks for layer in layers},
            "mean_cosine": {layer: cos[layer] / max(cos_n[layer], 1) for layer in layers},
            "recall_bytes_now": sum(now[layer] for layer in layers) * chunk,
            "recall_bytes_speculative": sum(later[layer] for layer in layers) * chunk,
            "recall_page_bytes": chunk,
            "checks": snap.checks * len(layers),
            "flagged": round(sum(flags[layer] for layer in layers)),
            "flagged_early": round(sum(early[layer] for layer in layers)),
            "recall_pages_now": round(sum(now[layer] for layer in layers)),
            "recall_pages_speculative": round(sum(later[layer] for layer in layers)),
            "victim_hits_now": round(sum(hits_now[layer] for layer in layers)),
            "victim_hits_speculative": round(sum(hits_later[layer] for layer in layers)),
        }
