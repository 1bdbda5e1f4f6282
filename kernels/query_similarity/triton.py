"""Triton query_similarity: per-KV-head cosine-similarity flags, fused with the prev_q update and, optionally, the
step's KV write (the next launch on the same stream otherwise)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..kv_write.triton import check_write_kv
from .naive import EPS, PER_BYTE


@triton.jit
def _query_similarity_kernel(
    q_ptr, prev_ptr, slots_ptr, has_prev_ptr, flags_ptr, stats_ptr, table_ptr, nslots_ptr, heads_ptr,
    sel_ptr, qp_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, u_ptr,
    tau, H, K, pad_slot, pick_scale, rate,
    sq_b, sq_h, sq_d,
    sp_r, sp_h, sp_d,
    s_slot, s_has,
    sf_b, sf_h,
    st_r, st_h, st_k,
    s_ns,
    sh_b, sh_h,
    ssel_r, ssel_h, sqp_r, sqp_h, sqp_c,
    sk_b, sk_h, sv_b, sv_h, skc_t, skc_h, svc_t, svc_h, s_loc, su_b, su_h,
    G: tl.constexpr, HP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr,
    STATS: tl.constexpr, HEADS: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr, PER_BYTE: tl.constexpr,
    WRITE_KV: tl.constexpr, REPLAY: tl.constexpr, EARLY: tl.constexpr,
):
    """One program per batch row: all Hq heads as [HP, GP, D] (KV head, head in group, dim). NB > 0: also the
    sketch's picks of the row's query (naive_sketch_picks), by request slot, for both selection phases. WRITE_KV:
    also the row's new K and V token into its cache row loc[b]. REPLAY: flags from uniform draws u < rate. EARLY: q
    is a prediction (naive_query_similarity's early): flags only where the slot has a previous query, prev_q only for
    them."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
    h = tl.arange(0, HP)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    hq = (h[:, None] * G + g[None, :]).to(tl.int64)[:, :, None]
    mask = ((h < H)[:, None] & (g < G)[None, :])[:, :, None]
    q_ptrs = q_ptr + b * sq_b + hq * sq_h + d[None, None, :] * sq_d
    p_ptrs = prev_ptr + slot * sp_r + hq * sp_h + d[None, None, :] * sp_d
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    prev = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    has = tl.load(has_prev_ptr + slot * s_has)
    qf = q.to(tl.float32)
    dot = tl.sum(qf * prev, axis=2)
    norms = tl.sqrt(tl.sum(qf * qf, axis=2)) * tl.sqrt(tl.sum(prev * prev, axis=2))
    mean = tl.sum(dot / tl.maximum(norms, EPS), axis=1) / G  # padded heads have dot == 0
    if REPLAY:
        u = tl.load(u_ptr + b * su_b + h.to(tl.int64) * su_h, mask=h < H, other=1.0)
        turned = u < rate
    else:
        turned = ((mean < tau) & (tau > 0)) | (tau >= 1)
    if EARLY:
        real = (has != 0).to(tl.int32) * (slot != pad_slot).to(tl.int32)  # a real row with a previous query
        flags = turned & (h < H) & (real != 0)
    else:
        flags = turned | (has == 0)
    tl.store(flags_ptr + b * sf_b + h.to(tl.int64) * sf_h, flags, mask=h < H)
    if HEADS:
        # Heads holding fewer pages than the row has slots to fill select before attention too.
        i = tl.arange(0, KP)
        held = tl.load(table_ptr + slot * st_r + h.to(tl.int64)[:, None] * st_h + i[None, :].to(tl.int64) * st_k,
                       mask=(h < H)[:, None] & (i < K)[None, :], other=-1)
        short = tl.sum((held >= 0).to(tl.int32), axis=1) < tl.load(nslots_ptr + b * s_ns)
        tl.store(heads_ptr + b * sh_b + h.to(tl.int64) * sh_h, flags | short, mask=h < H)
    if STATS and EARLY:
        tl.atomic_add(stats_ptr, tl.sum(flags.to(tl.float64)))
    if STATS and not EARLY:
        if slot != pad_slot:  # statistics count real rows only
            tl.atomic_add(stats_ptr, tl.sum((flags & (h < H)).to(tl.float64)))
            if has != 0:
                tl.atomic_add(stats_ptr + 1, tl.sum(tl.where(h < H, mean, 0.0).to(tl.float64)))
                # a sum, not H.to(): Triton passes an int argument equal to 1 as a constexpr
                tl.atomic_add(stats_ptr + 2, tl.sum((h < H).to(tl.float64)))
    if NB > 0:
        # Per KV head the NB code bytes (PER_BYTE channels each) with the largest |q| summed over the group, ties by
        # the lower byte, and the fp16-rounded scaled query on their channels.
        KB: tl.constexpr = D // PER_BYTE
        w = tl.sum(tl.sum(tl.reshape(tl.abs(qf), [HP, GP, KB, PER_BYTE]), axis=3), axis=1)  # [HP, KB]
        jb = tl.arange(0, KB)
        i4 = tl.arange(0, PER_BYTE)
        hq_i = (h[:, None] * G + g[None, :]).to(tl.int64)[:, :, None]  # [HP, GP, 1]
        pmask = ((h < H)[:, None] & (g < G)[None, :])[:, :, None]
        for r in tl.static_range(NB):
            best = tl.argmax(w, axis=1)  # [HP]
            w = tl.where(jb[None, :] == best[:, None], -1.0, w)
            tl.store(sel_ptr + slot * ssel_r + h.to(tl.int64) * ssel_h + r, best, mask=h < H)
            ch = (PER_BYTE * best[:, None, None] + i4[None, None, :]).to(tl.int64)  # [HP, 1, PER_BYTE]
            qv = tl.load(q_ptr + b * sq_b + hq_i * sq_h + ch * sq_d, mask=pmask, other=0.0)
            qv = (qv.to(tl.float32) * pick_scale).to(tl.float16).to(tl.float32)
            tl.store(qp_ptr + slot * sqp_r + h.to(tl.int64)[:, None, None] * sqp_h + g[None, :, None]
                     + (PER_BYTE * r + i4[None, None, :]) * sqp_c, qv, mask=(h < H)[:, None, None])
    if WRITE_KV:
        row = tl.load(loc_ptr + b * s_loc).to(tl.int64)
        hk = h.to(tl.int64)[:, None]
        kvm = (h < H)[:, None]
        kt = tl.load(k_ptr + b * sk_b + hk * sk_h + d[None, :], mask=kvm)
        vt = tl.load(v_ptr + b * sv_b + hk * sv_h + d[None, :], mask=kvm)
        tl.store(kc_ptr + row * skc_t + hk * skc_h + d[None, :], kt.to(kc_ptr.dtype.element_ty), mask=kvm)
        tl.store(vc_ptr + row * svc_t + hk * svc_h + d[None, :], vt.to(vc_ptr.dtype.element_ty), mask=kvm)
    # Other threads of this program may still be reading prev_q elements that the stores below overwrite.
    tl.debug_barrier()
    if EARLY:
        tl.store(p_ptrs, q.to(prev_ptr.dtype.element_ty), mask=mask & flags[:, None, None])
    else:
        tl.store(p_ptrs, q.to(prev_ptr.dtype.element_ty), mask=mask)
        tl.store(has_prev_ptr + slot * s_has, 1)


def query_similarity(
    q: torch.Tensor,
    prev_q: torch.Tensor,
    req_slots: torch.Tensor,
    has_prev: torch.Tensor,
    tau: float,
    group: int,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
    slots: torch.Tensor | None = None,
    n_slots: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    picks: tuple[torch.Tensor, torch.Tensor] | None = None,
    pick_scale: float = 1.0,
    kv: tuple[torch.Tensor, ...] | None = None,
    replay: tuple[torch.Tensor, float] | None = None,
    early: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See naive_query_similarity."""
    check_device(q, prev_q, req_slots, has_prev)
    if stats is not None:
        assert stats.shape == ((1,) if early else (3,)) and stats.dtype == torch.float64 and stats.is_contiguous()
    check_index_vectors(req_slots=req_slots, has_prev=has_prev)
    B, Hq, D = q.shape
    H = Hq // group
    assert Hq == H * group and prev_q.shape[1:] == (Hq, D) and D & (D - 1) == 0
    if early:
        assert slots is None and heads is None and picks is None and kv is None, "early takes none of these"
    if out is None:
        flags = empty(B, H, dtype=torch.bool, device=q.device)
    else:
        check_device(out)
        assert out.shape == (B, H) and out.dtype == torch.bool, f"out {tuple(out.shape)} {out.dtype}, not [B, H] bool"
        flags = out
    with_heads = heads is not None
    if with_heads:
        check_device(slots, n_slots, heads)
        assert slots.dim() == 3 and slots.shape[1] == H and n_slots.shape == (B,) and heads.shape == (B, H)
        assert heads.dtype == torch.bool
    K = slots.shape[2] if with_heads else 1
    GP = triton.next_power_of_2(group)
    nb = 0
    if picks is not None:
        sel, qp = picks
        check_device(sel, qp)
        nb = sel.shape[2]
        assert sel.dim() == 3 and sel.shape[1] == H and sel.dtype == torch.int32 and 0 < nb * PER_BYTE <= D
        assert qp.shape[1:] == (H, nb * PER_BYTE, GP) and qp.dtype == torch.float32 and qp.stride(3) == 1
    if kv is not None:
        k, v, k_cache, v_cache, loc = kv
        check_write_kv(*kv)
        assert k.shape == (B, H, D), f"k {tuple(k.shape)} does not match q's rows and KV heads {(B, H, D)}"
    if replay is not None:
        u, rate = replay
        check_device(u)
        assert u.shape == (B, H) and u.dtype == torch.float32, f"replay draws {tuple(u.shape)} {u.dtype}, not [B, H]"
    _query_similarity_kernel[(B,)](
        q, prev_q, req_slots, has_prev, flags, flags if stats is None else stats,
        slots if with_heads else flags, n_slots if with_heads else flags, heads if with_heads else flags,
        sel if nb else flags, qp if nb else flags, *(kv if kv is not None else (flags,) * 5),
        u if replay is not None else flags,
        float(tau), H, K, pad_slot, float(pick_scale), float(rate) if replay is not None else 0.0,
        *q.stride(), *prev_q.stride(), req_slots.stride(0), has_prev.stride(0), *flags.stride(),
        *(slots.stride() if with_heads else (0, 0, 0)), n_slots.stride(0) if with_heads else 0,
        *(heads.stride() if with_heads else (0, 0)),
        *(sel.stride()[:2] if nb else (0, 0)), *(qp.stride()[:3] if nb else (0, 0, 0)),
        *((k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
           v_cache.stride(0), v_cache.stride(1), loc.stride(0)) if kv is not None else (0,) * 9),
        *(u.stride() if replay is not None else (0, 0)),
        G=group, HP=triton.next_power_of_2(H), GP=GP, D=D, EPS=EPS,
        STATS=stats is not None, HEADS=with_heads, KP=triton.next_power_of_2(K), NB=nb, PER_BYTE=PER_BYTE,
        WRITE_KV=kv is not None, REPLAY=replay is not None, EARLY=early, num_warps=8 if Hq * D > 4096 else 4,
    )
    return flags
