"""Torch reference for kmeans_keys: Lloyd's k-means over one prompt's keys per KV head (LouisKV's semantic
clusters, see docs/kernels.md).

Squared L2 distance, not dot-product similarity: the mean of a cluster minimises the squared L2 distance to its
members, so every Lloyd iteration lowers the objective, and a member k of centroid c scores |q.k - q.c| <=
|q| ||k - c|| against any query, which is what retrieval by centroid needs. It is computed as ||c||^2 - 2 k.c
(||k||^2 is the same for every cluster of a key), with the centroids rounded to the keys' dtype first: the
kernel's product then runs on fp16 / bf16 tensor cores with exact products and fp32 sums; this reference rounds and
sums alike, in another order.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INITS = ("strided",)
PRODUCT_ELEMENTS = 1 << 24  # bounds the reference's temporary products (64 MiB)


def check_kmeans_args(keys: torch.Tensor, num_clusters: int, iters: int, init: str | torch.Tensor) -> None:
    if keys.dim() != 3:
        raise ValueError(f"keys must be [H, N, D], got shape {tuple(keys.shape)}")
    if keys.dtype not in DTYPES:
        raise ValueError(f"keys must be one of {DTYPES}, got {keys.dtype}")
    H, N, D = keys.shape
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim must be a power of two >= 16 (tl.dot), got {D}")
    if not 1 <= num_clusters <= N:
        raise ValueError(f"num_clusters must be in [1, N = {N}], got {num_clusters}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if isinstance(init, torch.Tensor):
        if init.shape != (H, num_clusters, D) or not init.is_floating_point() or init.device != keys.device:
            raise ValueError(f"init centroids must be floating [H, C, D] = {(H, num_clusters, D)} on {keys.device}, "
                             f"got {init.dtype} {tuple(init.shape)} on {init.device}")
    elif init not in INITS:
        raise ValueError(f"init must be one of {INITS} or a centroid tensor, got {init!r}")


def init_centroids(keys: torch.Tensor, num_clusters: int, init: str | torch.Tensor) -> torch.Tensor:
    """fp32 [H, C, D]. "strided": centroid c is the key at the middle of the c-th of C equal spans of the prompt,
    token (2c + 1) N // 2C (distinct for N >= C); keys ordered in time start from one topic per span."""
    if isinstance(init, torch.Tensor):
        return init.float()
    N = keys.shape[1]
    c = torch.arange(num_clusters, device=keys.device)
    return keys.index_select(1, (2 * c + 1) * N // (2 * num_clusters)).float()


def distances(keys: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """keys [N, D], centroids fp32 [C, D] -> [N, C] fp32 ||c||^2 - 2 k.c with c rounded to the keys' dtype. Each
    dot product is one reduction over D, so equal centroids give equal distances and a tie goes to the lower index
    (a matmul's blocking may sum two columns in different orders)."""
    x, c = keys.float(), centroids.to(keys.dtype).float()
    step = max(1, PRODUCT_ELEMENTS // x.numel())  # centroids per [N, step, D] product
    dots = torch.cat([(x[:, None, :] * c[None, i:i + step]).sum(-1) for i in range(0, c.shape[0], step)], dim=1)
    return (c * c).sum(-1) - 2 * dots


def naive_assign(keys: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """[H, N] int32: the nearest centroid of every key, ties to the lower index (argmin's first minimum)."""
    assign = torch.empty(keys.shape[:2], dtype=torch.int32, device=keys.device)
    for h in range(keys.shape[0]):
        assign[h] = distances(keys[h], centroids[h]).argmin(-1).int()
    return assign


def naive_update(
    keys: torch.Tensor, assign: torch.Tensor, centroids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids fp32 [H, C, D], sizes [H, C] int32): the mean of each cluster's keys; an empty cluster keeps its
    previous centroid."""
    H, N, D = keys.shape
    idx = assign.long()
    sizes = torch.zeros(centroids.shape[:2], dtype=torch.int64, device=keys.device)
    sizes.scatter_add_(1, idx, torch.ones_like(idx))
    sums = torch.zeros_like(centroids).scatter_add_(1, idx[..., None].expand(H, N, D), keys.float())
    means = sums / sizes.clamp_min(1)[..., None]
    return torch.where(sizes[..., None] > 0, means, centroids), sizes.int()


def naive_kmeans_keys(
    keys: torch.Tensor, num_clusters: int, iters: int, init: str | torch.Tensor = "strided"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [H, N, D] (finite) -> (centroids fp32 [H, C, D], assign [H, N] int32, sizes [H, C] int32) after `iters`
    Lloyd iterations (assign, then update) from `init`; the outputs agree: sizes count the final assignment and a
    non-empty cluster's centroid is the mean of its keys."""
    check_kmeans_args(keys, num_clusters, iters, init)
    centroids = init_centroids(keys, num_clusters, init)
    for _ in range(iters):
        assign = naive_assign(keys, centroids)
        centroids, sizes = naive_update(keys, assign, centroids)
    return centroids, assign, sizes
