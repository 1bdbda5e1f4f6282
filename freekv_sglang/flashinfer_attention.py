"""FreeKV's sparse-layer attention through FlashInfer's decode kernel, when FreeKV wraps SGLang's FlashInfer
backend.

FreeKV selects pages per KV head, while a paged kernel shares one page list across a request's heads. So
each (request, KV head) becomes one FlashInfer request with a single KV head and the group's query heads,
over the engine's cache viewed as [rows * H, 1, 1, D] (freekv_kernels.token_index). Its tokens are listed in
logical order, and the plan for B * H one-head requests partitions the work as the server's plan for B
requests of H heads does, so when the budget covers the context the output is bit-identical to SGLang's
full-KV FlashInfer decode: greedy answers match a plain server token for token.

The plan (host) runs before each step, outside CUDA graphs, like SGLang's own; the token lists are written
per layer on the device inside the step, so a captured step replays with the current selection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import FreeKVConfig
from .head_rows import HeadRows
from .layout import StepPlan, head_indptr


class FlashInferHeadAttention(HeadRows):
    def __init__(self, inner, cfg: FreeKVConfig, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 max_rows: int, device: torch.device):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        super().__init__(cfg, num_q_heads, num_kv_heads, head_dim, max_rows, device)
        self._wrapper_cls = BatchDecodeWithPagedKVCacheWrapper
        upd = inner.indices_updater_decode
        self.kv_dtype, self.q_dtype = upd.data_type, upd.q_data_type
        self.use_tensor_cores = inner.decode_use_tensor_cores
        # Split-KV settings as SGLang plans its own decode (deterministic inference fixes the split size).
        self.graph_no_split = inner.disable_cuda_graph_kv_split
        self.eager_split_size = inner.decode_split_tile_size
        # The float workspace only holds temporaries of a running kernel, and kernels run one after the
        # other on the forward stream, so it is shared with the inner backend like SGLang's own wrappers
        # share it; each wrapper keeps its plan in its own int workspace.
        self.workspace = inner.workspace_buffer
        self.last_page_len = torch.ones(max_rows * num_kv_heads, dtype=torch.int32, device=device)
        self.eager = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                        use_tensor_cores=self.use_tensor_cores)
        self.graphs: dict[int, object] = {}  # captured batch size -> wrapper with static buffers
        self.current = None

    def _graph_wrapper(self, bs: int):
        if bs not in self.graphs:
            n = bs * self.H
            self.graphs[bs] = self._wrapper_cls(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self.indptr[:n + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_page_len[:n])
        return self.graphs[bs]

    def plan(self, lens: list[int], graph: bool) -> None:
        """Plan a step whose rows hold `lens` tokens (padding rows included, as the kernel sees them)."""
        indptr = head_indptr(self.cfg, lens, self.H)
        n = len(lens) * self.H
        wrapper = self._graph_wrapper(len(lens)) if graph else self.eager
        # Graph wrappers copy the (empty) index list into their static buffer; eager ones keep a reference.
        indices = self.indices[:0] if graph else self.indices
        wrapper.plan(indptr, indices, torch.ones(n, dtype=torch.int32), self.G, 1, self.D, 1,
                     data_type=self.kv_dtype, q_data_type=self.q_dtype, non_blocking=True,
                     fixed_split_size=None if graph else self.eager_split_size,
                     disable_split_kv=self.graph_no_split if graph else False)
        self.current = wrapper

    def attend(self, layer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
               slots: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The engine's outside attention kernel (engine.Attention): slots is the layer's slot table. The rows'
        token lists and queries are made now, beside the recall before attention; the returned call attends."""
        rows = self.prepare(plan, slots, q)
        B, D, wrapper = q.shape[0], self.D, self.current

        def finish() -> torch.Tensor:
            o = wrapper.forward(rows, (k_cache.view(-1, 1, 1, D), v_cache.view(-1, 1, 1, D)), sm_scale=layer.scaling,
                                logits_soft_cap=layer.logit_cap, k_scale=layer.k_scale_float,
                                v_scale=layer.v_scale_float)
            return o.view(B, self.H * self.G, D)
        return finish
