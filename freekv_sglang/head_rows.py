"""What FreeKV's sparse-layer attention through a wrapped backend's own decode kernel (flashinfer_attention.py,
triton_attention.py) shares: one kernel row per (request, KV head), with a single KV head and the group's query heads,
over the engine's cache viewed as [rows * H, 1, D], its tokens listed in logical order (freekv_kernels.token_index)
per layer on the device inside the step."""

from __future__ import annotations

import torch
from freekv_kernels.token_index import head_token_index

from .config import FreeKVConfig
from .layout import StepPlan


class HeadRows:
    def __init__(self, cfg: FreeKVConfig, num_q_heads: int, num_kv_heads: int, head_dim: int, max_rows: int,
                 device: torch.device):
        self.cfg = cfg
        self.H, self.G, self.D = num_kv_heads, num_q_heads // num_kv_heads, head_dim
        n = max_rows * num_kv_heads
        self.indptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
        # Every (row, head) holds at most resident_pages * page_size tokens; the last entry takes the rest.
        self.indices = torch.zeros(n * cfg.resident_pages * cfg.page_size + 1, dtype=torch.int32, device=device)

    def prepare(self, plan: StepPlan, slots: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """What the kernel's rows need before the recall before attention lands: each (row, KV head)'s token rows
        written into self.indices from the layer's slot table `slots`, and q [B, H * G, D] as the rows' queries
        [B * H, G, D], written by the same launch (SGLang's q is a strided view of the QKV projection)."""
        rows = torch.empty(q.shape[0] * self.H, self.G, self.D, dtype=q.dtype, device=q.device)
        head_token_index(slots, plan.req_slots, plan.row_table, plan.n_sink, plan.n_slots, plan.slot_pages,
                         plan.row_tokens, plan.row_start, self.cfg.page_size, self.indices, q, rows)
        return rows
