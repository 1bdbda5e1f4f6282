"""Torch references for the channel sketch: page scores from 4-bit codes of a few key channels fixed per (layer,
KV head) by a calibration, with the same quantisation steps for every page (see docs/kernels.md).

Calibration (per layer), invariant under RoPE: keys and queries arrive rotated by their position, channel i with
channel i + D/2 (the rotate-half pairing of Llama- and Qwen-style models), so a channel's values at positions the
calibration never saw lie anywhere within its pair's norm. Each channel's range is therefore [-r, r], r the largest
pair norm over the calibration's keys, and the R channels kept per KV head are those with the largest mean pair norm
of the queries (over the group and the calibration's tokens) times the rms pair norm of the keys. (Ranges taken from
a 4K-token calibration text covered 0.41 of the attention mass at 8K, against 0.58 for the default sketch: the
low-frequency channels had not turned far enough.) The bins are 16 equal steps over the range; keys outside it (a
pair norm above any seen) clamp to the first or last bin.

Codes: a token costs R / 2 bytes per KV head; byte j holds channel j of the calibration's list in its low nibble and
channel j + R / 2 in its high nibble. A code store is [page, head, token, byte] (token-major: a page of one head is
p * R / 2 contiguous bytes).

Scoring: the key on a calibrated channel decodes to its bin's centre, lo + (code + 1/2) step, every other channel
counts as zero. A query head's logit on a token is then scale * sum_r q_r (lo_r + step_r / 2) + sum_r w_r code_r
with w = scale * q * step: the first term is the same for every token of the request and head, so it cancels in
the softmax over pages and is left out, and w is one operand shared by every page (a tensor-core product).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from freekv_kernels.page_rerank.naive import page_mass_scores
from freekv_kernels.page_select.naive import in_phase

BITS = 4
LEVELS = 1 << BITS
# The weights carry log2(e), so the kernel's exponentials are exp2 of its products (no multiply per logit); its
# log-sum-exps come back to natural units with one multiply per page and query head.
LOG2E: float = 1.4426950408889634
LN2: float = 0.6931471805599453


class ChannelCalibration(NamedTuple):
    """One layer's calibration: channels [H, R] int32 (best first), lo [H, R], inv_step = 16 / (hi - lo) and
    step = 1 / inv_step [H, R] fp32 (both 0 on a constant channel: every key codes to bin 0, weight 0)."""

    channels: torch.Tensor
    lo: torch.Tensor
    inv_step: torch.Tensor
    step: torch.Tensor


def calibrate_channels(q: torch.Tensor, keys: torch.Tensor, num_channels: int) -> ChannelCalibration:
    """From a calibration's post-RoPE queries q [T, H, G, D] and keys [N, H, D] (see the module docstring)."""
    D = keys.shape[2]
    if num_channels % 32 or not 32 <= num_channels <= D:
        raise ValueError(f"channel sketch: {num_channels} channels; need a multiple of 32 up to the head dim {D}")

    def pair_norm(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]: each channel's rotate-half pair norm
        x = x.float()
        r = (x[..., : D // 2].square() + x[..., D // 2:].square()).sqrt()
        return torch.cat([r, r], dim=-1)

    kn = pair_norm(keys)  # [N, H, D]
    weight = pair_norm(q).mean((0, 2)) * kn.square().mean(0).sqrt()  # [H, D]
    channels = weight.topk(num_channels, dim=-1).indices.int()
    hi = kn.amax(0).gather(1, channels.long())  # [H, R]
    lo, span = -hi, 2 * hi
    inv_step = torch.where(span > 0, LEVELS / torch.where(span > 0, span, 1.0), 0.0)
    step = torch.where(span > 0, 1.0 / torch.where(span > 0, inv_step, 1.0), 0.0)
    return ChannelCalibration(channels, lo, inv_step, step)


def quantize_channels(k: torch.Tensor, channels: torch.Tensor, lo: torch.Tensor, inv_step: torch.Tensor) -> torch.Tensor:
    """Keys k [..., H, D] -> codes [..., H, R / 2] uint8: bin clamp(floor((k - lo) * inv_step), 0, 15) of each
    calibrated channel (two fp32 operations, as the kernels round them)."""
    R = channels.shape[1]
    picked = k.float().gather(-1, channels.long().expand(*k.shape[:-1], R))
    c = ((picked - lo) * inv_step).floor().clamp(0, LEVELS - 1).to(torch.uint8)
    return c[..., : R // 2] | (c[..., R // 2:] << 4)


def decode_channels(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., R / 2] -> the bins [..., R] (float) in the calibration's channel order."""
    c = codes.to(torch.int32)
    return torch.cat([c & (LEVELS - 1), c >> BITS], dim=-1).float()


def channel_weights(q: torch.Tensor, channels: torch.Tensor, step: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., H, G, D] -> the weights scale * q * step [..., H, G, R] (fp32) on the calibrated channels, as the
    kernel rounds them: times log2(e), to fp16, times ln(2)."""
    R = channels.shape[1]
    picked = q.float().gather(-1, channels.long()[:, None, :].expand(*q.shape[:-1], R))
    return (picked * (scale * LOG2E) * step[:, None, :]).half().float() * LN2


def naive_channel_sketch_pages(
    q: torch.Tensor,
    codes: torch.Tensor,
    channels: torch.Tensor,
    step: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    scale: float,
    heads: torch.Tensor | None = None,
    phase: int = 1,
    q_by_slot: bool = False,
    cand_start: int = 0,
    cand_end: torch.Tensor | None = None,
    programs: int = 0,
    pool: bool = True,
) -> torch.Tensor:
    """scores [B, H, M] of every page in [cand_start, cand_end[b]) from codes [P, H, p, R / 2]: per query head the
    log-sum-exp over the page's tokens of sum_r w_r code_r (channel_weights), a softmax over the pages, the mean
    over the group; -inf at every other page. Rows of heads outside `phase` stay unwritten (NaN). `programs` shapes
    the Triton launch only (the scores do not depend on it).
    pool False: the log-sum-exps instead, lse [B, H, max(C, 1), GP] (C = M - cand_start candidates, GP the group
    rounded up to a power of two), lse[b, h, c, g] of page cand_start + c and query head g; NaN past the row's
    candidates, in the padding heads and in the rows of heads outside `phase` (select_chain pools them)."""
    H = codes.shape[1]

    def page_logits(qh: torch.Tensor, h: int, pages: torch.Tensor) -> torch.Tensor:
        w = channel_weights(qh[None], channels[h:h + 1], step[h:h + 1], scale)[0]  # [G, R]
        return torch.einsum("gr,ntr->gnt", w, decode_channels(codes[pages, h]))

    if pool:
        return page_mass_scores(q, H, page_table, req_slots, None, heads, phase, q_by_slot, cand_start, cand_end,
                                page_logits)
    B, M, G = req_slots.shape[0], page_table.shape[1], q.shape[1] // H
    lse = torch.full((B, H, max(M - cand_start, 1), 1 << (G - 1).bit_length()), float("nan"), device=q.device)
    mine = in_phase(heads, phase)
    for b, slot in enumerate(req_slots.tolist()):
        qb = q[slot if q_by_slot else b].float().view(H, G, -1)
        logical = torch.arange(cand_start, max(cand_start, min(int(cand_end[b]), M)), device=q.device)
        for h in range(H):
            if logical.numel() and (mine is None or mine[b, h]):
                s = page_logits(qb[h], h, page_table[slot, logical].long())
                lse[b, h, :logical.numel(), :G] = torch.logsumexp(s, dim=-1).T
    return lse


def naive_write_channel_codes(
    k_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    page_size: int,
    codes: torch.Tensor,
    channels: torch.Tensor,
    lo: torch.Tensor,
    inv_step: torch.Tensor,
) -> None:
    """For each valid i: codes[dst[i], :, rows] = quantize_channels of rows src[i] * p .. + p of k_cache [T, H, D]
    (offload_pages' arguments: a source page that runs past the last row writes only the rows that exist, the rest
    of that host page is left as it was)."""
    p = page_size
    for s, d, ok in zip(src.tolist(), dst.tolist(), valid.tolist()):
        if ok:
            k = k_cache[s * p: (s + 1) * p]  # [rows, H, D]
            codes[d, :, : k.shape[0]] = quantize_channels(k, channels, lo, inv_step).transpose(0, 1)
