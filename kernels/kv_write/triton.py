"""Triton write_kv: the new K and V token of every row into its cache row, one launch (two index_put kernels in torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr,
                     sk_b, sk_h, sv_b, sv_h, skc_t, skc_h, svc_t, svc_h, s_loc,
                     D: tl.constexpr):
    """One program per (row b, KV head h)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = tl.load(loc_ptr + b * s_loc).to(tl.int64)
    d = tl.arange(0, D)
    k = tl.load(k_ptr + b * sk_b + h * sk_h + d)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + d)
    tl.store(kc_ptr + row * skc_t + h * skc_h + d, k.to(kc_ptr.dtype.element_ty))
    tl.store(vc_ptr + row * svc_t + h * svc_h + d, v.to(vc_ptr.dtype.element_ty))


def check_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   loc: torch.Tensor) -> None:
    """write_kv's arguments, also where another kernel does the write (query_similarity's kv=)."""
    check_device(k, v, k_cache, v_cache, loc)
    check_index_vectors(loc=loc)
    B, H, D = k.shape
    assert v.shape == k.shape and k_cache.shape[1:] == (H, D) and v_cache.shape == k_cache.shape and loc.shape == (B,)
    assert D & (D - 1) == 0
    assert all(t.stride(-1) == 1 for t in (k, v, k_cache, v_cache))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor) -> None:
    check_write_kv(k, v, k_cache, v_cache, loc)
    B, H, D = k.shape
    if B * H == 0:
        return
    _write_kv_kernel[(B, H)](k, v, k_cache, v_cache, loc,
                             k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
                             v_cache.stride(0), v_cache.stride(1), loc.stride(0),
                             D=D, num_warps=1)
