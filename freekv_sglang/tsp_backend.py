"""--kv-prefill tsp without FreeKV retrieval: FastKV's token-selective propagation over SGLang's own KV pool.

A wrapper around the server's attention backend. Layers up to the TSP layer run on it unchanged (every prompt token,
full KV in SGLang's pool). In the TSP layer's extend the wrapper picks each prompt's propagated tokens
(tsp_propagation.pick); the wrapped decoder layers then carry only those. The later layers' K/V of a request is its
propagated tokens compacted in position order, then its decode tokens: logical token i of those layers lives in the
pool at the request's token slot req_to_token[slot, i] (their own layers' buffers; the slot is the request's, so it
is allocated for as long as the request lives), so the later layers' sequence is shorter by the tokens the prompt did
not propagate (`drop`, per request slot). Their prefill attention runs causally among the propagated tokens; their
decode attention is FlashInfer's decode over req_to_token[slot, :len - drop], planned outside CUDA graphs like
SGLang's own, with the page list written on the device by SGLang's index kernel, and the step's K/V written at
req_to_token[slot, len - drop - 1]. On CPU (tests) that decode is a plain softmax over the same tokens.

Needs page size 1 (SGLang's default), whole prompts per extend batch and no radix cache (server_args refuses the rest).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from .kv_scales import kv_scales
from .ops import load_ops
from .streams import upload
from .tsp_propagation import causal_attention, pick

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace when the wrapped backend has none (Triton)


class TSPAttnBackend(AttentionBackend):
    def __init__(self, runner, inner: AttentionBackend, tsp_layer: int, keep: int):
        self.inner, self.split, self.keep = inner, tsp_layer + 1, keep
        self.tsp = getattr(runner, "_freekv_tsp", None)
        if self.tsp is None:
            raise RuntimeError("--kv-prefill tsp: the model's decoder layers are not wrapped for token-selective "
                               "propagation (freekv_patches' model-runner hook did not run)")
        if runner.page_size != 1:
            raise ValueError(f"--kv-prefill tsp without --kv-retrieval freekv needs --page-size 1, got "
                             f"{runner.page_size}")
        mc = runner.model_config
        self.Hq, self.H, self.D = mc.num_attention_heads, mc.get_num_kv_heads(1), mc.head_dim
        self.pool = runner.token_to_kv_pool
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.device = torch.device(runner.device)
        self.ops = load_ops("triton" if self.device.type == "cuda" else "torch")
        slots = self.req_to_token.shape[0]
        self.drop = torch.zeros(slots, dtype=torch.int32, device=self.device)  # per slot: tokens not propagated
        self._drop = [0] * slots  # its host copy
        self._rows: list[tuple[int, int]] = []  # this extend batch's (slot, prompt tokens)
        self._kept: list[int] | None = None
        self._late_loc = None  # this decode step's later-layer K/V rows (a static buffer under CUDA graphs)
        dtypes = (runner.kv_cache_dtype, getattr(runner, "dtype", runner.kv_cache_dtype))
        self.decode = (FlashInferLateDecode if self.device.type == "cuda" else TorchLateDecode)(
            inner, self.Hq, self.H, self.D, self.req_to_token, self.pool.size + 1, dtypes, self.device)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- metadata ----------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        self.inner.init_forward_metadata(forward_batch)
        self._prepare(forward_batch, graph=False)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._prepare(forward_batch, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.inner.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.inner.on_after_cuda_graph_warmup()

    def _slots(self, fb) -> tuple[list[int], int]:
        slots, raw_bs = getattr(fb, "_freekv_req_slots_cpu", None), getattr(fb, "_freekv_raw_bs", None)
        if slots is None or raw_bs is None:
            raise RuntimeError("--kv-prefill tsp needs each batch's request slots on the host; the freekv_patches "
                               "hooks that carry them are not applied")
        return [int(s) for s in slots], raw_bs

    def _prepare(self, fb, graph: bool) -> None:
        self.tsp.clear()
        self._rows, self._kept = [], None
        mode = fb.forward_mode
        if mode.is_extend():
            slots, raw_bs = self._slots(fb)
            if raw_bs == 0:
                return  # warmup: no request, every layer as without TSP
            prefix, done = fb.extend_prefix_lens_cpu, getattr(fb, "_freekv_prefill_done_cpu", None)
            lens = fb.seq_lens_cpu[:raw_bs].tolist()
            for i, (slot, n) in enumerate(zip(slots[:raw_bs], lens)):
                if (prefix is not None and prefix[i]) or (done is not None and not done[i]):
                    raise RuntimeError(f"request slot {slot}: --kv-prefill tsp needs each prompt whole in one extend "
                                       "batch (pass --chunked-prefill-size -1 and --disable-radix-cache)")
                self._rows.append((slot, n))
        elif mode.is_decode():
            slots, raw_bs = self._slots(fb)
            bs = fb.batch_size
            host = [n - (self._drop[s] if i < raw_bs else 0)
                    for i, (s, n) in enumerate(zip(slots, fb.seq_lens_cpu[:bs].tolist()))]
            late = fb.seq_lens[:bs] - self.drop[fb.req_pool_indices[:bs].long()]
            self._late_loc = self.decode.plan(fb.req_pool_indices[:bs], late, host, graph)

    # ---- forward -----------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        lid = layer.layer_id
        if self._rows:
            if lid >= self.split:
                return self._late_extend(q, k, v, layer)
            if lid == self.split - 1:
                kept, self._kept = pick(self.ops.tsp_select, q, k, self._rows, self.keep, layer.scaling, self.Hq,
                                        self.H, self.D)
                self.tsp.pick(kept, sum(n for _, n in self._rows))
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def _late_extend(self, q, k, v, layer):
        if self._kept is None:
            raise RuntimeError("--kv-prefill tsp: a later layer ran before the TSP layer picked its tokens")
        q3 = q.reshape(-1, self.Hq, self.D)
        k3, v3 = k.reshape(-1, self.H, self.D), v.reshape(-1, self.H, self.D)
        out = torch.empty_like(q3)
        ks, vs = kv_scales(layer)
        locs, start = [], 0
        for (slot, n), m in zip(self._rows, self._kept):
            rows = slice(start, start + m)
            out[rows] = causal_attention(q3[rows], k3[rows], v3[rows], layer.scaling * ks)
            locs.append(self.req_to_token[slot, :m])
            start += m
        if vs != 1.0:
            out *= vs
        self.pool.set_kv_buffer(layer, torch.cat(locs).long(), k3, v3)
        if layer.layer_id == self.split:  # once per batch: the later layers' sequences are shorter by this
            slots = [slot for slot, _ in self._rows]
            drops = [n - m for (_, n), m in zip(self._rows, self._kept)]
            for slot, d in zip(slots, drops):
                self._drop[slot] = d
            self.drop[upload(slots, torch.int64, self.device)] = upload(drops, torch.int32, self.device)
        return out.reshape(-1, self.Hq * self.D)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if layer.layer_id < self.split:
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if kwargs.get("sinks") is not None or layer.logit_cap:
            raise RuntimeError(f"layer {layer.layer_id}: --kv-prefill tsp decodes plain softmax attention (no "
                               "attention sinks or logit capping)")
        self.pool.set_kv_buffer(layer, self._late_loc, k.reshape(-1, self.H, self.D), v.reshape(-1, self.H, self.D))
        lid = layer.layer_id
        ks, vs = kv_scales(layer)
        o = self.decode.attend(q.reshape(-1, self.Hq, self.D), self.pool.get_key_buffer(lid),
                               self.pool.get_value_buffer(lid), layer.scaling * ks)
        return (o if vs == 1.0 else o * vs).reshape(-1, self.Hq * self.D)


class TorchLateDecode:
    """The later layers' decode attention in plain torch (CPU: tests), over the same tokens as FlashInfer's."""

    def __init__(self, inner, Hq, H, D, req_to_token, max_tokens, dtypes, device):
        self.G, self.req_to_token = Hq // H, req_to_token

    def plan(self, req_pool_indices, late_lens, host_lens: list[int], graph: bool) -> torch.Tensor:
        self.rows = [self.req_to_token[int(s), :n].long() for s, n in zip(req_pool_indices.tolist(), host_lens)]
        return torch.stack([r[-1] for r in self.rows])

    def attend(self, q, k_buf, v_buf, scale):
        out = torch.empty_like(q)
        for b, rows in enumerate(self.rows):
            k = k_buf[rows].float().repeat_interleave(self.G, 1)  # [n, Hq, D]
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, -1)
            out[b] = torch.einsum("hn,nhd->hd", w, v_buf[rows].float().repeat_interleave(self.G, 1)).to(q.dtype)
        return out


class FlashInferLateDecode:
    """The later layers' decode attention: FlashInfer's paged decode (page size 1) over each request's compacted
    token slots, one wrapper per captured batch size with static buffers, planned on the host before each step."""

    def __init__(self, inner, Hq, H, D, req_to_token, max_tokens, dtypes, device):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

        self._wrapper_cls, self._index_kernel = BatchDecodeWithPagedKVCacheWrapper, create_flashinfer_kv_indices_triton
        self.Hq, self.H, self.D, self.req_to_token, self.device = Hq, H, D, req_to_token, device
        self.kv_dtype, self.q_dtype = dtypes
        self.workspace = getattr(inner, "workspace_buffer", None)
        if self.workspace is None:
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Every token slot of the pool at most: a step's page list never holds more.
        self.indices = torch.empty(max_tokens, dtype=torch.int32, device=device)
        self.indptr = torch.zeros(req_to_token.shape[0] + 1, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(req_to_token.shape[0], dtype=torch.int32, device=device)
        self.loc = torch.zeros(req_to_token.shape[0], dtype=torch.int64, device=device)
        self.eager = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=Hq // H > 4)
        self.graphs: dict[int, object] = {}
        self.current = None

    def _graph_wrapper(self, bs: int):
        if bs not in self.graphs:
            self.graphs[bs] = self._wrapper_cls(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.Hq // self.H > 4,
                paged_kv_indptr_buffer=self.indptr[:bs + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_page_len[:bs])
        return self.graphs[bs]

    def plan(self, req_pool_indices, late_lens, host_lens: list[int], graph: bool) -> torch.Tensor:
        bs = len(host_lens)
        self.indptr[1:bs + 1] = torch.cumsum(late_lens, 0)
        self._index_kernel[(bs,)](self.req_to_token, req_pool_indices, late_lens, self.indptr, None, self.indices,
                                  self.req_to_token.shape[1])
        self.loc[:bs] = self.req_to_token[req_pool_indices.long(), (late_lens - 1).long()]
        indptr = torch.zeros(bs + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(host_lens, dtype=torch.int32).cumsum(0)
        wrapper = self._graph_wrapper(bs) if graph else self.eager
        # A graph wrapper reads the page list from its static buffer, which the index kernel just wrote.
        indices = self.indices[:0] if graph else self.indices[:int(indptr[-1])]
        wrapper.plan(indptr, indices, self.last_page_len[:bs], self.Hq, self.H, self.D, 1,
                     data_type=self.kv_dtype, q_data_type=self.q_dtype, non_blocking=True)
        self.current = wrapper
        return self.loc[:bs]

    def attend(self, q, k_buf, v_buf, scale):
        return self.current.forward(q, (k_buf.view(-1, 1, self.H, self.D), v_buf.view(-1, 1, self.H, self.D)),
                                    sm_scale=scale)
