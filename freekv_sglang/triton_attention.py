"""FreeKV's sparse-layer attention through SGLang's own Triton decode kernel, when FreeKV wraps SGLang's Triton
backend.

As with FlashInfer (flashinfer_attention.py), each (request, KV head) becomes one kernel row with a single KV head
and the group's query heads, over the engine's cache viewed as [rows * H, 1, D], its tokens listed in logical order
(freekv_kernels.token_index). SGLang's grouped decode kernel computes each (row, KV head) on its own over the row's
KV splits, so with the same tokens and the same split count a one-head row rounds exactly as the request's head does
in the server's full-KV decode: split counts are chosen as SGLang chooses them for its own rows (a fixed split tile
under --enable-deterministic-inference, else SGLang's heuristic for B * H rows of G query heads, which sizes its
grid as B requests of H * G heads). When the budget covers the context, greedy answers then match a plain Triton
server token for token, which is what makes radix-cache hits comparable: SGLang keeps its radix cache under
deterministic inference only with the Triton (or FA3) backend, not with FlashInfer.

The split counts are planned on the host before each step (outside CUDA graphs, like SGLang's own replay metadata);
the token lists are written per layer on the device inside the step. The split logits reuse the inner backend's
buffers of this batch (its [bs, H * G, splits, D] viewed as [bs * H, G, splits, D]): same size, used layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from .config import FreeKVConfig
from .head_rows import HeadRows
from .layout import StepPlan, head_indptr


class TritonHeadAttention(HeadRows):
    def __init__(self, inner, cfg: FreeKVConfig, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 max_rows: int, device: torch.device):
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

        super().__init__(cfg, num_q_heads, num_kv_heads, head_dim, max_rows, device)
        self._decode, self._splits_kernel = decode_attention_fwd, get_num_kv_splits_triton
        self.inner = inner
        n = max_rows * num_kv_heads
        self.head_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.num_kv_splits = torch.ones(n, dtype=torch.int32, device=device)

    def plan(self, lens: list[int], graph: bool) -> None:
        """Plan a step whose rows hold `lens` tokens (padding rows included, as the kernel sees them)."""
        inner = self.inner
        indptr = head_indptr(self.cfg, lens, self.H)
        n = len(lens) * self.H
        head_lens = indptr[1:] - indptr[:-1]
        self.indptr[:n + 1].copy_(indptr, non_blocking=True)
        if inner.enable_deterministic:  # SGLang's batch-invariant split: a fixed tile
            tile = inner.split_tile_size
            splits = ((head_lens + tile - 1) // tile).clamp(1, inner.max_kv_splits)
            self.num_kv_splits[:n].copy_(splits.to(torch.int32), non_blocking=True)
        elif inner.static_kv_splits or inner.device_core_count <= 0:
            self.num_kv_splits[:n].fill_(inner.max_kv_splits)
        else:
            self.head_lens[:n].copy_(head_lens, non_blocking=True)
            self._splits_kernel[(1,)](
                self.num_kv_splits, self.head_lens, n, 1, self.G, 1, inner.max_kv_splits, inner.device_core_count,
                MAX_NUM_SEQ=256 if n < 256 else triton.next_power_of_2(n),
            )

    def attend(self, layer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
               slots: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The engine's outside attention kernel (engine.Attention): slots is the layer's slot table. The rows'
        token lists and queries are made now, beside the recall before attention; the returned call attends."""
        rows = self.prepare(plan, slots, q)
        B, D, n = q.shape[0], self.D, q.shape[0] * self.H

        def finish() -> torch.Tensor:
            meta, inner = self.inner.forward_metadata, self.inner
            logits = meta.attn_logits[:B].view(n, self.G, inner.max_kv_splits, D)
            lse = meta.attn_lse[:B].view(n, self.G, inner.max_kv_splits)
            o = torch.empty(n, self.G, D, dtype=q.dtype, device=q.device)
            scaled = layer.k_scale is not None and layer.v_scale is not None  # as SGLang's forward_decode
            k_scale, v_scale = (layer.k_scale_float, layer.v_scale_float) if scaled else (1.0, 1.0)
            self._decode(rows, k_cache.view(-1, 1, D), v_cache.view(-1, 1, D), o, self.indptr[:n + 1], self.indices,
                         logits, lse, self.num_kv_splits[:n], inner.max_kv_splits, layer.scaling, k_scale, v_scale,
                         use_pdl=inner.use_pdl)
            return o.view(B, self.H * self.G, D)
        return finish
