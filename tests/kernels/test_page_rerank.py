"""Key codes, top_pages and rerank_pages against their torch references, plus what the codes must mean."""

import pytest
import torch
from freekv_kernels.offload import naive_offload_pages, offload_pages
from freekv_kernels.page_rerank import (
    dequantize_keys,
    empty_codes,
    naive_rerank_pages,
    naive_sketch_pages,
    naive_sketch_picks,
    naive_top_pages,
    quantize_keys,
    rerank_pages,
    sketch_bytes,
    sketch_pages,
    top_pages,
)
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW
from freekv_kernels.testing import assert_close, device, poisoned_outputs

DEV = device()
B, R = 4, 6


def test_codes_follow_the_bins_of_the_page_range():
    """Channel d of a token gets bin floor(4 (k - lo) / (hi - lo)) (the top edge in bin 3), packed at bits
    2 (d % 4) of byte d // 4; decoding lands within an eighth of the range, at the bin centre."""
    torch.manual_seed(0)
    k = torch.randn(3, 16, 64)
    lo, hi = k.amin(1), k.amax(1)
    codes = quantize_keys(k, lo, hi)
    assert codes.shape == (3, 16, 16) and codes.dtype == torch.uint8
    for d in (0, 5, 16, 33, 63):
        want = ((k[..., d] - lo[:, None, d]) / (hi[:, None, d] - lo[:, None, d]) * 4).floor().clamp(max=3)
        got = (codes[..., d // 4].int() >> (2 * (d % 4))) & 3
        assert torch.equal(got, want.int()), d
    err = (dequantize_keys(codes, lo, hi) - k).abs() / (hi - lo)[:, None]
    assert err.max() <= 0.125 + 1e-6
    flat = torch.zeros(1, 4, 64)  # a constant channel decodes to itself
    assert torch.equal(dequantize_keys(quantize_keys(flat, flat[:, 0], flat[:, 0]), flat[:, 0], flat[:, 0]), flat)


@pytest.mark.parametrize("H,D,p", [(1, 64, 16), (3, 128, 32), (8, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("byte_major", [True, False])
def test_offload_writes_the_reference_codes(H, D, p, dtype, byte_major):
    """offload_pages with codes: the codes of every valid page's rows (a partial last page's existing rows only),
    equal to the reference's; other host pages untouched; in the byte-major store or a token-major one."""
    torch.manual_seed(1)
    T = 5 * p + 7
    kc, vc = torch.randn(T, H, D).to(dtype), torch.randn(T, H, D).to(dtype)
    src = torch.tensor([0, 3, 5, -1], dtype=torch.int32)
    dst = torch.tensor([4, 1, 2, -1], dtype=torch.int32)
    valid = torch.tensor([True, True, True, False])
    P = 7
    outs = []
    for fn, dev in ((naive_offload_pages, "cpu"), (offload_pages, DEV)):
        host = torch.zeros(P, H, 2, p, D, dtype=dtype)
        if dev != "cpu" and dev.type == "cuda":
            host = host.pin_memory()
        summ = torch.zeros(P, H, 2, D, dtype=dtype, device=dev)
        codes = (empty_codes(P, H, p, D, dev) if byte_major else torch.empty(P, H, p, D // 4, dtype=torch.uint8,
                                                                               device=dev)).fill_(0xAB)
        fn(kc.to(dev), vc.to(dev), host, summ, src.to(dev), dst.to(dev), valid.to(dev), p, codes=codes)
        outs.append(codes.cpu())
    ref, out = outs
    assert torch.equal(ref, out)
    assert (out[[0, 3, 5, 6]] == 0xAB).all() and (out[2, :, 7:] == 0xAB).all()  # the partial page's missing rows
    lo, hi = kc[: p].float().amin(0), kc[: p].float().amax(0)
    assert torch.equal(out[4], quantize_keys(kc[: p].float().transpose(0, 1), lo, hi))


# The chunked 1500-page row in one phase only (either phase selects the same way; it interprets for ~35 s on CPU).
@pytest.mark.parametrize("M,num,phase", [(M, num, phase) for M, num in [(37, 8), (300, 64), (1500, 256), (20, 32)]
                                         for phase in (PHASE_NOW, PHASE_LATER) if M < 1500 or phase == PHASE_LATER])
def test_top_pages_matches_reference(M, num, phase):
    """Best first, ties by the lower page (duplicated scores), -1 for -inf and past the row (num > M); rows of
    heads outside the phase unwritten; 1500 pages take a chunked first stage."""
    torch.manual_seed(2)
    H = 3
    scores = torch.randn(B, H, M).round(decimals=1)  # ties
    scores[0, 0, 5:] = float("-inf")
    scores[1, 2] = float("-inf")
    heads = torch.rand(B, H) < 0.5
    with poisoned_outputs():
        out = top_pages(scores.to(DEV), num, heads.to(DEV), phase).cpu()
    ref = naive_top_pages(scores, num, heads, phase)
    mine = heads == (phase == PHASE_NOW)
    assert torch.equal(out[mine], ref[mine])
    assert (out[~mine] < -(2**29)).all()  # poison left in place


def rerank_inputs(G, p, D, M, H, dtype):
    P = M + 9
    keys = torch.randn(P, H, p, D)
    summaries = torch.stack([keys.amin(2), keys.amax(2)], 2).to(dtype)
    codes = empty_codes(P, H, p, D)
    codes.copy_(quantize_keys(keys, summaries[:, :, 0], summaries[:, :, 1]))
    q = torch.randn(R, H * G, D).to(dtype)
    page_table = torch.stack([torch.randperm(P)[:M] for _ in range(R)]).to(torch.int32)
    req_slots = torch.randperm(R)[:B].to(torch.int32)
    cand = naive_top_pages(torch.randn(B, H, M), min(M, 12))
    cand[0, 0, 3:] = -1  # a short candidate list
    cand[1, -1] = -1  # none
    return q, summaries, codes, page_table, req_slots, cand


@pytest.mark.parametrize("G,p,D,M,H", [(1, 16, 64, 37, 2), (3, 32, 128, 50, 3), (4, 16, 128, 21, 2),
                                       (8, 32, 64, 40, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rerank_pages_matches_reference(G, p, D, M, H, dtype):
    torch.manual_seed(3)
    q, summ, codes, pt, rs, cand = rerank_inputs(G, p, D, M, H, dtype)
    ref = naive_rerank_pages(q[:B], summ, codes, pt, rs, cand, D ** -0.5)
    with poisoned_outputs():
        args = [t.to(DEV) for t in (q[:B], summ, codes, pt, rs, cand)]
        out = rerank_pages(*args, D ** -0.5).cpu()
    assert_close("scores", ref, out, atol=1e-5, rtol=1e-4)
    row = ref[2, 0]
    assert torch.isclose(row[row > float("-inf")].sum(), torch.tensor(1.0))  # group mean of softmaxes


@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
def test_rerank_pages_heads_of_a_phase(phase):
    """Only the phase's heads are written; PHASE_LATER reads q by request slot."""
    torch.manual_seed(4)
    G, p, D, M, H = 3, 16, 64, 30, 3
    q, summ, codes, pt, rs, cand = rerank_inputs(G, p, D, M, H, torch.float32)
    heads = torch.rand(B, H) < 0.5
    by_slot = phase == PHASE_LATER
    qq = q if by_slot else q[:B]
    ref = naive_rerank_pages(qq, summ, codes, pt, rs, cand, 0.125, heads, phase, by_slot)
    with poisoned_outputs():
        out = rerank_pages(*[t.to(DEV) for t in (qq, summ, codes, pt, rs, cand)], 0.125, heads.to(DEV), phase,
                           by_slot).cpu()
    mine = heads == (phase == PHASE_NOW)
    assert_close("scores", ref[mine], out[mine], atol=1e-5, rtol=1e-4)
    assert torch.isnan(out[~mine]).all()


def test_rerank_finds_the_needle_the_bound_misses():
    """A page whose one token aligns with q (a needle among noise) beats pages whose min / max bound is larger
    but whose tokens do not align: MeanS ranks by the bound, the codes see the token."""
    torch.manual_seed(5)
    H, G, p, D, M = 1, 2, 16, 64, 8
    q = torch.randn(1, G, D)
    keys = torch.randn(M, H, p, D) * 2.0  # noisy pages: wide ranges, large bounds
    keys[3] = torch.randn(p, D) * 0.5
    keys[3, 0, 7] = q[0].mean(0) * 1.5  # the needle, in a narrow page
    summ = torch.stack([keys.amin(2), keys.amax(2)], 2)
    codes = quantize_keys(keys, summ[:, :, 0], summ[:, :, 1])
    pt = torch.arange(M, dtype=torch.int32)[None]
    rs = torch.zeros(1, dtype=torch.int32)
    cand = torch.arange(M, dtype=torch.int32).view(1, 1, M)
    scores = rerank_pages(*[t.to(DEV) for t in (q, summ, codes, pt, rs, cand)], D ** -0.5).cpu()
    assert int(scores[0, 0].argmax()) == 3
    bound = torch.maximum(q[0][:, None] * summ[:, 0, 0], q[0][:, None] * summ[:, 0, 1]).sum(-1)
    assert int(torch.softmax(bound, -1).mean(0).argmax()) != 3


def full_scan_inputs(G, p, D, M, H, phase):
    """rerank_inputs in bf16 for a scan of every page from page 2 to cand_end: rows ending at M, at the start
    (none), one page past it and half way; a random head mask; q by request slot in PHASE_LATER."""
    q, summ, codes, pt, rs, _ = rerank_inputs(G, p, D, M, H, torch.bfloat16)
    start = 2
    cand_end = torch.tensor([M, start, start + 1, M // 2], dtype=torch.int32)
    heads = torch.rand(B, H) < 0.6
    by_slot = phase == PHASE_LATER
    return (q if by_slot else q[:B]), summ, codes, pt, rs, start, cand_end, heads, by_slot


@pytest.mark.parametrize("G,p,D,M,H", [(1, 16, 64, 37, 2), (4, 32, 128, 50, 3), (8, 16, 64, 21, 1)])
@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
def test_rerank_pages_full_scan_matches_reference(G, p, D, M, H, phase):
    """cand None: every page in [cand_start, cand_end[b]) -- all, none (end at or before the start), one, part."""
    torch.manual_seed(6)
    qq, summ, codes, pt, rs, start, cand_end, heads, by_slot = full_scan_inputs(G, p, D, M, H, phase)
    ref = naive_rerank_pages(qq, summ, codes, pt, rs, None, 0.125, heads, phase, by_slot, start, cand_end)
    with poisoned_outputs():
        out = rerank_pages(*[t.to(DEV) for t in (qq, summ, codes, pt, rs)], None, 0.125, heads.to(DEV), phase,
                           by_slot, start, cand_end.to(DEV)).cpu()
    mine = heads == (phase == PHASE_NOW)
    assert_close("scores", ref[mine], out[mine], atol=1e-5, rtol=1e-4)
    assert torch.isnan(out[~mine]).all()
    finite = torch.isfinite(ref[0, 0]) if mine[0, 0] else None
    if finite is not None:
        assert finite[start:].all() and not finite[:start].any()


@pytest.mark.parametrize("G,p,D,M,H,nbytes", [(1, 16, 64, 37, 2, 4), (3, 32, 128, 50, 3, 4), (4, 16, 128, 21, 2, 3),
                                              (8, 32, 64, 40, 1, 16), (8, 16, 128, 30, 2, 1)])
@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
def test_sketch_pages_matches_reference(G, p, D, M, H, nbytes, phase):
    """The first stage over every page in [cand_start, cand_end[b]) (all, none, one, part): the reference's scores,
    -inf before the start; rows of heads outside the phase unwritten; every code byte (nbytes = D / 4) too."""
    torch.manual_seed(7)
    qq, summ, codes, pt, rs, start, cand_end, heads, by_slot = full_scan_inputs(G, p, D, M, H, phase)
    ref = naive_sketch_pages(qq, summ, codes, pt, rs, 0.125, nbytes, heads, phase, by_slot, start, cand_end)
    with poisoned_outputs():
        out = sketch_pages(*[t.to(DEV) for t in (qq, summ, codes, pt, rs)], 0.125, nbytes, heads.to(DEV), phase,
                           by_slot, start, cand_end.to(DEV)).cpu()
    mine = heads == (phase == PHASE_NOW)
    assert_close("scores", ref[mine], out[mine], atol=1e-5, rtol=1e-4)
    assert torch.isnan(out[~mine]).all()
    if mine[0, 0]:
        finite = torch.isfinite(out[0, 0])
        assert finite[start:].all() and not finite[:start].any()
        assert torch.isclose(out[0, 0, start:].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("G,p,D,nbytes", [(3, 16, 64, 4), (4, 32, 128, 8)])
def test_sketch_pages_summary_dtypes(dtype, G, p, D, nbytes):
    """fp16 and fp32 page summaries (the kernel reads a bf16 one's four values of a byte with shifts, an fp16 one's
    through a conversion, an fp32 one's one by one): the reference's scores."""
    torch.manual_seed(8)
    qq, summ, codes, pt, rs, start, cand_end, heads, by_slot = full_scan_inputs(G, p, D, 29, 2, PHASE_NOW)
    summ = summ.to(dtype)
    ref = naive_sketch_pages(qq, summ, codes, pt, rs, 0.125, nbytes, heads, PHASE_NOW, by_slot, start, cand_end)
    with poisoned_outputs():
        out = sketch_pages(*[t.to(DEV) for t in (qq, summ, codes, pt, rs)], 0.125, nbytes, heads.to(DEV), PHASE_NOW,
                           by_slot, start, cand_end.to(DEV)).cpu()
    assert_close("scores", ref[heads], out[heads], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("G,p,D,M,H,nbytes", [(1, 16, 64, 37, 2, 4), (3, 32, 128, 50, 3, 4), (8, 16, 128, 30, 2, 1)])
@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
def test_sketch_pages_with_picks_by_slot(G, p, D, M, H, nbytes, phase):
    """Picks computed once by request slot (as query_similarity writes them for both phases) give the reference's
    scores; the reference refuses picks of another query."""
    torch.manual_seed(9)
    qq, summ, codes, pt, rs, start, cand_end, heads, by_slot = full_scan_inputs(G, p, D, M, H, phase)
    gp = 1 << (G - 1).bit_length()
    sel = torch.full((R, H, nbytes), -1, dtype=torch.int32)
    qp = torch.full((R, H, 4 * nbytes, gp), float("nan"))
    got = naive_sketch_picks(qq[rs.long()] if by_slot else qq, G, nbytes, 0.125)
    sel[rs.long()], qp[rs.long()] = got
    ref = naive_sketch_pages(qq, summ, codes, pt, rs, 0.125, nbytes, heads, phase, by_slot, start, cand_end)
    assert torch.equal(ref.nan_to_num(), naive_sketch_pages(qq, summ, codes, pt, rs, 0.125, nbytes, heads, phase,
                                                            by_slot, start, cand_end, (sel, qp)).nan_to_num())
    with poisoned_outputs():
        out = sketch_pages(*[t.to(DEV) for t in (qq, summ, codes, pt, rs)], 0.125, nbytes, heads.to(DEV), phase,
                           by_slot, start, cand_end.to(DEV), (sel.to(DEV), qp.to(DEV))).cpu()
    mine = heads == (phase == PHASE_NOW)
    assert_close("scores", ref[mine], out[mine], atol=1e-5, rtol=1e-4)
    assert torch.isnan(out[~mine]).all()
    wrong = qp.clone()
    wrong[rs.long()] *= 2
    with pytest.raises(ValueError, match="picks"):
        naive_sketch_pages(qq, summ, codes, pt, rs, 0.125, nbytes, heads, phase, by_slot, start, cand_end,
                           (sel, wrong))


def test_sketch_reads_the_bytes_the_query_weighs():
    """sketch_bytes: the group's largest |q| byte sums, largest first, ties by the lower byte; a page's codes count
    on those channels only (changing any other code byte leaves the sketch unchanged, the others count at the
    mid-range), and all D / 4 bytes give the rerank's full-scan scores up to the fp16 rounding of its tensor-core
    product."""
    q = torch.zeros(1, 2, 16)
    q[0, 0, 9], q[0, 1, 2], q[0, 0, 13], q[0, 1, 12] = 3.0, -2.0, 1.0, 1.0  # bytes: 2 -> 3, 0 -> 2, 3 -> 2
    assert sketch_bytes(q, 3).tolist() == [[2, 0, 3]]
    torch.manual_seed(8)
    G, p, D, M, H = 4, 16, 64, 24, 2
    q, summ, codes, pt, rs, _ = rerank_inputs(G, p, D, M, H, torch.float32)
    cand_end = torch.full((B,), M, dtype=torch.int32)
    args = lambda c: [t.to(DEV) for t in (q[:B], summ, c, pt, rs)]  # noqa: E731
    base = sketch_pages(*args(codes), 0.125, 2, cand_start=1, cand_end=cand_end.to(DEV)).cpu()
    sel = sketch_bytes(q[:B][0].view(H, G, D), 2)[0]  # row 0, head 0
    other = torch.ones(D // 4, dtype=torch.bool)
    other[sel] = False
    flipped = codes.clone()
    flipped[..., other] ^= 0x55
    moved = sketch_pages(*args(flipped), 0.125, 2, cand_start=1, cand_end=cand_end.to(DEV)).cpu()
    assert torch.equal(base[0, 0], moved[0, 0]) and not torch.equal(base, moved)
    full = sketch_pages(*args(codes), 0.125, D // 4, cand_start=1, cand_end=cand_end.to(DEV)).cpu()
    rer = rerank_pages(*args(codes), None, 0.125, cand_start=1, cand_end=cand_end.to(DEV)).cpu()
    assert_close("scores", rer, full, atol=1e-3, rtol=1e-2)
