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
    """Device tensors of one decode step, shared by all layers. Rows are batch positions."""

    req_slots: torch.Tensor  # [B] int32
    sparse_loc: torch.Tensor  # [B] int64: token row of the new KV in sparse layers
    dense_loc: torch.Tensor  # [B] int64
    row_table: torch.Tensor  # [B, resident] int32: sink | selected slots | window, partial page last
    row_pages: torch.Tensor  # [B] int32
    row_tokens: torch.Tensor  # [B] int32: tokens attended per KV head (row_tokens() on the host)
    row_start: torch.Tensor  # [B] int32: exclusive prefix sum of row_tokens (head_token_index)
    n_sink: torch.Tensor  # [B] int32: row_table[:, :n_sink] are sink pages
    n_slots: torch.Tensor  # [B] int32: then n_slots selection slots, then the window
    dense_table: torch.Tensor  # [B, M] int32
    dense_pages: torch.Tensor  # [B] int32
    last_page_len: torch.Tensor  # [B] int32
    cand_end: torch.Tensor  # [B] int32: candidates are [sink_pages, cand_end)
    slot_pages: torch.Tensor  # [B, k] int32: GPU page of each selection slot
    offload_src: torch.Tensor  # [B] int32: ring page leaving the window after this step
    offload_dst: torch.Tensor  # [B] int32: its host page
    offload_valid: torch.Tensor  # [B] bool


def row_tokens(cfg: FreeKVConfig, n: int, retrieval: bool = True) -> int:
    """Tokens each KV head of a row with n tokens attends to: plan_step's row_tokens, on the host."""
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


def plan_step(layout: Layout, req_slots: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor,
              pad_slot: int, retrieval: bool) -> StepPlan:
    """Index tensors for a step in which row b holds seq_lens[b] tokens, the newest being this step's.

    Pure tensor arithmetic on the device: no host synchronisation, so it can run inside a CUDA graph.
    """
    cfg, p = layout.cfg, layout.cfg.page_size
    n_s, k, n_w, rp = cfg.sink_pages, cfg.select_pages, cfg.window_pages, layout.resident
    dev = seq_lens.device
    r = req_slots.long()
    n = seq_lens.long()
    c = (n - 1) // p
    off = (n - 1) % p
    base = 1 + r * rp
    ring0 = base + n_s + k

    def ring(page: torch.Tensor) -> torch.Tensor:
        return ring0.view(-1, *[1] * (page.dim() - 1)) + torch.remainder(page - n_s, n_w + 1)

    sparse_page = torch.where(c < n_s, base + c, ring(c))
    dense_first = 1 + r * layout.max_pages

    n_sink = torch.clamp(c + 1, max=n_s)
    n_cand = torch.clamp(c - n_w - n_s, min=0)
    n_slots = torch.clamp(n_cand, max=k) if retrieval else torch.zeros_like(n_cand)
    win_start = torch.clamp(c - n_w, min=n_s)
    n_win = torch.clamp(c + 1 - win_start, min=0)

    i = torch.arange(rp, device=dev)[None, :]
    in_slots = i - n_sink[:, None]
    in_win = in_slots - n_slots[:, None]
    row = torch.where(i < n_sink[:, None], base[:, None] + i,
                      torch.where(in_win < 0, base[:, None] + n_s + in_slots, ring(win_start[:, None] + in_win)))
    row_pages = n_sink + n_slots + n_win
    row_tok = (row_pages - 1) * p + off + 1
    row = torch.where(i < row_pages[:, None], row, 0)

    j = torch.arange(layout.max_pages, device=dev)[None, :]
    dense_table = torch.where(j <= c[:, None], dense_first[:, None] + j, 0)

    leaving = n // p - n_w - 1
    offload_valid = (n % p == 0) & (leaving >= n_s) & (req_slots != pad_slot)
    leaving_c = torch.clamp(leaving, min=0, max=layout.max_pages - 1)
    offload_dst = page_table[r, leaving_c]

    slot_pages = base[:, None] + n_s + torch.arange(k, device=dev)[None, :]
    return StepPlan(
        req_slots=req_slots,
        sparse_loc=sparse_page * p + off,
        dense_loc=(dense_first + c) * p + off,
        row_table=row.int(),
        row_pages=row_pages.int(),
        row_tokens=row_tok.int(),
        row_start=(torch.cumsum(row_tok, 0) - row_tok).int(),
        n_sink=n_sink.int(),
        n_slots=n_slots.int(),
        dense_table=dense_table.int(),
        dense_pages=(c + 1).int(),
        last_page_len=(off + 1).int(),
        cand_end=(c - n_w).int() if retrieval else torch.full_like(c, n_s).int(),
        slot_pages=slot_pages.int(),
        offload_src=torch.where(offload_valid, ring(leaving), 0).int(),
        offload_dst=torch.where(offload_valid, offload_dst, 0).int(),
        offload_valid=offload_valid,
    )
