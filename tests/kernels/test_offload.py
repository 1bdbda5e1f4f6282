"""offload_pages against its torch reference: whole GPU pages (every head) into host pages dst[i] and their key
summaries into summary rows dst[i], exactly (copies and min/max); nothing else is written."""

import pytest
import torch

from freekv_kernels.offload import naive_offload_pages, offload_pages
from freekv_kernels.testing import assert_close, device

DEV = device()
GUARD = 1  # NaN host pages on each side: a write through a garbage index lands there and is caught
SHAPES = [(H, D, p) for H in (1, 3, 8) for D in (64, 128) for p in (16, 32)]
DTYPES = [torch.bfloat16, torch.float32]


def entries(n, n_invalid, gpu_pages, P):
    """Valid entries have distinct host pages; invalid ones carry garbage (-1) indices."""
    src = torch.randint(0, gpu_pages, (n,), dtype=torch.int32)
    dst = torch.randperm(P)[:n].int()
    valid = torch.ones(n, dtype=torch.bool)
    valid[torch.randperm(n)[:n_invalid]] = False
    src[~valid] = -1
    dst[~valid] = -1
    return [t.to(DEV) for t in (src, dst, valid)]


def offload_into(fn, k_cache, v_cache, idx, P, p, layers=1, layer=0, programs=0):
    """Run `fn` into a NaN host layer [P, H, 2, p, D] and NaN summaries [P, H, 2, D]: layer `layer` of a
    [P + 2*GUARD, layers, H, 2, p, D] arena (pinned on CUDA) and of a [P + 2*GUARD, layers, H, 2, D] buffer
    (non-contiguous views when layers > 1). Returns that layer's pages and summary rows, guards included."""
    _, H, D = k_cache.shape
    arena = torch.full((P + 2 * GUARD, layers, H, 2, p, D), float("nan"), dtype=k_cache.dtype)
    if DEV.type == "cuda":
        arena = arena.pin_memory()
    summ = torch.full((P + 2 * GUARD, layers, H, 2, D), float("nan"), dtype=k_cache.dtype, device=DEV)
    fn(k_cache, v_cache, arena[GUARD : GUARD + P, layer], summ[GUARD : GUARD + P, layer], *idx, p, programs=programs)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    others = torch.arange(layers) != layer
    assert arena[:, others].isnan().all(), f"{fn.__name__} wrote into another layer"
    assert summ[:, others.to(DEV)].isnan().all(), f"{fn.__name__} wrote summaries of another layer"
    return arena[:, layer], summ[:, layer].cpu()


def expected(k_cache, v_cache, idx, P, p):
    """The guarded host layer and summaries built straight from the contract (NaN where nothing is written):
    rows of a page past the end of k_cache (a partial last prefill page) are neither written nor summarised."""
    _, H, D = k_cache.shape
    exp = torch.full((P + 2 * GUARD, H, 2, p, D), float("nan"), dtype=k_cache.dtype)
    summ = torch.full((P + 2 * GUARD, H, 2, D), float("nan"), dtype=k_cache.dtype)
    src, dst, valid = idx
    for s, d, ok in zip(src.tolist(), dst.tolist(), valid.tolist()):
        if ok:
            rows = min(p, k_cache.shape[0] - s * p)
            keys = k_cache[s * p : s * p + rows].cpu()
            exp[GUARD + d, :, 0, :rows] = keys.transpose(0, 1)
            exp[GUARD + d, :, 1, :rows] = v_cache[s * p : s * p + rows].transpose(0, 1).cpu()
            summ[GUARD + d, :, 0] = keys.amin(dim=0)
            summ[GUARD + d, :, 1] = keys.amax(dim=0)
    return exp, summ


