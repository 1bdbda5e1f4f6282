"""Triton kmeans_keys: per iteration an assignment kernel (tensor-core distances, argmin), a stable sort of the
assignment on the device (each cluster's tokens become one contiguous run, in token order) and an update kernel
that sums each run in a fixed order, so the result is deterministic without atomics and the loop never syncs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, interpret_mode
from .naive import check_kmeans_args, init_centroids

ASSIGN_TOKENS = 64  # keys per program of the assignment kernel
ASSIGN_CLUSTERS = 64  # centroids per product: [ASSIGN_TOKENS, D] x [D, ASSIGN_CLUSTERS]
ASSIGN_WARPS = 4
UPDATE_TOKENS = 16  # LouisKV's clusters average 16 keys
UPDATE_WARPS = 2


@triton.jit(do_not_specialize=["N"])
def _kmeans_assign_kernel(
    keys_ptr, ops_ptr, assign_ptr, N, C,
    sk_h, sk_n, sk_d,
    so_h, so_c,
    sa_h,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per (token block, head): distances to every centroid block, the running argmin. The centroids
    come rounded to the keys' dtype (ops, rounded by torch as in the reference: the interpreter's in-kernel bf16
    cast truncates), so the products are exact and only the fp32 sums' order differs from the reference."""
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    k = tl.load(keys_ptr + h * sk_h + n.to(tl.int64)[:, None] * sk_n + d[None, :] * sk_d, mask=(n < N)[:, None],
                other=0.0)
    best = tl.full([BLOCK_N], float("inf"), tl.float32)
    arg = tl.zeros([BLOCK_N], tl.int32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cent = tl.load(ops_ptr + h * so_h + c.to(tl.int64)[:, None] * so_c + d[None, :], mask=(c < C)[:, None],
                       other=0.0)
        cf = cent.to(tl.float32)
        if UPCAST:  # the interpreter multiplies bf16 operands as integers; their fp32 products are exact too
            prod = tl.dot(k.to(tl.float32), tl.trans(cf), input_precision="ieee")
        else:
            prod = tl.dot(k, tl.trans(cent), input_precision=PRECISION)
        dist = tl.sum(cf * cf, axis=1)[None, :] - 2.0 * prod
        dist = tl.where((c < C)[None, :], dist, float("inf"))
        block_best = tl.min(dist, axis=1)
        block_arg = tl.argmin(dist, axis=1, tie_break_left=True) + c0
        better = block_best < best  # strict: a tie keeps the earlier (lower) block
        arg = tl.where(better, block_arg, arg)
        best = tl.where(better, block_best, best)
    tl.store(assign_ptr + h * sa_h + n, arg, mask=n < N)


@triton.jit
def _kmeans_update_kernel(
    keys_ptr, order_ptr, starts_ptr, cent_ptr, sizes_ptr,
    sk_h, sk_n, sk_d,
    so_h, sst_h,
    sc_h, sc_c,
    ss_h,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """One program per (cluster, head): the mean of the cluster's run of sorted tokens; empty keeps the centroid."""
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    start = tl.load(starts_ptr + h * sst_h + c)
    end = tl.load(starts_ptr + h * sst_h + c + 1)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tok = tl.load(order_ptr + h * so_h + t, mask=t < end, other=0)
        acc += tl.load(keys_ptr + h * sk_h + tok[:, None] * sk_n + d[None, :] * sk_d, mask=(t < end)[:, None],
                       other=0.0).to(tl.float32)
    count = end - start
    if count > 0:
        tl.store(cent_ptr + h * sc_h + c * sc_c + d, tl.sum(acc, axis=0) / count.to(tl.float32))
    tl.store(sizes_ptr + h * ss_h + c, count.to(tl.int32))


def kmeans_keys(
    keys: torch.Tensor, num_clusters: int, iters: int, init: str | torch.Tensor = "strided"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See naive_kmeans_keys. keys may be any strided view (e.g. a prefill's [N, H, D] keys transposed)."""
    check_kmeans_args(keys, num_clusters, iters, init)
    check_device(keys)
    H, N, D = keys.shape
    C = num_clusters
    centroids = empty(H, C, D, dtype=torch.float32, device=keys.device)
    centroids.copy_(init_centroids(keys, C, init))
    assign = empty(H, N, dtype=torch.int32, device=keys.device)
    sizes = empty(H, C, dtype=torch.int32, device=keys.device)
    ops = empty(H, C, D, dtype=keys.dtype, device=keys.device)  # scratch: the centroids as product operands
    bounds = torch.arange(C + 1, dtype=torch.int32, device=keys.device).expand(H, C + 1).contiguous()
    for _ in range(iters):
        ops.copy_(centroids)
        _kmeans_assign_kernel[(triton.cdiv(N, ASSIGN_TOKENS), H)](
            keys, ops, assign, N, C, *keys.stride(), *ops.stride()[:2], assign.stride(0),
            D=D, BLOCK_N=ASSIGN_TOKENS, BLOCK_C=min(ASSIGN_CLUSTERS, max(16, triton.next_power_of_2(C))),
            PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",  # fp32 keys: no TF32 rounding
            UPCAST=interpret_mode() and keys.dtype == torch.bfloat16, num_warps=ASSIGN_WARPS,
        )
        # Cluster c's tokens are order[h, starts[h, c] : starts[h, c + 1]], ascending (stable sort).
        ranked, order = torch.sort(assign, dim=1, stable=True)
        starts = torch.searchsorted(ranked, bounds)
        _kmeans_update_kernel[(C, H)](
            keys, order, starts, centroids, sizes, *keys.stride(), order.stride(0), starts.stride(0),
            *centroids.stride()[:2], sizes.stride(0),
            D=D, BLOCK_T=UPDATE_TOKENS, num_warps=UPDATE_WARPS,
        )
    return centroids, assign, sizes
