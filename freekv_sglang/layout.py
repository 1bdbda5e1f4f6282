"""Where a request's pages live on the GPU, and the per-step index tensors derived from sequence lengths.

Sparse layers give every request slot r a fixed run of `resident_pages` GPU pages starting at
`1 + r * resident_pages` (page 0 is a dummy that padded rows may write):
    [ sink pages (n_s) | selection slots (k) | window ring (n_w + 1) ]
Logical page j < n_s lives in sink page j; page j >= n_s, while in the window, lives in ring entry
(j - n_s) % (n_w + 1). With n tokens and c = (n - 1) // p the page of the newest token:
    window     = pages [max(n_s, c - n_w), c]  (n_w full pages and the page being filled)
    candidates = pages [n_s, c - n_w)          (offloaded, summarised, selectable)
Page c - n_w leaves the window when token (c + 1) * p arrives and takes its ring entry, so it is
summarised and offloaded right after the step whose token fills page c (when n % p == 0).

After every slot's run come the victim caches (cfg.victim_pages = V per slot): entry e of slot r in page
1 + R * resident_pages + r * V + e, R slots in all.

Dense layers give slot r the pages [1 + r * M, 1 + (r + 1) * M): the whole context of M pages.
The same slot table serves every sparse layer: slot s of head h in layer l holds whatever page the
selection of (l, h) put there, so the attention row is identical across layers and heads.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import FreeKVConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    cfg: FreeKVConfig
    max_pages: int  # M: logical pages of the longest request

    @property
    def resident(self) -> int:
        return self.cfg.resident_pages

    def sparse_pool_pages(self, num_slots: int) -> int:
        return self.victim_base(num_slots) + num_slots * self.cfg.victim_pages

    def victim_base(self, num_slots: int) -> int:
        """First GPU page of the victim cache in a sparse layer's pool: entry e of slot r is page base + r * V + e."""
        return 1 + num_slots * self.resident

    def dense_pool_pages(self, num_slots: int) -> int:
        return 1 + num_slots * self.max_pages

    def sparse_base(self, slot: int) -> int:
        return 1 + slot * self.resident

    def dense_base(self, slot: int) -> int:
        return 1 + slot * self.max_pages

    def ring_page(self, slot: int, page: int) -> int:
        cfg = self.cfg
        return self.sparse_base(slot) + cfg.sink_pages + cfg.select_pages + (page - cfg.sink_pages) % (cfg.window_pages + 1)

    def resident_page(self, slot: int, page: int) -> int:
        """GPU page of a sink or window page of a sparse layer."""
        return self.sparse_base(slot) + page if page < self.cfg.sink_pages else self.ring_page(slot, page)


@dataclasses.dataclass
class StepPlan:
    """Device tensors of one decode step, shared by all layers. Rows are batch positions. The engine's plan is a view
    of the first rows of persistent buffers that the op plan_step (freekv_kernels.plan_step) fills, so a step
    captured in a CUDA graph and its replays read the same memory."""

    req_slots: torch.Tensor  # [B] int32
    sparse_loc: torch.Tensor  # [B] int64: token row of the new KV in sparse layers
    dense_loc: torch.Tensor | None  # [B] int64; the dense fields are None when no dense layer runs in the engine
    row_table: torch.Tensor  # [B, resident] int32: sink | selected slots | window, partial page last
    row_pages: torch.Tensor  # [B] int32
    row_tokens: torch.Tensor  # [B] int32: tokens attended per KV head (row_tokens() on the host)
    row_start: torch.Tensor  # [B] int32: exclusive prefix sum of row_tokens (head_token_index)
    n_sink: torch.Tensor  # [B] int32: row_table[:, :n_sink] are sink pages
    n_slots: torch.Tensor  # [B] int32: then n_slots selection slots, then the window
    dense_table: torch.Tensor | None  # [B, M] int32
    dense_pages: torch.Tensor | None  # [B] int32
    last_page_len: torch.Tensor  # [B] int32
    cand_end: torch.Tensor  # [B] int32: candidates are [sink_pages, cand_end)
    slot_pages: torch.Tensor  # [B, k] int32: GPU page of each selection slot
    offload_src: torch.Tensor  # [B] int32: ring page leaving the window after this step
    offload_dst: torch.Tensor  # [B] int32: its host page
    offload_valid: torch.Tensor  # [B] bool

    @classmethod
    def buffers(cls, layout: Layout, req_slots: torch.Tensor, dense: bool) -> StepPlan:
        """Outputs for as many rows as req_slots has (the static step buffer), allocated once."""
        R, dev = req_slots.shape[0], req_slots.device

        def zeros(*cols: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(R, *cols, dtype=dtype, device=dev)

        return cls(req_slots=req_slots, sparse_loc=zeros(dtype=torch.int64),
                   dense_loc=zeros(dtype=torch.int64) if dense else None, row_table=zeros(layout.resident),
                   row_pages=zeros(), row_tokens=zeros(), row_start=zeros(), n_sink=zeros(), n_slots=zeros(),
                   dense_table=zeros(layout.max_pages) if dense else None, dense_pages=zeros() if dense else None,
                   last_page_len=zeros(), cand_end=zeros(), slot_pages=zeros(layout.cfg.select_pages),
                   offload_src=zeros(), offload_dst=zeros(), offload_valid=zeros(dtype=torch.bool))

    def rows(self, batch: int) -> StepPlan:
        """The plan of the first `batch` rows: views, no copy."""
        return StepPlan(**{name: None if t is None else t[:batch] for name, t in vars(self).items()})

    def outputs(self) -> dict[str, torch.Tensor | None]:
        """What plan_step writes: every field but req_slots."""
        return {name: t for name, t in vars(self).items() if name != "req_slots"}


def row_tokens(cfg: FreeKVConfig, n: int, retrieval: bool = True) -> int:
    """Tokens each KV head of a row with n tokens attends to: the row_tokens of plan_step, on the host."""
    p, n_s, k, n_w = cfg.page_size, cfg.sink_pages, cfg.select_pages, cfg.window_pages
    c = (n - 1) // p
    n_slots = min(max(c - n_w - n_s, 0), k) if retrieval else 0
    win_start = max(c - n_w, n_s)
    row_pages = min(c + 1, n_s) + n_slots + max(c + 1 - win_start, 0)
    return (row_pages - 1) * p + (n - 1) % p + 1


def head_indptr(cfg: FreeKVConfig, lens: list[int], num_kv_heads: int) -> torch.Tensor:
    """[len(lens) * H + 1] int32 on the host: offsets of the (row, KV head) token lists head by head within
    each row, as the FlashInfer path plans them (row_tokens once per row, repeated for its heads)."""
    per_row = torch.tensor([row_tokens(cfg, n) for n in lens], dtype=torch.int32)
    indptr = torch.zeros(len(lens) * num_kv_heads + 1, dtype=torch.int32)
    indptr[1:] = per_row.repeat_interleave(num_kv_heads).cumsum(0)
    return indptr