def check_offload(k_cache, v_cache, idx, P, p, layers=1, layer=0, programs=0):
    exp = expected(k_cache, v_cache, idx, P, p)
    for name, fn in (("naive", naive_offload_pages), ("triton", offload_pages)):
        out = offload_into(fn, k_cache, v_cache, idx, P, p, layers, layer, programs)
        for what, e, o in zip(("host_layer", "summaries"), exp, out):
            mask = ~e.isnan()
            wrong = int((~o.isnan() ^ mask).sum())
            assert wrong == 0, f"{name} {what}: {wrong} elements written wrongly"
            assert_close(f"{name} {what}", e[mask], o[mask], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_offload_pages(H, D, p, dtype):
    gpu_pages, P = 9, 13
    # T = 9*p + 3: the 3 rows past the last page are never read.
    k_cache, v_cache = torch.randn(2, gpu_pages * p + 3, H, D, dtype=dtype, device=DEV)
    check_offload(k_cache, v_cache, entries(7, 2, gpu_pages, P), P, p)


@pytest.mark.parametrize("programs", [1, 3, 16])
@pytest.mark.parametrize("H,p", [(3, 16), (8, 32)])
def test_offload_pages_few_programs(H, p, programs):
    """Fewer programs than (page, head) items: each strides over several, invalid entries among them."""
    gpu_pages, P = 11, 17
    k_cache, v_cache = torch.randn(2, gpu_pages * p + 5, H, 64, dtype=torch.bfloat16, device=DEV)
    check_offload(k_cache, v_cache, entries(9, 3, gpu_pages, P), P, p, programs=programs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_offload_pages_prefill_partial_page(dtype):
    """A prefill tensor of 4*p + 5 tokens: its last page holds 5 rows, only those reach the host page and its
    summary."""
    n_tokens, P, H, D, p = 4 * 16 + 5, 8, 3, 64, 16
    k_cache, v_cache = torch.randn(2, n_tokens, H, D, dtype=dtype, device=DEV)
    src, dst = torch.arange(5, dtype=torch.int32), torch.tensor([6, 0, 3, 7, 2], dtype=torch.int32)
    idx = [t.to(DEV) for t in (src, dst, torch.ones(5, dtype=torch.bool))]
    check_offload(k_cache, v_cache, idx, P, p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_offload_pages_layer_view(dtype):
    """Writes host_kv[:, layer] of a [P, L, H, 2, p, D] arena and one layer of [P, L, H, 2, D] summaries from K/V
    caches interleaved in one [T, 2, H, D] buffer: all strides come from the tensors, other layers stay untouched."""
    gpu_pages, P, H, D, p = 5, 7, 3, 64, 16
    kv = torch.randn(gpu_pages * p, 2, H, D, dtype=dtype, device=DEV)
    idx = entries(5, 2, gpu_pages, P)
    for layer in (0, 2):
        check_offload(kv[:, 0], kv[:, 1], idx, P, p, layers=3, layer=layer)


@pytest.mark.parametrize("n,n_invalid", [(0, 0), (3, 3)])
def test_offload_pages_nothing_valid(n, n_invalid):
    k_cache, v_cache = torch.randn(2, 4 * 16, 3, 64, dtype=torch.bfloat16, device=DEV)
    check_offload(k_cache, v_cache, entries(n, n_invalid, 4, 5), 5, 16)


@pytest.mark.parametrize("programs", [0, 3])
@pytest.mark.parametrize("H,D,p", [(1, 64, 16), (3, 128, 32), (8, 64, 32), (8, 128, 16)])
def test_offload_pages_fp8_host(H, D, p, programs):
    """Into an FP8 arena (pages and row exponents strided views of one byte range, as the kvstore maps it): each row
    quantised as the codec's reference does it, bit for bit, its exponent beside it; summaries from the exact keys;
    a partial last page writes only its rows (and their exponents); nothing else is written."""
    from freekv_kvstore import ArenaGeometry
    from freekv_kvstore.client import arena_views
    from freekv_kernels.fp8_rows import naive_quantize_rows

    gpu_pages, P, L, layer = 6, 11, 2, 1
    T = gpu_pages * p - 3  # the last page holds p - 3 rows
    scale = torch.exp2(torch.randint(-12, 13, (T, H, 1)).float())
    k_cache, v_cache = ((torch.randn(2, T, H, D) * scale).to(torch.bfloat16)).to(DEV)
    src = torch.tensor([5, 0, 3, 2, 1, 4], dtype=torch.int32)
    dst = torch.tensor([7, 2, 10, 0, 4, 9], dtype=torch.int32)
    valid = torch.tensor([True, True, False, True, True, True])
    idx = [t.to(DEV) for t in (src, dst, valid)]
    g = ArenaGeometry(L, H, p, D, "float8_e4m3fn")
    outs = []
    for fn in (naive_offload_pages, offload_pages):
        raw = torch.full((P * g.page_bytes,), 0x7F, dtype=torch.uint8)  # e4m3 NaN, exponent 127
        raw = raw.pin_memory() if DEV.type == "cuda" else raw
        pages, scales = arena_views(raw, g, P)
        summ = torch.full((P, H, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
        fn(k_cache, v_cache, pages[:, layer], summ, *idx, p, programs=programs, host_scales=scales[:, layer])
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        outs.append((raw.clone(), pages, scales, summ.cpu()))
    raw_ref, pages_ref, scales_ref, summ_ref = outs[0]
    for s, d, ok in zip(src.tolist(), dst.tolist(), valid.tolist()):
        n = min(p, T - s * p) if ok else 0
        for kv, cache in enumerate((k_cache, v_cache)):
            rows = cache[s * p: s * p + n].cpu().transpose(0, 1)
            q, e = naive_quantize_rows(rows)
            assert torch.equal(pages_ref[d, layer, :, kv, :n].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(scales_ref[d, layer, :, kv, :n], e)
            # the rows past a partial page's end, and every invalid entry's page, stay as they were
            assert (pages_ref[d, layer, :, kv, n:].view(torch.uint8) == 0x7F).all()
            assert (scales_ref[d, layer, :, kv, n:] == 0x7F).all()
    written = torch.zeros(P, dtype=torch.bool)
    written[dst[valid].long()] = True
    assert (pages_ref[~written].view(torch.uint8) == 0x7F).all() and (pages_ref[:, 0].view(torch.uint8) == 0x7F).all()
    assert (scales_ref[:, 0] == 0x7F).all()
    for s, d in zip(src[valid].tolist(), dst[valid].tolist()):
        keys = k_cache[s * p: min(T, (s + 1) * p)].cpu()
        assert torch.equal(summ_ref[d, :, 0], keys.amin(0)) and torch.equal(summ_ref[d, :, 1], keys.amax(0))
    raw_out, _, _, summ_out = outs[1]
    assert torch.equal(raw_out, raw_ref), f"{int((raw_out != raw_ref).sum())} arena bytes differ from the reference"
    assert torch.equal(summ_out.isnan(), summ_ref.isnan())
    assert torch.equal(summ_out.nan_to_num(), summ_ref.nan_to_num())
