"""kmeans_keys against its torch reference: single Lloyd steps on random keys, whole runs on keys whose clusters
are known, chained iterations, degenerate and bad inputs."""

import pytest
import torch

from freekv_kernels.kmeans import kmeans_keys, naive_assign, naive_kmeans_keys, naive_update
from freekv_kernels.testing import assert_close, device, poisoned_outputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (H, N, D, C): N not a multiple of the 64-token block, C not a power of two, C above one 64-centroid block.
SHAPES = [(1, 77, 64, 5), (3, 203, 128, 13), (8, 130, 64, 7), (1, 150, 64, 70)]
CLEAR = 1e-2  # distance margin (values ~1e2) past any fp32 summation-order difference


def run(keys, C, iters, init="strided"):
    """The kernel with NaN-poisoned outputs, checked for shape, dtype and range."""
    with poisoned_outputs():
        centroids, assign, sizes = kmeans_keys(keys, C, iters, init)
    H, N, D = keys.shape
    assert centroids.shape == (H, C, D) and centroids.dtype == torch.float32
    assert not centroids.isnan().any(), "unwritten centroids"
    assert assign.shape == (H, N) and assign.dtype == torch.int32 and sizes.shape == (H, C)
    assert ((assign >= 0) & (assign < C)).all(), "unwritten or out-of-range assignments"
    assert_close("sizes", count(assign, C), sizes)
    return centroids, assign, sizes


def count(assign, C):
    return torch.zeros(assign.shape[0], C, dtype=torch.int32, device=assign.device).scatter_add_(
        1, assign.long(), torch.ones_like(assign))


