"""FreeKV attention inside SGLang: a wrapper around the server's Triton or FlashInfer backend.

SGLang's token pool (patches/_staging_pool.py) keeps every token's KV only for the dense first layers. The
sparse layers' buffers hold staging pages for the prefill in flight (freekv_sglang.staging): extend runs on the
wrapped backend, which writes the chunk's K/V through the pool's page map and reads a chunk's prefix at
translated locations (the backend's planned prefix indices are translated in place before the first sparse
layer). After each sparse layer, the pages the chunk filled are summarised and offloaded to the kvstore arena on a
side stream; when a prompt's last chunk is in, its sink and window pages go to the engine's GPU pages and its
staging pages are released. LouisKV offloads nothing per chunk: in the last chunk's forward each sparse layer
clusters the whole staged prompt and offloads it in cluster order (engine.store_staged_prompt). Sparse layers then
decode through the FreeKV engine alone (sink + recalled slots + window), writing nothing to SGLang's pool.

Request identity: the engine's slot is SGLang's req_pool_idx; a new request in a reused slot is recognised by
ReqToTokenPool.req_generation, and the free hook releases a slot's host and staging pages.
Per step, host work (new requests, host pages, lengths) runs in init_forward_metadata_out_graph and
the device plan in init_forward_metadata_in_graph, so a captured decode graph replays the whole
FreeKV step: selection, correction, recall and offload included.

Host pages the kvstore cannot give (kvstore_pool.HostPagesUnavailable: the daemon unreachable past its deadline, its
session and arena lost, the arena full) end only the requests that need them, through the scheduler (freekv_patches
_aborts.py): a decode step's pages are reserved before SGLang prepares the batch (reserve_decode), so a request that
cannot get them is taken out of the batch and aborted before it runs; a prompt chunk whose pages fail is still
prefilled on the GPU (staging), its offload skipped, and the request is aborted when it would start decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from . import metrics
from .engine import FreeKVEngine, ModelShape, StatsSnapshot, merged_stats, tsp_engines
from .kv_scales import kv_scales
from .kvstore_pool import HostPagesUnavailable, KVStoreHostPool, stable_client_id
from .radix import PrefixSharing, fill_prefix_staging, namespace_of, prefix_fill_index
from .server_args import host_page_bytes, host_page_capacity
from .streams import upload
from .tsp_propagation import causal_attention, pick

logger = logging.getLogger(__name__)

_ACTIVE: list["FreeKVAttnBackend"] = []
_INSTANCE = itertools.count()  # kvstore client ids must differ between backends of one process (tests build several)
# Decode steps between the log lines that report correction rate and recall bytes (reading them syncs), and between
# the updates of FreeKV's Prometheus series (freekv_sglang.metrics, with --enable-metrics).
STATS_EVERY = int(os.environ.get("FREEKV_STATS_EVERY", "512"))
TIMED_LAYERS = 4  # sparse layers whose selection and recall are timed for the metrics (engine.enable_step_timing)


@dataclasses.dataclass
class StagedPrefill:
    """Device index vectors of one extend batch: pages to offload (staging page -> host page) and, for prompts
    this batch completes, sink and window pages to copy (staging page -> engine page). A retrieval that needs
    whole prompts (LouisKV) offloads nothing as chunks fill: `whole` lists the prompts this batch completes, each
    with the staging page of every logical page, for store_staged_prompt. With radix sharing the prompts this batch
    completes are also made whole in the arena by it (_export_in_forward): their sink pages join the offloads, their
    dense layers' rows are copied (dense_rows, dense_dst)."""

    offload_src: torch.Tensor
    offload_dst: torch.Tensor
    offload_valid: torch.Tensor
    resident_src: torch.Tensor
    resident_dst: torch.Tensor
    completed: list[int]
    whole: list[tuple[int, torch.Tensor]]
    continuing: list[int] = dataclasses.field(default_factory=list)  # prompts still in prefill after this batch
    dense_rows: torch.Tensor | None = None  # radix export in the forward: the dense layers' token rows to copy
    dense_dst: torch.Tensor | None = None  # and their host pages (one per page_size rows)
    # Prompts this batch completes with their host pages: the batch row of each one's last token (its query seeds
    # the first decode step's correction), their slots, and for engine.fill_slots the staging page of each of their
    # logical pages [C, W].
    last_rows: torch.Tensor | None = None
    last_slots: torch.Tensor | None = None
    fill: list[int] = dataclasses.field(default_factory=list)
    fill_pages: torch.Tensor | None = None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def on_request_freed(req_pool_idx: int | None) -> None:
    """Called (through a hook) when SGLang frees a request's slot: finish, abort or retract."""
    if req_pool_idx is not None:
        for backend in _ACTIVE:
            backend.release(req_pool_idx)


