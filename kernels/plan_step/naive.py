"""Torch reference for plan_step (see docs/kernels.md, section plan_step)."""

from __future__ import annotations

import torch


def naive_plan_step(req_slots: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                    sink_pages: int, window_pages: int, pad_slot: int, retrieval: bool, *,
                    sparse_loc: torch.Tensor, row_table: torch.Tensor, row_pages: torch.Tensor,
                    row_tokens: torch.Tensor, row_start: torch.Tensor, n_sink: torch.Tensor, n_slots: torch.Tensor,
                    last_page_len: torch.Tensor, cand_end: torch.Tensor, slot_pages: torch.Tensor,
                    offload_src: torch.Tensor, offload_dst: torch.Tensor, offload_valid: torch.Tensor,
                    dense_loc: torch.Tensor | None = None, dense_table: torch.Tensor | None = None,
                    dense_pages: torch.Tensor | None = None) -> None:
    """Writes the index tensors of a decode step in which row b holds seq_lens[b] tokens, the newest being this
    step's (freekv_sglang.layout explains the page layout). The dense outputs are written when given."""
    plan = _plan(req_slots, seq_lens, page_table, page_size, sink_pages, slot_pages.shape[1], window_pages,
                 pad_slot, retrieval)
    outs = dict(sparse_loc=sparse_loc, row_table=row_table, row_pages=row_pages, row_tokens=row_tokens,
                row_start=row_start, n_sink=n_sink, n_slots=n_slots, last_page_len=last_page_len, cand_end=cand_end,
                slot_pages=slot_pages, offload_src=offload_src, offload_dst=offload_dst, offload_valid=offload_valid,
                dense_loc=dense_loc, dense_table=dense_table, dense_pages=dense_pages)
    for name, out in outs.items():
        if out is not None:
            out.copy_(plan[name])


def _plan(req_slots: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, p: int, n_s: int, k: int,
          n_w: int, pad_slot: int, retrieval: bool) -> dict[str, torch.Tensor]:
    dev = seq_lens.device
    rp, max_pages = n_s + k + n_w + 1, page_table.shape[1]
    r = req_slots.long()
    n = seq_lens.long()
    c = (n - 1) // p
    off = (n - 1) % p
    base = 1 + r * rp
    ring0 = base + n_s + k

    def ring(page: torch.Tensor) -> torch.Tensor:
        return ring0.view(-1, *[1] * (page.dim() - 1)) + torch.remainder(page - n_s, n_w + 1)

    sparse_page = torch.where(c < n_s, base + c, ring(c))
    dense_first = 1 + r * max_pages

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

    j = torch.arange(max_pages, device=dev)[None, :]
    dense_table = torch.where(j <= c[:, None], dense_first[:, None] + j, 0)

    leaving = n // p - n_w - 1
    offload_valid = (n % p == 0) & (leaving >= n_s) & (req_slots != pad_slot)
    leaving_c = torch.clamp(leaving, min=0, max=max_pages - 1)
    offload_dst = page_table[r, leaving_c]

    slot_pages = base[:, None] + n_s + torch.arange(k, device=dev)[None, :]
    return dict(
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
