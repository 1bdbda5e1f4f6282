"""recall_pages against its torch reference: only head head[i] of GPU page dst[i] is written, nothing else."""

import pytest
import torch

from freekv_kernels.recall import naive_recall_pages, recall_pages
from freekv_kernels.testing import assert_close, device

DEV = device()
GUARD = 2  # NaN pages around the GPU cache: a write through a garbage index lands there and is caught
SHAPES = [(H, D, p) for H in (1, 3, 8) for D in (64, 128) for p in (16, 32)]
DTYPES = [torch.bfloat16, torch.float32]


def host_randn(*shape, dtype):
    """The host arena: pinned on a CUDA machine so the kernel reads it over UVA."""
    t = torch.randn(*shape, dtype=dtype)
    return t.pin_memory() if DEV.type == "cuda" else t


def entries(n, n_invalid, src_pages, dst_pages, H):
    """Valid entries have distinct (dst, head) pairs; invalid ones carry garbage (-1) indices."""
    pair = torch.randperm(dst_pages * H)[:n]
    src = torch.randint(0, src_pages, (n,), dtype=torch.int32)
    head, dst = (pair % H).int(), (pair // H).int()
    valid = torch.ones(n, dtype=torch.bool)
    valid[torch.randperm(n)[:n_invalid]] = False
    for t in (src, head, dst):
        t[~valid] = -1
    return [t.to(DEV) for t in (src, head, dst, valid)]


def recall_into(fn, host_layer, idx, p, pages, extra_rows, fused_kv=False):
    """Run `fn` into NaN caches of pages*p + extra_rows rows, each inside a NaN buffer with GUARD pages on both
    sides; returns the K and V buffers [rows, H, D]. fused_kv: K and V interleave in one [rows, 2, H, D] buffer,
    so the caches are non-contiguous views."""
    H, D, dtype = host_layer.shape[1], host_layer.shape[-1], host_layer.dtype
    rows = (pages + 2 * GUARD) * p + extra_rows
    shape = (rows, 2, H, D) if fused_kv else (2, rows, H, D)
    buf = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    kb, vb = buf.unbind(1 if fused_kv else 0)
    live = slice(GUARD * p, GUARD * p + pages * p + extra_rows)
    fn(host_layer, kb[live], vb[live], *idx, p)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return kb.cpu(), vb.cpu()


def written_mask(shape, idx, p):
    """Elements of a guarded [rows, H, D] buffer that the contract says are written."""
    _, head, dst, valid = idx
    mask = torch.zeros(shape, dtype=torch.bool)
    for h, d, ok in zip(head.tolist(), dst.tolist(), valid.tolist()):
        if ok:
            mask[(GUARD + d) * p : (GUARD + d + 1) * p, h] = True
    return mask


def check_written(name, ref, out, mask):
    """Exactly `mask` was written (everything else still NaN) and it matches the reference bit for bit."""
    assert torch.equal(~ref.isnan(), mask), f"{name}: the reference wrote outside the contract"
    assert torch.equal(~out.isnan(), mask), f"{name}: {int((~out.isnan() ^ mask).sum())} elements written wrongly"
    assert_close(name, ref[mask], out[mask], atol=0, rtol=0)


def check_recall(host_layer, idx, p, pages, extra_rows, fused_kv=False):
    ref = recall_into(naive_recall_pages, host_layer, idx, p, pages, extra_rows, fused_kv)
    out = recall_into(recall_pages, host_layer, idx, p, pages, extra_rows, fused_kv)
    mask = written_mask(ref[0].shape, idx, p)
    check_written("k_cache", ref[0], out[0], mask)
    check_written("v_cache", ref[1], out[1], mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_recall_pages(H, D, p, dtype):
    P, pages = 13, 11
    host_layer = host_randn(P, H, 2, p, D, dtype=dtype)
    # 9 entries, 3 invalid; T = 11*p + 5: the 5 rows past the last page are never written.
    check_recall(host_layer, entries(9, 3, P, pages, H), p, pages, extra_rows=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recall_pages_layer_view(dtype):
    """The kernel reads host_kv[:, layer] of a [P, L, H, 2, p, D] arena and writes K/V caches that are
    interleaved views of one buffer: all strides come from the tensors."""
    P, L, H, D, p, pages = 7, 3, 3, 64, 16, 5
    host_kv = host_randn(P, L, H, 2, p, D, dtype=dtype)
    idx = entries(11, 4, P, pages, H)
    for layer in (0, L - 1):
        check_recall(host_kv[:, layer], idx, p, pages, extra_rows=0, fused_kv=True)


@pytest.mark.parametrize("n,n_invalid", [(0, 0), (5, 5)])
def test_recall_pages_nothing_valid(n, n_invalid):
    P, H, D, p, pages = 4, 3, 64, 16, 3
    host_layer = host_randn(P, H, 2, p, D, dtype=torch.bfloat16)
    check_recall(host_layer, entries(n, n_invalid, P, pages, H), p, pages, extra_rows=3)


def test_recall_pages_refuses_strided_index_vectors():
    """An expanded index (one KV head: [B, 1, k] -> stride-0 view) must be refused, not read past its storage."""
    P, H, D, p = 4, 1, 64, 16
    host_layer = host_randn(P, H, 2, p, D, dtype=torch.bfloat16)
    k = torch.zeros(8 * p, H, D, dtype=torch.bfloat16, device=DEV)
    v = torch.zeros_like(k)
    ok = torch.zeros(6, dtype=torch.int32, device=DEV)
    head = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEV).expand(2, 1, 3).reshape(-1)
    assert head.stride() == (0,)
    with pytest.raises(ValueError, match="head must be a contiguous 1-D"):
        recall_pages(host_layer, k, v, ok, head, ok + 1, torch.ones(6, dtype=torch.bool, device=DEV), p)
