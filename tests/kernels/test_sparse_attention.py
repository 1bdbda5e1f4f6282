import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from freekv_kernels.sparse_attention import naive_sparse_decode_attention, sparse_decode_attention
from freekv_kernels.testing import assert_close, device, poisoned_outputs

sa_triton = importlib.import_module("freekv_kernels.sparse_attention.triton")

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
HEADS = 2
WIDTH = 6
# Rows with no pages, one page, every page of the table, and in between (odd B).
NUM_PAGES = [0, 1, 6, 3, 2]


def _make_case(group, head_dim, page_size, dtype):
    """Random inputs; each row owns distinct pages in scrambled physical order. Cache rows that no row uses
    (spare pages, tails past last_page_len) hold NaN and page-table entries past num_pages are garbage
    (-1 / 2^31-1), so reading any of them shows up in the result. Returns the op's args and, per row, the
    cache rows of its tokens."""
    dev = device()
    batch, p = len(NUM_PAGES), page_size
    n_phys = sum(NUM_PAGES) + 2
    # k/v (and q) as strided views: the kernel must take strides from the tensors.
    kv = torch.randn(n_phys * p, 2, HEADS, head_dim, device=dev).to(dtype)
    q = torch.randn(batch, HEADS * group, 2 * head_dim, device=dev).to(dtype)[..., :head_dim]
    table = torch.full((batch, WIDTH + 1), -1, dtype=torch.int32, device=dev)
    table[:, 1::2] = 2**31 - 1
    last_len = torch.randint(1, page_size + 1, (batch,), dtype=torch.int32)
    last_len[1], last_len[2] = 1, page_size

    phys = torch.randperm(n_phys)
    tokens, start = [], 0
    for b, n in enumerate(NUM_PAGES):
        pages = phys[start : start + n]
        start += n
        table[b, :n] = pages.to(dev, torch.int32)
        rows = (pages[:, None] * p + torch.arange(p)).flatten()
        tokens.append(rows[: max(0, (n - 1) * p + int(last_len[b]))].to(dev))
    used = torch.zeros(n_phys * p, dtype=torch.bool, device=dev)
    used[torch.cat(tokens)] = True
    kv[~used] = float("nan")

    num_pages = torch.tensor(NUM_PAGES, dtype=torch.int32, device=dev)
    args = (q, kv[:, 0], kv[:, 1], table[:, :WIDTH], num_pages, last_len.to(dev), 1 / math.sqrt(head_dim), p)
    return args, tokens


def _dense_attention(q, k_cache, v_cache, tokens, scale):
    """fp32 SDPA over each row's tokens gathered in cache-row order, not page-table order."""
    group = q.shape[1] // k_cache.shape[1]
    o = torch.zeros_like(q)
    for b, rows in enumerate(tokens):
        if len(rows):
            rows = torch.sort(rows).values
            k = k_cache[rows].float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, N, D]
            v = v_cache[rows].float().transpose(0, 1).repeat_interleave(group, 0)
            o[b] = F.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=scale)[:, 0].to(q.dtype)
    return o


def _check(args, tokens, dtype):
    with poisoned_outputs():
        out = sparse_decode_attention(*args)
    tol = TOL[dtype]
    assert_close("vs naive", naive_sparse_decode_attention(*args), out, atol=tol, rtol=tol)
    q, k_cache, v_cache, *_, scale, _ = args
    assert_close("vs dense", _dense_attention(q, k_cache, v_cache, tokens, scale), out, atol=tol, rtol=tol)
    assert (out[0] == 0).all(), "row with num_pages == 0 must output zeros"
    return out


@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (32, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_matches_references(group, dtype, page_size, head_dim):
    args, tokens = _make_case(group, head_dim, page_size, dtype)
    _check(args, tokens, dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_counts_and_page_order(monkeypatch, num_splits):
    """One split (multi-page online softmax in one program), uneven splits, and more splits than pages (splits
    with no pages for every row); G = 7 is not a power of two. Permuting a row's full pages changes nothing."""
    monkeypatch.setattr(sa_triton, "_num_splits", lambda *shapes: num_splits)
    args, tokens = _make_case(7, 64, 16, torch.float32)
    out = _check(args, tokens, torch.float32)

    table = args[3].clone()
    for b, n in enumerate(NUM_PAGES):
        if n > 2:  # the last page holds last_page_len tokens: it stays last
            table[b, : n - 1] = table[b, torch.randperm(n - 1)]
    with poisoned_outputs():
        permuted = sparse_decode_attention(*args[:3], table, *args[4:])
    assert_close("permuted pages", out, permuted, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    """Captured once, replayed after the page table, num_pages and last_page_len change in place."""
    args, _ = _make_case(4, 128, 16, torch.bfloat16)
    q, k_cache, v_cache, table, num_pages, last_len, scale, p = args
    table = table.clone()
    sparse_decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_decode_attention(q, k_cache, v_cache, table, num_pages, last_len, scale, p)
    table[1, :2] = table[2, :2]
    num_pages[1] = 2
    last_len[1] = p
    graph.replay()
    ref = naive_sparse_decode_attention(q, k_cache, v_cache, table, num_pages, last_len, scale, p)
    assert_close("graph replay", ref, out, atol=1e-2, rtol=1e-2)
