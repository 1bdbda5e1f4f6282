"""FreeKV decode attention inside SGLang: a wrapper around the server's Triton or FlashInfer backend.

Extend (prefill) and the dense first layers run on the wrapped backend over SGLang's full KV pool.
Sparse layers decode through the FreeKV engine: when a request first reaches decode, its prompt K/V is
read from SGLang's pool, the pages outside sink and window are summarised and offloaded to the kvstore
arena, and from then on attention reads sink + recalled slots + window from the engine's GPU pages.
SGLang's pool keeps the full KV beside them for now (the memory saving is a later step).

Request identity: the engine's slot is SGLang's req_pool_idx; a new request in a reused slot is
recognised by ReqToTokenPool.req_generation, and the free hook releases a slot's host pages.
Per step, host work (new requests, host pages, lengths) runs in init_forward_metadata_out_graph and
the device plan in init_forward_metadata_in_graph, so a captured decode graph replays the whole
FreeKV step: selection, correction, recall and offload included.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from .engine import FreeKVEngine, ModelShape
from .kvstore_pool import KVStoreHostPool
from .server_args import host_page_bytes, host_page_capacity

logger = logging.getLogger(__name__)

_ACTIVE: list["FreeKVAttnBackend"] = []
_INSTANCE = itertools.count()  # kvstore client ids must differ between backends of one process
# Decode steps between the log lines that report correction rate and recall bytes (reading them syncs).
STATS_EVERY = int(os.environ.get("FREEKV_STATS_EVERY", "512"))


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
        self.req_pool = runner.req_to_token_pool
        dtype = runner.kv_cache_dtype
        if runner.page_size != cfg.page_size:
            raise ValueError(f"SGLang --page-size {runner.page_size} differs from --kv-page-size {cfg.page_size}")
        max_context = self.req_pool.req_to_token.shape[1]
        kv = dict(num_layers=shape.num_layers, num_kv_heads=H, head_dim=shape.head_dim, dtype_bytes=dtype.itemsize)
        page_bytes = host_page_bytes(cfg, **kv)
        host_pages = host_page_capacity(settings, **kv, tp_size=tp_size)
        if host_pages < 1:
            raise ValueError(f"--kvstore-arena-gb {settings.kvstore_arena_gb} holds no page of {page_bytes} bytes")
        endpoint = settings.kvstore_endpoint or os.environ.get("FREEKV_KVSTORE_ENDPOINT")
        if not endpoint:
            raise RuntimeError("no kvstore endpoint: pass --kvstore-endpoint or let the server start its embedded "
                               "daemon (the launcher hook sets FREEKV_KVSTORE_ENDPOINT)")
        host = KVStoreHostPool(endpoint, num_layers=shape.num_layers, num_kv_heads=H, page_size=cfg.page_size,
                               head_dim=shape.head_dim, dtype=dtype, num_pages=host_pages, rank=self.rank,
                               client_id=f"pid{os.getpid()}-tp{self.rank}-{next(_INSTANCE)}")
        # Slot ids are req_pool_idx in [0, size]; SGLang pads captured batches with row 0.
        self.engine = FreeKVEngine(cfg, shape, max_requests=self.req_pool.size + 1, max_context=max_context,
                                   dtype=dtype, device=runner.device, host_pool=host, pad_slot=0,
                                   dense_outside=True)
        self.shape = shape
        self.last_layer = shape.num_layers - 1
        # Wrapping FlashInfer, sparse layers attend through FlashInfer's own decode kernel so they round as
        # the server's full attention does; wrapping Triton, through the engine's split-K kernel.
        self.flashinfer = None
        if type(inner).__name__ == "FlashInferAttnBackend":
            from .flashinfer_attention import FlashInferHeadAttention

            self.flashinfer = FlashInferHeadAttention(inner, cfg, Hq, H, shape.head_dim, self.engine.num_slots,
                                                      runner.device)
        self._generation: dict[int, int] = {}
        self._freed: set[int] = set()
        self._plan = None
        self._steps = 0
        gpu_bytes = sum(t.numel() * t.element_size() for t in self.engine.k_cache + self.engine.v_cache)
        gpu_bytes += sum(t.numel() * t.element_size() for t in self.engine.summaries if t is not None)
        logger.info("FreeKV on rank %d: %s; %d host pages (%.1f GB) at %s; engine GPU memory %.2f GB",
                    self.rank, cfg, host_pages, host_pages * page_bytes / 1e9, endpoint, gpu_bytes / 1e9)
        _ACTIVE.append(self)

    def __getattr__(self, name):
        # Everything FreeKV does not change (metadata objects, flags read by the runners) is the inner backend's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- request lifecycle -------------------------------------------------------------------

    def release(self, slot: int) -> None:
        self._freed.add(slot)

    def _apply_frees(self) -> None:
        # Deferred to the forward stream's next metadata step so in-flight work on the slot finishes first.
        for slot in self._freed:
            if self.engine.is_active(slot):
                self.engine.remove_request(slot)
            self._generation.pop(slot, None)
        self._freed.clear()

    def _ingest(self, slot: int, num_tokens: int, generation: int) -> None:
        """A request's first decode step: hand its prompt (and any tokens decoded so far) to the engine."""
        eng = self.engine
        if eng.is_active(slot):
            eng.remove_request(slot)
        eng.add_request(slot)
        eng.begin_prefill(slot, num_tokens)
        locs = self.req_pool.req_to_token[slot, :num_tokens].long()
        for layer in range(self.shape.num_layers):
            if not eng.dense[layer]:
                eng.prefill_layer(slot, layer, self.pool.get_key_buffer(layer)[locs],
                                  self.pool.get_value_buffer(layer)[locs])
        self._generation[slot] = generation

    def _prepare_decode(self, fb, in_capture: bool, graph: bool) -> None:
        self._apply_frees()
        if in_capture:
            self.engine.prepare_step([], pad_to=fb.batch_size)
            if self.flashinfer is not None:
                self.flashinfer.plan([1] * fb.batch_size, graph=True)
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
        for slot, n, gen in zip(slots, lens, gens):
            if self._generation.get(slot) != gen or not self.engine.is_active(slot):
                self._ingest(slot, n - 1, gen)
        self.engine.prepare_step(slots, pad_to=fb.batch_size, lens=lens)
        if self.flashinfer is not None:
            self.flashinfer.plan(lens + [1] * (fb.batch_size - raw_bs), graph=graph)
        self._steps += 1
        if self._steps % STATS_EVERY == 0:
            self._log_stats()

    def _log_stats(self) -> None:
        st = self.engine.stats()
        rates = list(st["correction_rate"].values())
        logger.info("FreeKV rank %d: %d decode steps, correction rate %.3f (layers %.3f..%.3f), recall %.2f GB "
                    "before attention + %.2f GB speculative", self.rank, st["steps"], sum(rates) / len(rates),
                    min(rates), max(rates), st["recall_bytes_now"] / 1e9, st["recall_bytes_speculative"] / 1e9)

    # ---- AttentionBackend contract -----------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        self.inner.init_forward_metadata(forward_batch)
        if forward_batch.forward_mode.is_decode():
            self._prepare_decode(forward_batch, in_capture=False, graph=False)
            self._plan = self.engine.plan(forward_batch.batch_size)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if forward_batch.forward_mode.is_decode():
            self._prepare_decode(forward_batch, in_capture, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.inner.init_forward_metadata_in_graph(forward_batch)
        if forward_batch.forward_mode.is_decode():
            self._plan = self.engine.plan(forward_batch.batch_size)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.inner.on_after_cuda_graph_warmup()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        lid = layer.layer_id
        eng = self.engine
        if eng.dense[lid]:
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if kwargs.get("sinks") is not None or layer.logit_cap or abs(layer.scaling - eng.scale) > 1e-6:
            raise RuntimeError(f"layer {lid}: FreeKV supports plain softmax attention scaled by 1/sqrt(head_dim) "
                               "(no attention sinks, logit capping or custom scaling)")
        s = self.shape
        k3, v3 = k.reshape(-1, s.num_kv_heads, s.head_dim), v.reshape(-1, s.num_kv_heads, s.head_dim)
        if save_kv_cache:  # SGLang's pool keeps the full KV beside FreeKV's pages
            self.pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k3, v3)
        attention = None if self.flashinfer is None else functools.partial(self.flashinfer.attend, layer)
        o = eng.attend(self._plan, lid, q.reshape(-1, s.num_q_heads, s.head_dim), k3, v3, attention=attention)
        if lid == self.last_layer:
            eng.end_step()
        return o.reshape(-1, s.num_q_heads * s.head_dim)
