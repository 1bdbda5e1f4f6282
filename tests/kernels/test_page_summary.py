"""page_summary against its torch reference: only rows dst[i] of valid entries are written, exactly (min/max)."""

import pytest
import torch

from freekv_kernels.page_summary import naive_page_summary, page_summary
from freekv_kernels.testing import assert_close, device

DEV = device()
GUARD = 1  # NaN summary rows on each side: a write through a garbage index lands there and is caught
SHAPES = [(H, D, p) for H in (1, 3, 8) for D in (64, 128) for p in (16, 32)]
DTYPES = [torch.bfloat16, torch.float32]


def entries(n, n_invalid, gpu_pages, P):
    """Valid entries have distinct destination rows; invalid ones carry garbage (-1) indices."""
    pages = torch.randint(0, gpu_pages, (n,), dtype=torch.int32)
    dst = torch.randperm(P)[:n].int()
    valid = torch.ones(n, dtype=torch.bool)
    valid[torch.randperm(n)[:n_invalid]] = False
    pages[~valid] = -1
    dst[~valid] = -1
    return [t.to(DEV) for t in (pages, dst, valid)]


def summarize_into(fn, k_cache, idx, P, p, layers=1, layer=0):
    """Run `fn` into NaN summaries [P, H, 2, D] that are layer `layer` of a [P + 2*GUARD, layers, H, 2, D]
    buffer (a non-contiguous view when layers > 1); returns that layer's rows of the buffer, guards included."""
    _, H, D = k_cache.shape
    buf = torch.full((P + 2 * GUARD, layers, H, 2, D), float("nan"), dtype=k_cache.dtype, device=DEV)
    fn(k_cache, *idx, buf[GUARD : GUARD + P, layer], p)
    return buf[:, layer].cpu()


def written_mask(shape, idx):
    _, dst, valid = idx
    mask = torch.zeros(shape, dtype=torch.bool)
    for d, ok in zip(dst.tolist(), valid.tolist()):
        if ok:
            mask[GUARD + d] = True
    return mask


def check_summaries(k_cache, idx, P, p, layers=1, layer=0):
    ref = summarize_into(naive_page_summary, k_cache, idx, P, p, layers, layer)
    out = summarize_into(page_summary, k_cache, idx, P, p, layers, layer)
    mask = written_mask(ref.shape, idx)
    assert torch.equal(~ref.isnan(), mask), "the reference wrote outside the contract"
    assert torch.equal(~out.isnan(), mask), f"{int((~out.isnan() ^ mask).sum())} summary elements written wrongly"
    assert_close("summaries", ref[mask], out[mask], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_page_summary(H, D, p, dtype):
    gpu_pages, P = 9, 15
    # T = 9*p + 3: rows past the last page exist but belong to no page.
    k_cache = torch.randn(gpu_pages * p + 3, H, D, dtype=dtype, device=DEV)
    check_summaries(k_cache, entries(7, 2, gpu_pages, P), P, p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_page_summary_strided_views(dtype):
    """K cache interleaved with V in one [T, 2, H, D] buffer, summaries one layer of a [P, L, H, 2, D] buffer."""
    gpu_pages, P, H, D, p = 5, 9, 3, 64, 16
    kv = torch.randn(gpu_pages * p, 2, H, D, dtype=dtype, device=DEV)
    idx = entries(5, 1, gpu_pages, P)
    for layer in (0, 2):
        check_summaries(kv[:, 0], idx, P, p, layers=3, layer=layer)


@pytest.mark.parametrize("n,n_invalid", [(0, 0), (3, 3)])
def test_page_summary_nothing_valid(n, n_invalid):
    k_cache = torch.randn(4 * 16, 3, 64, dtype=torch.bfloat16, device=DEV)
    check_summaries(k_cache, entries(n, n_invalid, 4, 5), 5, 16)
