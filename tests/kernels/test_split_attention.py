"""attend_kept beside a recall, then attend_recalled after it: together the attention over every page of the row; and
attend_pages, the same attention in one launch."""

import importlib
import math

import pytest
import torch

from freekv_kernels.sparse_attention import naive_sparse_decode_attention
from freekv_kernels.split_attention import (attend_kept, attend_pages, attend_recalled, naive_attend_kept,
                                            naive_attend_pages, naive_attend_recalled)
from freekv_kernels.testing import assert_close, device, poisoned_outputs, run_without_interpreter

split_triton = importlib.import_module("freekv_kernels.split_attention.triton")

DEV = device()
NOW, LATER = 1, 2
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
K = 5  # selection slots per head
# Per row: sink pages, filled slots, window pages (the last one partial). A row with no page, one with no slot, one
# with every slot, rows in between; odd B.
ROWS = [(0, 0, 0), (1, 0, 2), (2, 5, 3), (1, 3, 1), (0, 4, 2)]


def split_case(group, heads, head_dim, page_size, dtype, seed=0):
    """Random inputs on distinct physical pages in scrambled order; rows no page uses, table entries past a row's
    pages and slot_pages past its filled slots hold NaN / garbage. Codes are random in every slot, filled or not, so
    a code past n_slots must be ignored. Returns the args (real caches), the caches as they are before the recall
    (the recalled (page, head) rows NaN), and the phase."""
    gen = torch.Generator().manual_seed(seed)
    p, B = page_size, len(ROWS)
    n_phys = sum(sum(r) for r in ROWS) + 3
    kv = torch.randn(n_phys * p, 2, heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(B, heads * group, head_dim, generator=gen).to(dtype)
    width = max(sum(r) for r in ROWS) + 1
    table = torch.full((B, width), 2**31 - 1, dtype=torch.int32)
    slot_pages = torch.full((B, K + 2), 2**31 - 1, dtype=torch.int32)
    recall = torch.randint(0, 3, (B, heads, K), generator=gen, dtype=torch.int8)
    recall[3, :, 0] = NOW  # some head recalls, and one row recalls nothing
    recall[4] = 0
    last_len = torch.randint(1, p + 1, (B,), generator=gen, dtype=torch.int32)
    last_len[2] = p
    phys = torch.randperm(n_phys, generator=gen)
    used = torch.zeros(n_phys * p, dtype=torch.bool)
    start = 0
    for b, (n_s, n_k, n_w) in enumerate(ROWS):
        n = n_s + n_k + n_w
        table[b, :n] = phys[start:start + n].to(torch.int32)
        slot_pages[b, :n_k] = table[b, n_s:n_s + n_k]
        start += n
        for i in range(n):
            used[int(table[b, i]) * p + torch.arange(int(last_len[b]) if i == n - 1 else p)] = True
    kv[~used] = float("nan")
    before = kv.clone()
    for b, (n_s, n_k, _) in enumerate(ROWS):
        for h in range(heads):
            for s in range(n_k):
                if recall[b, h, s] == NOW:
                    page = int(slot_pages[b, s])
                    before[page * p:(page + 1) * p, :, h] = float("nan")
    t = lambda x: x.to(DEV)  # noqa: E731
    n_sink = torch.tensor([r[0] for r in ROWS], dtype=torch.int32)
    n_slots = torch.tensor([r[1] for r in ROWS], dtype=torch.int32)
    row_pages = torch.tensor([sum(r) for r in ROWS], dtype=torch.int32)
    args = dict(q=t(q[:, :, :head_dim]), k_cache=t(kv[:, 0]), v_cache=t(kv[:, 1]), row_table=t(table),
                row_pages=t(row_pages), last_page_len=t(last_len), n_sink=t(n_sink), n_slots=t(n_slots),
                slot_pages=t(slot_pages), recall=t(recall), scale=1 / math.sqrt(head_dim), page_size=p)
    return args, (t(before[:, 0]), t(before[:, 1]))


def run_split(a, before, kept_fn=attend_kept, recalled_fn=attend_recalled):
    kept = kept_fn(a["q"], *before, a["row_table"], a["row_pages"], a["last_page_len"], a["n_sink"], a["n_slots"],
                   a["recall"], NOW, a["scale"], a["page_size"])
    return recalled_fn(a["q"], a["k_cache"], a["v_cache"], a["slot_pages"], a["n_slots"], a["recall"], NOW,
                       a["scale"], a["page_size"], kept)


def full_attention(a):
    return naive_sparse_decode_attention(a["q"], a["k_cache"], a["v_cache"], a["row_table"], a["row_pages"],
                                         a["last_page_len"], a["scale"], a["page_size"])


@pytest.mark.parametrize("page_size,head_dim,dtype", [(16, 64, torch.bfloat16), (32, 128, torch.float32)])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_split_equals_full_attention(group, dtype, page_size, head_dim):
    """attend_kept on the caches before the recall (a recalled page read there would bring NaN), attend_recalled after
    it: the attention over all the row's pages, as the torch references give it too."""
    a, before = split_case(group, 2, head_dim, page_size, dtype, seed=group)
    with poisoned_outputs():
        out = run_split(a, before)
    ref = full_attention(a)
    tol = TOL[dtype]
    assert_close("split vs full", ref, out, atol=tol, rtol=tol)
    assert_close("references", ref, run_split(a, before, naive_attend_kept, naive_attend_recalled), atol=tol, rtol=tol)
    assert (out[0] == 0).all(), "a row without pages outputs zeros"


@pytest.mark.parametrize("splits", [1, 4, 9])
def test_split_counts(monkeypatch, splits):
    """One split, uneven ones and more splits than a row has pages; three KV heads, G = 7."""
    monkeypatch.setattr(split_triton, "num_splits", lambda *shapes: splits)
    a, before = split_case(7, 3, 64, 16, torch.float32, seed=splits)
    with poisoned_outputs():
        out = run_split(a, before)
    assert_close("split vs full", full_attention(a), out, atol=1e-4, rtol=1e-4)


def test_recalled_pages_come_only_after_the_recall():
    """Left NaN for attend_recalled too (no recall ran), the recalled pages poison exactly the heads that recall."""
    a, before = split_case(4, 2, 64, 16, torch.float32)
    kept = attend_kept(a["q"], *before, a["row_table"], a["row_pages"], a["last_page_len"], a["n_sink"],
                       a["n_slots"], a["recall"], NOW, a["scale"], a["page_size"])
    out = attend_recalled(a["q"], *before, a["slot_pages"], a["n_slots"], a["recall"], NOW, a["scale"],
                          a["page_size"], kept)
    recalls = torch.stack([(a["recall"][b, :, :n] == NOW).any(-1) for b, n in enumerate(a["n_slots"].tolist())])
    nan_heads = torch.isnan(out).any(-1).view(len(ROWS), 2, 4).all(-1)
    assert nan_heads.eq(recalls).all() and recalls.any()


def pages_args(a, tickets, splits=None):
    return (a["q"], a["k_cache"], a["v_cache"], a["row_table"], a["row_pages"], a["last_page_len"], a["scale"],
            a["page_size"], tickets, splits)


@pytest.mark.parametrize("page_size,head_dim,dtype", [(16, 64, torch.bfloat16), (32, 128, torch.float32)])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_pages_equals_full_attention(group, dtype, page_size, head_dim):
    """One launch over every page, merged by the last program of each (row, KV head): the full attention, twice in a
    row on the same counters (which it leaves zeroed), as its torch reference gives it."""
    a, _ = split_case(group, 2, head_dim, page_size, dtype, seed=10 + group)
    tickets = torch.zeros(len(ROWS) * 2 + 3, dtype=torch.int32, device=DEV)
    ref, tol = full_attention(a), TOL[dtype]
    for _ in range(2):
        with poisoned_outputs():
            out = attend_pages(*pages_args(a, tickets))
        assert_close("pages vs full", ref, out, atol=tol, rtol=tol)
        assert (tickets == 0).all(), "the counters are left zeroed for the next call"
    assert_close("reference", ref, naive_attend_pages(*pages_args(a, tickets)), atol=tol, rtol=tol)
    assert (out[0] == 0).all(), "a row without pages outputs zeros"


@pytest.mark.parametrize("at_once", [1, 4])
@pytest.mark.parametrize("splits", [1, 4, 9, 100])
def test_pages_split_counts(monkeypatch, splits, at_once):
    """One split, uneven ones, more splits than a row has pages, and more than the table is wide (capped), with one
    or four pages loaded at once (a split's last tile part empty); three KV heads, G = 7."""
    monkeypatch.setattr(split_triton, "_PAGES_AT_ONCE", at_once)
    a, _ = split_case(7, 3, 64, 16, torch.float32, seed=splits)
    tickets = torch.zeros(len(ROWS) * 3, dtype=torch.int32, device=DEV)
    with poisoned_outputs():
        out = attend_pages(*pages_args(a, tickets, splits))
    assert_close("pages vs full", full_attention(a), out, atol=1e-4, rtol=1e-4)
    assert (tickets == 0).all()


def test_pages_split_policy(monkeypatch):
    """attend_pages' programs a (row, KV head) on a 132-SM GPU at the Llama shape's 8 KV heads: 32 at one request,
    2 at sixteen (what beside the side lanes measured fastest), one past 33, never more than the row's pages."""
    monkeypatch.setattr(split_triton, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    got = [split_triton.pages_splits(b, 8, 85, gpu) for b in (1, 4, 16, 33, 64)]
    assert got == [32, 8, 2, 1, 1]
    assert split_triton.pages_splits(1, 8, 5, gpu) == 5


def test_bad_inputs():
    a, before = split_case(4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="recall must be"):
        attend_kept(a["q"], *before, a["row_table"], a["row_pages"], a["last_page_len"], a["n_sink"], a["n_slots"],
                    a["recall"][:, :1], NOW, a["scale"], 16)
    kept = attend_kept(a["q"], *before, a["row_table"], a["row_pages"], a["last_page_len"], a["n_sink"],
                       a["n_slots"], a["recall"], NOW, a["scale"], 16)
    with pytest.raises(ValueError, match="partials"):
        attend_recalled(a["q"][:2], a["k_cache"], a["v_cache"], a["slot_pages"][:2], a["n_slots"][:2],
                        a["recall"][:2], NOW, a["scale"], 16, kept)
    for bad in (torch.zeros(len(ROWS) * 2 - 1, dtype=torch.int32, device=DEV),
                torch.zeros(len(ROWS) * 2, dtype=torch.int64, device=DEV)):
        for fn in (attend_pages, naive_attend_pages):
            with pytest.raises(ValueError, match="tickets must be"):
                fn(*pages_args(a, bad))


CHILD = r'''
import importlib
from freekv_kernels.testing import compile_sm90
m = importlib.import_module("freekv_kernels.split_attention.triton")
T = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "table_ptr": "*i32",
     "num_pages_ptr": "*i32", "last_len_ptr": "*i32", "n_sink_ptr": "*i32", "n_slots_ptr": "*i32", "recall_ptr": "*i8",
     "slot_pages_ptr": "*i32",
     "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "qk_scale": "fp32"}
kept = compile_sm90(m._attend_kept_kernel, {"H": 8, "K": 64, "G": 4, "G_PAD": 16, "D": 128, "PAGE_SIZE": 32,
                    "PAGE_TILE": 32, "NUM_SPLITS": 5, "DOT_F32": False}, T, 4)
rec = compile_sm90(m._attend_recalled_kernel, {"H": 8, "K": 64, "K_PAD": 64, "G": 4, "G_PAD": 16, "D": 128,
                   "PAGE_SIZE": 32, "BLOCK": 64, "NUM_SPLITS": 5, "SPLITS_PAD": 8, "DOT_F32": False}, T, 4)
pages = compile_sm90(m._attend_pages_kernel, {"H": 8, "G": 4, "G_PAD": 16, "D": 128, "PAGE_SIZE": 32,
                     "TILE": 64, "NUM_SPLITS": 43, "SPLITS_PAD": 64, "DOT_F32": False, "G_POW": 4},
                     dict(T, tickets_ptr="*i32"), 4)
assert "mma" in kept and "mma" in rec and "mma" in pages and "atom" in pages
print("compiled")
'''


def test_kernels_compile_for_sm90():
    """bf16 tensor-core dots (never run by the interpreter, which takes the fp32 path) compile for an H100."""
    assert run_without_interpreter(CHILD) == ["compiled"]