def margin(keys, centroids):
    """[H, N]: the gap between each key's two nearest (rounded) centroids, in fp64."""
    c = centroids.to(keys.dtype).double()
    dist = (c * c).sum(-1)[:, None, :] - 2 * keys.double() @ c.transpose(1, 2)
    if dist.shape[-1] == 1:
        return torch.full(dist.shape[:2], float("inf"), dtype=torch.float64, device=keys.device)
    top2 = dist.topk(2, dim=-1, largest=False).values
    return top2[..., 1] - top2[..., 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,N,D,C", SHAPES)
def test_one_iteration_matches_reference(H, N, D, C, dtype):
    torch.manual_seed(H * N + C)
    keys = torch.randn(H, N, D, device=device()).to(dtype)
    init = torch.randn(H, C, D, device=device())
    centroids, assign, sizes = run(keys, C, 1, init)
    clear = margin(keys, init) > CLEAR
    assert clear.float().mean() > 0.95, "too few keys with a clear nearest centroid for the test to mean much"
    ref_assign = naive_assign(keys, init)
    assert torch.equal(assign[clear], ref_assign[clear])
    # The update from the kernel's own assignment (they may differ only at near-ties).
    ref_centroids, ref_sizes = naive_update(keys, assign, init)
    assert_close("centroids", ref_centroids, centroids, atol=1e-5, rtol=1e-5)
    assert_close("sizes", ref_sizes, sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_iterations_chain_exactly(dtype):
    """iters=k is k single iterations, bit for bit: the loop keeps no other state and the sums have a fixed order."""
    torch.manual_seed(1)
    keys = torch.randn(3, 150, 64, device=device()).to(dtype)
    centroids, assign, sizes = run(keys, 9, 4)
    step = "strided"
    for _ in range(4):
        step, step_assign, step_sizes = run(keys, 9, 1, step)
    assert torch.equal(centroids, step) and torch.equal(assign, step_assign) and torch.equal(sizes, step_sizes)
    # The run repeats itself: the same inputs give the same bits.
    again = run(keys, 9, 4)
    assert all(torch.equal(a, b) for a, b in zip(again, (centroids, assign, sizes)))


def clustered_keys(H, N, D, C, dtype):
    """Keys ordered in time as C topics, one contiguous segment each (lengths jittered by less than half a span,
    so the strided init takes one key per topic), each a tight ball around its own far-apart centre.
    Returns keys and the true segment of every token [H, N]."""
    span = N / C
    bounds = (torch.arange(1, C) * span + (torch.rand(H, C - 1) - 0.5) * 0.6 * span).long()
    truth = torch.searchsorted(bounds, torch.arange(N).expand(H, N).contiguous(), right=True)
    centres = 4 * torch.randn(H, C, D)
    keys = centres.gather(1, truth[..., None].expand(H, N, D)) + 0.2 * torch.randn(H, N, D)
    return keys.to(dtype).to(device()), truth.int().to(device())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,N,D,C", [(1, 100, 128, 6), (3, 203, 64, 11), (8, 96, 64, 3)])
def test_recovers_known_clusters(H, N, D, C, dtype):
    torch.manual_seed(C)
    keys, truth = clustered_keys(H, N, D, C, dtype)
    centroids, assign, sizes = run(keys, C, 3)
    assert torch.equal(assign, truth), "a key left its topic"
    assert_close("sizes", count(truth, C), sizes)
    means = torch.stack([torch.stack([keys[h][truth[h] == c].double().mean(0) for c in range(C)]) for h in range(H)])
    assert_close("centroids", means.float(), centroids, atol=1e-5, rtol=1e-5)
    ref_centroids, ref_assign, ref_sizes = naive_kmeans_keys(keys, C, 3)
    assert torch.equal(assign, ref_assign) and torch.equal(sizes, ref_sizes)
    assert_close("centroids", ref_centroids, centroids, atol=1e-5, rtol=1e-5)


def test_strided_view():
    """A prefill's keys come as [N, H, D]: the transposed view gives the bits of a contiguous copy."""
    torch.manual_seed(2)
    nhd = torch.randn(130, 3, 64, device=device()).to(torch.float16)
    out = run(nhd.transpose(0, 1), 7, 2)
    ref = run(nhd.transpose(0, 1).contiguous(), 7, 2)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_one_key_per_cluster():
    """N == C: the strided init takes every key, each key is its own cluster."""
    keys = torch.randn(2, 37, 64, device=device())
    centroids, assign, sizes = run(keys, 37, 2)
    assert torch.equal(assign, torch.arange(37, dtype=torch.int32, device=keys.device).expand(2, 37))
    assert (sizes == 1).all() and torch.equal(centroids, keys)


@pytest.mark.parametrize("C", [5, 70])  # 70: ties across two blocks of centroids
def test_all_equal_keys(C):
    """Every distance ties: every key goes to cluster 0, the others stay empty at their (equal) init."""
    keys = torch.randn(1, 1, 64, device=device()).to(torch.bfloat16).expand(3, 90, 64).contiguous()
    centroids, assign, sizes = run(keys, C, 2)
    assert (assign == 0).all() and (sizes[:, 0] == 90).all() and (sizes[:, 1:] == 0).all()
    assert torch.equal(centroids, keys[:, :C].float())
    assert all(torch.equal(a, b) for a, b in zip(naive_kmeans_keys(keys, C, 2), (centroids, assign, sizes)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_empty_clusters_keep_their_centroid(dtype):
    """A duplicate of a lower centroid (ties go to the lower index) gets no keys in the first iteration, a centroid
    far from every key in none; an empty cluster keeps its previous centroid exactly."""
    torch.manual_seed(3)
    keys = torch.randn(2, 100, 64, device=device()).to(dtype)
    init = keys[:, :6].float().clone()
    init[:, 2] = 1e3
    init[:, 4] = init[:, 1]
    for iters, empty in [(1, [2, 4]), (3, [2])]:  # after one update the duplicate's twin has moved away
        centroids, assign, sizes = run(keys, 6, iters, init)
        full = [c for c in range(6) if c not in empty]
        assert (sizes[:, empty] == 0).all() and (sizes[:, full] > 0).all()
        assert torch.equal(centroids[:, empty], init[:, empty])
        ref_centroids, ref_assign, ref_sizes = naive_kmeans_keys(keys, 6, iters, init)
        assert torch.equal(assign, ref_assign) and torch.equal(sizes, ref_sizes)
        assert_close("centroids", ref_centroids, centroids, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [kmeans_keys, naive_kmeans_keys])
def test_bad_input(fn):
    keys = torch.randn(2, 40, 64, device=device())
    cases = [
        ((keys[0], 4, 2), "\\[H, N, D\\]"),
        ((keys.int(), 4, 2), "must be one of"),
        ((keys[..., :48], 4, 2), "power of two"),
        ((keys[..., :8], 4, 2), "power of two"),
        ((keys, 41, 2), "num_clusters"),  # fewer keys than clusters
        ((keys, 0, 2), "num_clusters"),
        ((keys, 4, 0), "iters"),
        ((keys, 4, 2, "random"), "init"),
        ((keys, 4, 2, torch.zeros(2, 5, 64, device=keys.device)), "init centroids"),
        ((keys, 4, 2, torch.zeros(2, 4, 64, dtype=torch.int32, device=keys.device)), "init centroids"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(*args)