class FreeKVAttnBackend(AttentionBackend):
    def __init__(self, runner, inner: AttentionBackend, settings):
        self.inner = inner
        self.settings = settings
        cfg = settings.config
        mc = runner.model_config
        tp_size = getattr(runner, "tp_size", 1)
        self.rank = getattr(runner, "tp_rank", 0)
        H = mc.get_num_kv_heads(tp_size)
        Hq = mc.num_attention_heads // tp_size
        shape = ModelShape(mc.num_hidden_layers, Hq, H, mc.head_dim)
        self.pool = runner.token_to_kv_pool
        if not hasattr(self.pool, "page_map"):
            raise RuntimeError("FreeKV's token pool is not in place (patches/kv_pool_build.py did not run)")
        self.staging = self.pool.staging
        self.req_pool = runner.req_to_token_pool
        dtype = runner.kv_cache_dtype
        if runner.page_size != cfg.page_size:
            raise ValueError(f"SGLang --page-size {runner.page_size} differs from --kv-page-size {cfg.page_size}")
        max_context = self.req_pool.req_to_token.shape[1]
        kv = dict(num_layers=shape.num_layers, num_kv_heads=H, head_dim=shape.head_dim, kv_dtype=dtype)
        page_bytes = host_page_bytes(cfg, **kv)
        host_pages = host_page_capacity(settings, **kv, tp_size=tp_size)
        if host_pages < 1:
            raise ValueError(f"--kvstore-arena-gb {settings.kvstore_arena_gb} holds no page of {page_bytes} bytes")
        endpoint = settings.kvstore_endpoint or os.environ.get("FREEKV_KVSTORE_ENDPOINT")
        if not endpoint:
            raise RuntimeError("no kvstore endpoint: pass --kvstore-endpoint or let the server start its embedded "
                               "daemon (the launcher hook sets FREEKV_KVSTORE_ENDPOINT)")
        self.host = host = KVStoreHostPool(
            endpoint, num_layers=shape.num_layers, num_kv_heads=H, page_size=cfg.page_size, head_dim=shape.head_dim,
            dtype=cfg.host_torch_dtype(dtype), num_pages=host_pages, rank=self.rank,
            client_id=stable_client_id(runner, self.rank, next(_INSTANCE)), timeout_s=settings.kvstore_timeout_s)
        # Slot ids are req_pool_idx in [0, size]; SGLang pads captured batches with row 0.
        kw = dict(max_requests=self.req_pool.size + 1, max_context=max_context, dtype=dtype, device=runner.device,
                  pad_slot=0, dense_outside=True)
        # --kv-prefill tsp: layers after the TSP layer hold only each prompt's propagated tokens (then its decode
        # tokens) in an engine of their own, `late`, that writes into the first engine's host pages.
        self.late, self.tsp = None, None
        if cfg.prefill == "tsp":
            self.tsp = getattr(runner, "_freekv_tsp", None)
            if self.tsp is None:
                raise RuntimeError("--kv-prefill tsp: the model's decoder layers are not wrapped for token-selective "
                                   "propagation (freekv_patches' model-runner hook did not run)")
            self.engine, self.late = tsp_engines(cfg, shape, host, **kw)
        else:
            self.engine = FreeKVEngine(cfg, shape, host_pool=host, **kw)
        self.split = cfg.tsp_layer + 1 if self.late is not None else shape.num_layers  # first layer of `late`
        if cfg.anticipates:  # the wrapped decoder layers hand each sparse layer's predicted query
            early = getattr(runner, "_freekv_early", None)
            if early is None:
                raise RuntimeError(f"--kv-correct-at {cfg.correct_at}: the model's decoder layers are not wrapped to "
                                   "predict queries (freekv_patches' model-runner hook did not run)")
            early.target, early.release = self._anticipate, self.engine.inputs_read
        self._early = getattr(runner, "_freekv_early", None) if cfg.anticipates else None
        self._tsp_rows: list[tuple[int, int]] = []  # this extend batch's (slot, prompt tokens), in batch order
        self._tsp_kept: list[int] | None = None  # their propagated tokens, once the TSP layer picked them
        self._tsp_drop: dict[int, int] = {}  # slot -> tokens its prompt did not propagate (late length = len - drop)
        self.shape = shape
        self.last_layer = shape.num_layers - 1
        server_args = getattr(runner, "server_args", None)
        self.radix = None  # with SGLang's radix cache on: prefixes shared as host pages (freekv_sglang.radix)
        if server_args is not None and not server_args.disable_radix_cache:
            if self.late is not None:
                raise RuntimeError("--kv-prefill tsp needs --disable-radix-cache: its later layers hold only the "
                                   "propagated tokens, which no other prompt can share as a prefix")
            self.radix = PrefixSharing(self, namespace_of(server_args.model_path, getattr(server_args, "revision", None),
                                                          dtype, self.rank, tp_size))
        # In a captured decode graph the side streams join after the whole model forward (logits included), so
        # the last layer's speculative selection, recall and offload overlap its MLP and the LM head.
        tail_hooks = getattr(runner, "capture_tail_hooks", None)
        if tail_hooks is None:
            raise RuntimeError("FreeKV joins its side streams through ModelRunner.capture_tail_hooks (sglang 0.5.16); "
                               "this SGLang has none")
        tail_hooks.append(self._join_after_forward)
        # With --kv-attention backend, sparse layers attend through the wrapped backend's own decode kernel
        # (FlashInfer's or SGLang's Triton one), one row per (request, KV head), so they round as the server's full
        # attention does; else through the engine's split kernels (cfg.attention).
        # The late engine's rows hold other lengths, so it plans its own.
        self.head_attention = self.late_head_attention = None
        head_cls = None
        backend = type(inner).__name__ if cfg.attention == "backend" else None
        if backend == "FlashInferAttnBackend":
            from .flashinfer_attention import FlashInferHeadAttention as head_cls
        elif backend == "TritonAttnBackend":
            from .triton_attention import TritonHeadAttention as head_cls
        if head_cls is not None:
            self.head_attention = head_cls(inner, cfg, Hq, H, shape.head_dim, self.engine.num_slots, runner.device)
            if self.late is not None:
                self.late_head_attention = head_cls(inner, cfg, Hq, H, shape.head_dim, self.engine.num_slots,
                                                    runner.device)
        self._generation: dict[int, int] = {}
        self._freed: set[int] = set()
        self._lost: dict[int, HostPagesUnavailable] = {}  # slot -> why its prompt's host pages could not be had
        # Radix sharing: slot -> [full pages its completing prefill forward writes whole into the arena, an event after
        # that forward's copies (None before the forward ran, and on CPU)]; see _export_in_forward.
        self._forward_export: dict[int, list] = {}
        # Radix sharing: slot -> an event after the forward that wrote its prompt's last chunk so far (CUDA only).
        self._chunk_done: dict[int, torch.cuda.Event] = {}
        self._plan = self._late_plan = None
        self._extend: StagedPrefill | None = None
        self._translated = False
        self._prefix_fill: list[tuple[int, int]] = []  # (staging page, host page) of hit prefixes to fill per layer
        self._prefix_index: tuple[torch.Tensor, torch.Tensor] | None = None  # their device indices (prefix_fill_index)
        self._steps = 0
        self._pending_stats: list[list[tuple[StatsSnapshot, int]]] = []  # taken, not yet logged (_log_ready_stats)
        self._metrics = metrics.engine_metrics()  # None unless SGLang exports this scheduler's metrics
        if self._metrics is not None:
            # Before SGLang captures its decode graphs; a few layers only: every timed layer costs ~12 us a step.
            self.engine.enable_step_timing(sample_layers=TIMED_LAYERS)
        engines = self._engines()
        summary_bytes = sum(t.numel() * t.element_size() for e in engines for t in e.summaries if t is not None)
        gpu_bytes = summary_bytes + sum(t.numel() * t.element_size() for e in engines for t in e.k_cache + e.v_cache)
        logger.info("FreeKV on rank %d: %s; %d host pages (%.1f GB) at %s; engine GPU memory %.2f GB for %d request "
                    "slots (page summaries %.2f GB); %d staging pages", self.rank, cfg, host_pages,
                    host_pages * page_bytes / 1e9, endpoint, gpu_bytes / 1e9, self.engine.num_slots,
                    summary_bytes / 1e9, self.staging.num_pages)
        if cfg.replay_correction_rate is not None:
            logger.warning("FreeKV benchmark mode (--kv-bench-correction-rate %g): correction is drawn at random, "
                           "not decided by query similarity; do not serve with it", cfg.replay_correction_rate)
        if cfg.replay_late_rate is not None:
            logger.warning("FreeKV benchmark mode (--kv-bench-late-correction-rate %g): the check after the QKV "
                           "projection is drawn at random too; do not serve with it", cfg.replay_late_rate)
        if cfg.replay_churn is not None:
            logger.warning("FreeKV benchmark mode (--kv-bench-churn %g): selections replace pages at random, not by "
                           "their scores; do not serve with it", cfg.replay_churn)
        _ACTIVE.append(self)

    def __getattr__(self, name):
        # Everything FreeKV does not change (metadata objects, flags read by the runners) is the inner backend's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- calibration -------------------------------------------------------------------------

    @property
    def needs_calibration(self) -> bool:
        """Whether the selection waits for a calibration before the first prompt (selection "channels")."""
        return any(eng.needs_calibration for eng in self._engines())

    def calibrate_layer(self, layer_id: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Model layer layer_id's queries [T, Hq, D] and keys [T, H, D] of the calibration pass, to the selector of
        the engine that holds the layer (dense layers take none)."""
        eng, local = (self.late, layer_id - self.split) if layer_id >= self.split else (self.engine, layer_id)
        if not eng.dense[local] and hasattr(eng.selector, "calibrate"):
            eng.selector.calibrate(local, q, k)

    def uncalibrated_layers(self) -> list[int]:
        """Model layers whose selector still waits for its calibration."""
        return sorted(layer + (self.split if eng is self.late else 0) for eng in self._engines()
                      for layer in eng.uncalibrated_layers())

    # ---- request lifecycle -------------------------------------------------------------------

    def release(self, slot: int) -> None:
        self._freed.add(slot)

    def _apply_frees(self) -> None:
        # Deferred to the forward stream's next metadata step so in-flight work on the slot finishes first. Their host
        # pages go back in one kvstore call: a call each put a round trip a finished request before the next prompt's
        # forward (16 finished requests: 7.9 ms on a 2-core CPU host, session 48).
        if self.radix is not None and self._freed:
            self.radix.retain_written(freeing=self._freed)  # their stashed chunks' copies land before the pages go
        owners = []
        try:
            for slot in self._freed:
                for eng in self._engines():
                    if eng.is_active(slot):
                        owner = eng.remove_request(slot, free_host=False)
                        if owner is not None:
                            owners.append(owner)
                self._tsp_drop.pop(slot, None)
                self._unstage(slot)  # a prompt aborted mid-prefill
                self._generation.pop(slot, None)
                self._lost.pop(slot, None)
                self._forward_export.pop(slot, None)
                self._chunk_done.pop(slot, None)
            self._freed.clear()
        finally:
            if owners:
                self.host.free_many(owners)

    def _engines(self) -> list[FreeKVEngine]:
        return [self.engine] if self.late is None else [self.late, self.engine]  # late first: it uses the pages

    def reserve_decode(self, slots: list[int]) -> dict[int, HostPagesUnavailable]:
        """Scheduler side, before SGLang prepares a decode batch: take from the kvstore now the host pages each slot's
        next token needs (the engine's step then makes no daemon call). Returns the slots that cannot go on, and why:
        their pages could not be had, were in a lost kvstore session, or their prompt's could not be staged."""
        eng, p = self.engine, self.engine.cfg.page_size
        lost: dict[int, HostPagesUnavailable] = {}
        for slot in slots:
            if slot in self._lost:
                lost[slot] = self._lost[slot]
                continue
            if not eng.is_active(slot):
                continue  # _prepare_decode refuses it, naming the slot
            # The engine holds host pages for logical pages [sink, ceil(len / p)) and grows them one step ahead.
            pages = max(0, -(-(eng.seq_len(slot) + 1) // p) - eng.cfg.sink_pages)
            try:
                self.host.reserve(self._owner(slot), pages)
            except HostPagesUnavailable as e:
                lost[slot] = e
        return lost

    def _owner(self, slot: int) -> int:
        # The host pool's owner id of the slot's request (the engine allocates and frees its pages under it).
        return self.engine._owner[slot]

    def kvstore_problem(self) -> HostPagesUnavailable | None:
        """Why a new request could not get host pages now (None: it can)."""
        return self.host.problem()

    def _prepare_extend(self, fb) -> None:
        """Host side of an extend batch: stage each chunk's new pages, grow the engine's prompts, and list the
        pages to offload and to keep resident. A prompt starts at token 0 or at a radix hit's shared prefix.
        Staging pages are mapped before any layer writes, so a chunk's K/V and its prefix land in staging.
        A prompt stays staged until its last chunk is in (its prefix is read from staging), so a whole-prompt
        retrieval (LouisKV) offloads it then, from staging."""
        self._apply_frees()
        self._extend, self._translated, self._prefix_fill = None, False, []
        self.pool.forget_staged_rows()  # page_map changes below
        self._prefix_index = None
        self._tsp_rows, self._tsp_kept = [], None
        slots, raw_bs, done = fb._freekv_req_slots_cpu, fb._freekv_raw_bs, fb._freekv_prefill_done_cpu
        if slots is None or raw_bs is None:
            raise RuntimeError("FreeKV needs the extend batch's request slots on the host; the freekv_patches hooks "
                               "that carry them are not applied")
        pins = getattr(fb, "_freekv_prefix_pins", None) or [None] * len(slots[:raw_bs])
        if raw_bs == 0:  # a CUDA-graph capture batch: no request
            return
        if done is None or fb.extend_prefix_lens_cpu is None or fb.seq_lens_cpu is None:
            raise RuntimeError("FreeKV needs each extend row's prefix, length and prefill completion on the host; "
                               "the freekv_patches hooks that carry them are not applied")
        eng, p, cfg = self.engine, self.engine.cfg.page_size, self.engine.cfg
        slots = [int(x) for x in slots[:raw_bs]]
        gens = self.req_pool.req_generation[slots].tolist()
        lists: dict[str, list[int]] = {k: [] for k in ("map_slot", "map_col", "map_page", "off_src", "off_dst",
                                                         "res_src", "res_dst")}
        completed, whole, dense_export, continuing = [], [], [], []
        last: list[tuple[int, int, list[int]]] = []  # (batch row of the last token, slot, staging pages)
        row = 0
        for slot, a, n, fin, gen, pin in zip(slots, fb.extend_prefix_lens_cpu, fb.seq_lens_cpu[:raw_bs].tolist(),
                                             done, gens, pins):
            if pin is not None and pin.tokens != a:
                if a:
                    raise RuntimeError(f"request slot {slot}: SGLang prefills from token {a}, but the radix match "
                                       f"pinned a shared prefix of {pin.tokens} tokens")
                self.host.free(pin.owner)
                pin = None
            if a == 0 or pin is not None:  # a new request: from scratch, or from a radix hit's shared prefix
                for e in self._engines():
                    if e.is_active(slot):
                        e.remove_request(slot)
                self._unstage(slot)
                self._lost.pop(slot, None)
                self._forward_export.pop(slot, None)
                self._chunk_done.pop(slot, None)
                self._tsp_drop.pop(slot, None)
                eng.add_request(slot, owner=None if pin is None else pin.owner)
                if self.late is not None:
                    self.late.add_request(slot)
                self._generation[slot] = gen
                if pin is not None:
                    self._prefix_fill.extend(self.radix.stage_prefix(slot, pin))
            elif not eng.is_active(slot) or self._generation.get(slot) != gen:
                raise RuntimeError(f"request slot {slot}: a prefill chunk from token {a} continues a prompt FreeKV "
                                   "has not staged")
            # Staged on the GPU even when its host pages fail, so the prefill (dense attention) stays right. Every
            # staged page is mapped again: a radix hit of this batch may have pointed a shared location elsewhere.
            prefix = self.radix.prefix_staging(slot) if self.radix is not None else []
            self.staging.grow(slot, -(-n // p) - len(prefix))
            staged = prefix + self.staging.pages(slot)  # by logical page
            for j, page in enumerate(staged):
                lists["map_slot"].append(slot)
                lists["map_col"].append(j * p)
                lists["map_page"].append(page)
            row += n - a
            (completed if fin else continuing).append(slot)
            if self.late is not None:
                if a or not fin:
                    raise RuntimeError(f"request slot {slot}: --kv-prefill tsp needs each prompt whole in one extend "
                                       f"batch, got tokens [{a}, {n}) of it (pass --chunked-prefill-size -1)")
                self._tsp_rows.append((slot, n))
            if not self._stage_host_pages(slot, n, pin):
                continue  # nothing goes to host pages it does not have; the scheduler aborts it before decode
            if eng.selector.needs_whole_prompt:
                if fin:
                    whole.append((slot, staged))
            else:
                for j in range(max(a // p, cfg.sink_pages), n // p):  # pages this chunk filled, past the sink
                    lists["off_src"].append(staged[j])
                    lists["off_dst"].append(eng.host_page(slot, j))
            if fin:
                last.append((row - 1, slot, staged))
                c = (n - 1) // p
                for j in range(c + 1):
                    if j < cfg.sink_pages or j >= c - cfg.window_pages:
                        lists["res_src"].append(staged[j])
                        lists["res_dst"].append(eng.layout.resident_page(slot, j))
                if self.radix is not None:
                    self._export_in_forward(slot, n, staged, lists, dense_export)
        dev = eng.device
        t = {k: upload(v, torch.int32, dev) for k, v in lists.items()}
        self._prefix_index = prefix_fill_index(eng, self._prefix_fill)
        if lists["map_slot"]:
            locs = self.req_pool.req_to_token[t["map_slot"].long(), t["map_col"].long()]
            self.pool.page_map[(locs // p).long()] = t["map_page"]
        whole = [(slot, upload(staged, torch.int32, dev)) for slot, staged in whole]
        self._extend = StagedPrefill(t["off_src"], t["off_dst"], torch.ones_like(t["off_src"], dtype=torch.bool),
                                     t["res_src"].long(), t["res_dst"].long(), completed, whole, continuing)
        if last:
            ext = self._extend
            ext.last_rows, ext.last_slots = (upload(x, torch.int64, dev)
                                             for x in zip(*[(r, slot) for r, slot, _ in last]))
            if eng.fills_at_prefill:
                ext.fill = [slot for _, slot, _ in last]
                width = max(len(staged) for _, _, staged in last)
                ext.fill_pages = upload([staged + [0] * (width - len(staged)) for _, _, staged in last], torch.int64,
                                        dev)
        if dense_export:
            self._extend.dense_rows = torch.cat([self.req_pool.req_to_token[slot, first * p:(first + len(pages)) * p]
                                                 for slot, first, pages in dense_export]).to(dev, torch.int64)
            self._extend.dense_dst = upload([hp for _, _, pages in dense_export for hp in pages], torch.int32, dev)

    def _export_in_forward(self, slot: int, n: int, staged: list[int], lists: dict[str, list[int]],
                           dense_export: list[tuple[int, int, list[int]]]) -> None:
        """Radix sharing, a prompt this extend batch completes: besides the offload of its full pages past the sink,
        have this forward write what its export needs (its sink pages from staging, its dense layers' K/V from
        SGLang's pool into their host pages), so the export that follows the forward only retains them. Exported
        after the forward instead (PrefixSharing.export), the copies and the device synchronisation before the
        retain ran on the scheduler thread, where SGLang's overlap scheduler had already launched the next forward:
        a burst of prompts waited for each other's prefills (+25% time to first token at 8 x 32K, session 19)."""
        eng, p = self.engine, self.engine.cfg.page_size
        first, num_pages = eng._complete[slot], n // p  # complete already: a hit's shared prefix, exported chunks
        if num_pages <= first:
            return
        try:
            pages = eng.export_pages(slot, num_pages)
        except HostPagesUnavailable as e:  # no room for its sink: the export after the forward fails the same way
            logger.warning("FreeKV rank %d: request slot %d's prompt cannot be shared: %s", self.rank, slot, e)
            return
        for j in range(first, min(eng.cfg.sink_pages, num_pages)):
            lists["off_src"].append(staged[j])
            lists["off_dst"].append(pages[j])
        dense_export.append((slot, first, pages[first:]))
        self._forward_export[slot] = [num_pages, None]

    def chunk_done(self, slot: int) -> torch.cuda.Event | None:
        """An event after the forward that wrote the slot's prompt's last chunk so far (None on CPU)."""
        return self._chunk_done.get(slot)

    def forward_exported(self, slot: int) -> int:
        """Full pages of the slot's prompt its completed prefill forward wrote whole into the arena (0: none), after
        waiting for that forward's copies (SGLang calls the export once the forward's results are in: no wait then)."""
        entry = self._forward_export.get(slot)
        if entry is None or entry[1] is None and self.engine.device.type == "cuda":  # its forward has not run yet
            return 0
        if entry[1] is not None:
            entry[1].synchronize()
        return entry[0]

    def _stage_host_pages(self, slot: int, n: int, pin=None) -> bool:
        """Grow a prompt to n tokens in the engine (host pages from the kvstore), starting from a radix hit's shared
        prefix pin; False when the slot's host pages are lost (now or before): its chunks are then prefilled without
        offload."""
        if slot not in self._lost:
            eng = self.engine
            try:  # raises for an owner whose earlier pages are gone too: nothing is written past them
                self.host.reserve(self._owner(slot), max(0, -(-n // eng.cfg.page_size) - eng.cfg.sink_pages))
                if pin is None:
                    eng.stage_prefill(slot, n)
                else:
                    eng.begin_prefill_shared(slot, list(pin.pages), n)
            except HostPagesUnavailable as e:
                self._lost[slot] = e
                logger.warning("FreeKV rank %d: request slot %d loses its host pages (%s); it ends with an abort",
                               self.rank, slot, e)
        return slot not in self._lost

    def _unstage(self, slot: int) -> None:
        if self.radix is not None:
            self.radix.release_staging(slot)
            self.radix.unstage_prefix(slot)
        else:
            self.staging.release(slot)

    def _translate_prefix_indices(self, fb) -> None:
        """Point the wrapped backend's planned paged-KV indices of this extend batch at staging rows."""
        md = self.inner.forward_metadata
        prefix = sum(fb.extend_prefix_lens_cpu or ())
        if hasattr(md, "prefill_wrappers"):  # FlashInfer: the paged wrapper reads the prefix, or every token
            if md.use_ragged and md.extend_no_prefix:
                return
            n = prefix if md.use_ragged else int(fb.seq_lens_sum)
            indices = md.prefill_wrappers[0]._paged_kv_indices_buf
        else:  # Triton: the prefix only
            n, indices = prefix, md.kv_indices
        if n:
            indices[:n] = self.pool.translate(indices[:n])

    def _prepare_decode(self, fb, in_capture: bool, graph: bool) -> None:
        early = self._early
        if early is not None and early.weights_stale and not in_capture:  # weights updated since the last decode
            n = early.refresh_weights()
            logger.info("FreeKV: re-derived %d e4m3 W_q copies (--kv-early-weights fp8) after a weight update", n)
        self._apply_frees()
        self.pool.forget_staged_rows()  # the locations' buffers are rewritten for this step
        if in_capture:
            for eng, head in self._heads():
                eng.prepare_step([], pad_to=fb.batch_size)
                if head is not None:
                    head.plan([1] * fb.batch_size, graph=True)
            return
        slots = getattr(fb, "_freekv_req_slots_cpu", None)
        raw_bs = getattr(fb, "_freekv_raw_bs", None)
        if slots is None or raw_bs is None or fb.seq_lens_cpu is None:
            raise RuntimeError("FreeKV needs the decode batch's request slots and lengths on the host; the "
                               "freekv_patches hooks that carry them are not applied")
        # Rows past raw_bs pad a captured batch (SGLang pads with slot 0, the engine's padding slot).
        slots = [int(s) for s in slots[:raw_bs]]
        lens = fb.seq_lens_cpu[:raw_bs].tolist()
        gens = self.req_pool.req_generation[slots].tolist()
        for slot, gen in zip(slots, gens):
            if self._generation.get(slot) != gen or not self.engine.is_active(slot):
                raise RuntimeError(f"request slot {slot} reached decode without its prefill passing through FreeKV")
            if slot in self._lost:
                raise RuntimeError(f"request slot {slot} reached decode though its host pages are lost "
                                   f"({self._lost[slot]}): freekv_patches' scheduler hook did not take it out")
        pad = [1] * (fb.batch_size - raw_bs)
        for eng, head in self._heads():  # the first engine first: the late one writes into its host pages
            if eng is self.late:
                lens = [n - self._tsp_drop[slot] for slot, n in zip(slots, lens)]
            eng.prepare_step(slots, pad_to=fb.batch_size, lens=lens)
            if head is not None:
                head.plan(lens + pad, graph=graph)
        self._steps += 1
        if self._steps % STATS_EVERY == 0:
            self._pending_stats.append(self._snapshots())
        self._log_ready_stats()

    def _heads(self):
        """(engine, its head attention) of each engine, the first engine first."""
        yield self.engine, self.head_attention
        if self.late is not None:
            yield self.late, self.late_head_attention

    def _snapshots(self) -> list[tuple[StatsSnapshot, int]]:
        """Every engine's counters, (snapshot, its first model layer) each, taken without a wait."""
        parts = [(self.engine.stats_snapshot(), 0)]
        if self.late is not None:
            parts.append((self.late.stats_snapshot(), self.split))
        return parts

    def _log_ready_stats(self) -> None:
        """Logs the snapshots whose copies have landed, oldest first: on a GPU a step or two after they were taken,
        never waiting for one."""
        while self._pending_stats and all(snap.ready() for snap, _ in self._pending_stats[0]):
            self._log_stats(merged_stats(self._pending_stats.pop(0)))

    def _log_stats(self, st: dict) -> None:
        rates = list(st["correction_rate"].values())
        # The raw counts too, so that a benchmark can difference two lines exactly (benchmarks/decode.py).
        logger.info("FreeKV rank %d: %d decode steps, correction rate %.3f (layers %.3f..%.3f), recall %.2f GB "
                    "before attention + %.2f GB speculative, victim cache %d + %d pages; %d checks, %d flagged, "
                    "%d + %d pages recalled, %d flagged early", self.rank, st["steps"], sum(rates) / len(rates),
                    min(rates), max(rates),
                    st["recall_bytes_now"] / 1e9, st["recall_bytes_speculative"] / 1e9, st["victim_hits_now"],
                    st["victim_hits_speculative"], st["checks"], st["flagged"], st["recall_pages_now"],
                    st["recall_pages_speculative"], st["flagged_early"])
        if self.radix is not None:
            r = self.radix
            logger.info("FreeKV rank %d radix: %d hits (%d tokens), %d pages exported in %.3f s, %d exports failed, "
                        "%d matches deferred for staging room, %d cut to it (%d pages short)", self.rank, r.hits,
                        r.hit_tokens, r.exported_pages, r.export_s, r.export_failures, r.deferred_matches,
                        r.cut_matches, r.cut_pages)
        if self._metrics is not None:
            eng, host = self.engine, self.engine.host
            active = sum(1 for slot in range(eng.num_slots) if eng.is_active(slot))
            self._metrics.update(st, resident_pages=active * eng.cfg.resident_pages,
                                 arena_used_pages=getattr(host, "used_pages", None),
                                 arena_pages=getattr(host, "num_pages", None), step_times=eng.step_times())

    # ---- AttentionBackend contract -----------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        self.inner.init_forward_metadata(forward_batch)
        if self.tsp is not None:
            self.tsp.clear()
        if forward_batch.forward_mode.is_decode():
            self._prepare_decode(forward_batch, in_capture=False, graph=False)
            self._make_plans(forward_batch.batch_size)
        elif forward_batch.forward_mode.is_extend():
            self._prepare_extend(forward_batch)

    def _make_plans(self, bs: int) -> None:
        self._plan = self.engine.plan(bs)
        if self.late is not None:
            self._late_plan = self.late.plan(bs)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if self.tsp is not None:
            self.tsp.clear()
        if forward_batch.forward_mode.is_decode():
            self._prepare_decode(forward_batch, in_capture, graph=True)
        elif forward_batch.forward_mode.is_extend():
            self._prepare_extend(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.inner.init_forward_metadata_in_graph(forward_batch)
        if forward_batch.forward_mode.is_decode():
            self._make_plans(forward_batch.batch_size)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.inner.on_after_cuda_graph_warmup()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        lid = layer.layer_id
        if self._tsp_rows:  # else a warmup batch (no request): every layer as without TSP
            if lid >= self.split:
                return self._late_extend(q, k, v, layer)
            if lid == self.split - 1:
                self._pick_propagated(q, k)
        if not self.pool.is_staged(lid):
            o = self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
            ext = self._extend
            if ext is not None and ext.dense_rows is not None:  # the layer's K/V of prompts completed, to the arena
                self.engine.ops.pages_to_host(self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid),
                                              ext.dense_rows, self.engine.host.arena[:, lid], ext.dense_dst,
                                              host_scales=self.engine.host_scales(lid))
            return o
        if not self._translated:
            self._translate_prefix_indices(forward_batch)
            self._translated = True
        fill_prefix_staging(self.engine, self.pool, lid, self._prefix_index)
        if self._reads_chunk_from_pool():
            o = self._extend_from_pool(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        else:
            o = self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        ext = self._extend
        if ext is not None:
            if ext.last_rows is not None:  # the completed prompts' last queries, as prefill_layer's q_last
                s = self.shape
                self.engine.seed_last_queries(lid, ext.last_slots,
                                              q.reshape(-1, s.num_q_heads, s.head_dim)[ext.last_rows])
            kb, vb = self.layer_kv(lid)
            self.engine.store_staged(lid, kb, vb, ext.offload_src, ext.offload_dst, ext.offload_valid,
                                     ext.resident_src, ext.resident_dst)
            for slot, staged in ext.whole:  # LouisKV: the prompt's clusters, now that all its keys are in
                self.engine.store_staged_prompt(lid, slot, kb, vb, staged)
            if lid == self.split - 1:  # the first engine's last layer (the model's, without TSP)
                # Join the offloads before staging pages are reused or the engine decodes these prompts.
                self.engine.end_step()
                # Their slots, from the staging pages, before those are released: the first decode step then recalls
                # only what its correction changes.
                self.engine.fill_slots(ext.fill, staged=(self.layer_kv, ext.fill_pages))
                exported = [slot for slot in ext.completed if slot in self._forward_export]
                if self.engine.device.type == "cuda" and (exported or ext.continuing and self.radix is not None):
                    done = torch.cuda.Event()
                    done.record()
                    for slot in exported:
                        self._forward_export[slot][1] = done
                    for slot in ext.continuing:  # a chunk SGLang stashes next: its export waits for this on the GPU
                        self._chunk_done[slot] = done
                for slot in ext.completed:
                    self._unstage(slot)
                self._extend = None
        return o

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's pool buffers K, V [T, H, D] of a model layer: a sparse layer's rows are its staging pages."""
        return self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer)

    def _pick_propagated(self, q, k) -> None:
        """The TSP layer: per prompt of the batch, the tokens that propagate past it (tsp_propagation.pick), handed to
        the wrapped decoder layers as rows of the batch's tokens."""
        s = self.shape
        kept, self._tsp_kept = pick(self.engine.ops.tsp_select, q, k, self._tsp_rows, self.engine.cfg.tsp_keep,
                                    self.engine.scale, s.num_q_heads, s.num_kv_heads, s.head_dim)
        self.tsp.pick(kept, sum(n for _, n in self._tsp_rows))

    def _late_extend(self, q, k, v, layer):
        """A layer after the TSP layer: each prompt's propagated tokens attend causally among themselves, and the late
        engine stores their K/V as the prompt of its sequence (sink and window pages on the GPU, the rest to the
        host pages the first engine holds for the same logical pages)."""
        s, late, local = self.shape, self.late, layer.layer_id - self.split
        if self._tsp_kept is None:
            raise RuntimeError("--kv-prefill tsp: a later layer ran before the TSP layer picked its tokens")
        q3 = q.reshape(-1, s.num_q_heads, s.head_dim)
        k3, v3 = k.reshape(-1, s.num_kv_heads, s.head_dim), v.reshape(-1, s.num_kv_heads, s.head_dim)
        out = torch.empty_like(q3)
        ks, vs = kv_scales(layer)
        start = 0
        for (slot, n), m in zip(self._tsp_rows, self._tsp_kept):
            rows = slice(start, start + m)
            out[rows] = causal_attention(q3[rows], k3[rows], v3[rows], layer.scaling * ks)
            if slot not in self._lost:  # else no host pages: aborted before it decodes
                if local == 0:
                    late.begin_prefill(slot, m)
                    self._tsp_drop[slot] = n - m
                late.prefill_layer(slot, local, k3[rows], v3[rows], q3[start + m - 1])  # the prompt's last token
            start += m
        if vs != 1.0:
            out *= vs
        if local == late.shape.num_layers - 1:  # the later layers' slots too, from the host (no staging here)
            late.fill_slots([slot for slot, _ in self._tsp_rows if slot not in self._lost])
        return out.reshape(-1, s.num_q_heads * s.head_dim)

    def _reads_chunk_from_pool(self) -> bool:
        """SGLang's Triton backend with --enable-deterministic-inference (its unified extend kernel) reads the
        chunk's own K/V back from the pool at out_cache_loc, not from the k / v it is given."""
        return bool(getattr(self.inner, "enable_deterministic", False)) and \
            not hasattr(self.inner.forward_metadata, "prefill_wrappers")

    def _extend_from_pool(self, q, k, v, layer, fb, save_kv_cache, **kwargs):
        """A staged layer's extend for a backend that reads the chunk from the pool: write the chunk first (the
        pool translates its locations to staging rows), then let the kernel read those staging rows. Without
        this it reads SGLang's token locations in a staging-sized buffer: out of bounds."""
        if save_kv_cache:
            scales = () if getattr(layer, "k_scale", None) is None else (layer.k_scale, layer.v_scale)
            pool = self.pool
            pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, pool.head_num, pool.head_dim),
                               v.view(-1, pool.head_num, pool.v_head_dim), *scales)
        raw, fb.out_cache_loc = fb.out_cache_loc, self.pool.staged_rows(fb.out_cache_loc)
        try:
            return self.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=False, **kwargs)
        finally:
            fb.out_cache_loc = raw

    def _anticipate(self, lid: int, predict, inputs) -> None:
        """--kv-correct-at previous_mlp(_only): decoder layer lid's query predicted by predict(*inputs) -> [T, Hq * D]
        from the layer before's mid residual (inputs, lent: the wrapped input norm of layer lid calls the engine's
        inputs_read before it overwrites them), in a decode forward; its engine corrects the heads whose prediction
        turned while that layer's MLP runs."""
        if self._plan is None or self.engine.dense[lid]:
            return
        s = self.shape
        self.engine.anticipate(self._plan, lid, lambda *x: predict(*x).view(-1, s.num_q_heads, s.head_dim), inputs,
                               borrow=True)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        lid = layer.layer_id
        eng, local, plan, head = self.engine, lid, self._plan, self.head_attention
        if lid >= self.split:
            eng, local, plan, head = self.late, lid - self.split, self._late_plan, self.late_head_attention
        if eng.dense[local]:
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if kwargs.get("sinks") is not None or layer.logit_cap or abs(layer.scaling - eng.scale) > 1e-6:
            raise RuntimeError(f"layer {lid}: FreeKV supports plain softmax attention scaled by 1/sqrt(head_dim) "
                               "(no attention sinks, logit capping or custom scaling)")
        s = self.shape
        k3, v3 = k.reshape(-1, s.num_kv_heads, s.head_dim), v.reshape(-1, s.num_kv_heads, s.head_dim)
        # The row kernels take the layer's KV scales themselves, the engine's own attention here.
        attention = None if head is None else functools.partial(head.attend, layer)
        kv_scale = (1.0, 1.0) if head is not None else kv_scales(layer)
        o = eng.attend(plan, local, q.reshape(-1, s.num_q_heads, s.head_dim), k3, v3, attention=attention,
                       kv_scale=kv_scale)
        if lid == self.last_layer and not _capturing():
            for e in self._engines():
                e.end_step()  # eager; a captured graph joins in _join_after_forward
        return o.reshape(-1, s.num_q_heads * s.head_dim)

    def _join_after_forward(self, graph_runner, out, forward_batch, num_tokens) -> None:
        if forward_batch.forward_mode.is_decode():
            for eng in self._engines():
                eng.end_step()
