"""The channel sketch: calibration, 4-bit codes with fixed steps, and the page scores against the torch reference."""

import pytest
import torch
import triton
import triton.language as tl
from freekv_kernels.channel_sketch import (
    calibrate_channels,
    channel_sketch_pages,
    decode_channels,
    naive_channel_sketch_pages,
    quantize_channels,
)
from freekv_kernels.channel_sketch.triton import _log2_sum
from freekv_kernels.offload import naive_offload_pages, offload_pages
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW
from freekv_kernels.testing import assert_close, device, poisoned_outputs

DEV = device()
B, SLOTS = 4, 6


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, ..., D] at positions [N] (base 10000)."""
    D = x.shape[-1]
    theta = positions.float()[:, None] * 10000.0 ** (-torch.arange(D // 2).float() / (D // 2))  # [N, D / 2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (D // 2,)
    cos, sin = theta.cos().view(shape), theta.sin().view(shape)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def test_calibration_picks_the_channels_the_query_weighs_on_spread_keys():
    """Channels ranked by the group's mean query pair norm x the keys' rms pair norm (channel i pairs with i + D/2),
    best first; each channel's range [-r, r], r its pair's largest key norm; a pair of constant zeros gets step 0;
    widths other than multiples of 32 up to D are refused."""
    torch.manual_seed(0)
    H, G, D = 2, 3, 64
    keys = torch.randn(200, H, D) * 0.1
    keys[:, 0, 5] *= 40.0  # wide, and weighed by the query: channels 5 and 37 (its pair) lead
    keys[:, 1, 9] = keys[:, 1, 41] = 0.0  # a zero pair
    q = torch.ones(7, H, G, D)
    q[..., 0, 5] = 3.0
    q[..., 1, 9] = 50.0
    cal = calibrate_channels(q, keys, 32)
    assert cal.channels.shape == (H, 32) and cal.channels.dtype == torch.int32
    assert set(cal.channels[0, :2].tolist()) == {5, 37}
    assert 9 not in cal.channels[1].tolist() and 41 not in cal.channels[1].tolist()  # no spread: worth nothing
    r = (keys[..., :32].square() + keys[..., 32:].square()).sqrt().amax(0)  # [H, D / 2]
    want_hi = r.repeat(1, 2).gather(1, cal.channels.long())
    torch.testing.assert_close(cal.lo, -want_hi)
    torch.testing.assert_close(cal.step * 16, 2 * want_hi)
    full = calibrate_channels(q, keys, 64)
    at = (full.channels[1] == 9).nonzero()[0, 0]
    assert full.step[1, at] == 0 and full.inv_step[1, at] == 0
    for bad in (16, 48, 96):
        with pytest.raises(ValueError, match="multiple of 32"):
            calibrate_channels(q, keys, bad)


def test_calibration_is_the_same_at_any_position():
    """The same pre-RoPE keys and queries rotated to positions 0.. and 20000..: the same channels and ranges, and
    every key at the far positions inside its channel's range (a calibration text shorter than the context)."""
    torch.manual_seed(6)
    H, G, D, N = 2, 4, 128, 400
    k0 = torch.randn(N, H, D) + torch.linspace(-2, 2, D)  # channel means, as real keys have
    q0 = torch.randn(N, H, G, D)
    near, far = torch.arange(N), torch.arange(N) + 20000
    a = calibrate_channels(rope(q0, near), rope(k0, near), 32)
    b = calibrate_channels(rope(q0, far), rope(k0, far), 32)
    assert torch.equal(a.channels, b.channels)
    torch.testing.assert_close(a.lo, b.lo)
    kf = rope(k0, far).gather(2, a.channels.long()[None].expand(N, -1, -1))
    assert ((kf >= a.lo - 1e-4) & (kf <= -a.lo + 1e-4)).all()


def test_codes_are_the_fixed_bins_packed_by_nibble():
    """Bin clamp(floor((k - lo) * 16 / (hi - lo)), 0, 15): channel r of the list in byte r's low nibble (r < R / 2)
    or byte r - R / 2's high nibble; keys outside the calibration range clamp; decoding at the bin centre lands within
    half a step inside the range."""
    torch.manual_seed(1)
    H, D, R = 3, 128, 32
    cal = calibrate_channels(torch.randn(5, H, 2, D), torch.randn(300, H, D), R)
    k = torch.randn(40, H, D) * 1.5  # partly outside the range
    codes = quantize_channels(k, cal.channels, cal.lo, cal.inv_step)
    assert codes.shape == (40, H, R // 2) and codes.dtype == torch.uint8
    picked = k.gather(2, cal.channels.long()[None].expand(40, -1, -1))
    want = ((picked - cal.lo) / cal.step).floor().clamp(0, 15)
    got = decode_channels(codes)
    assert (got != want).float().mean() < 1e-3  # division vs multiplication by the inverse: bin edges only
    assert torch.equal(got[..., 3], (codes[..., 3] & 15).float())
    assert torch.equal(got[..., R // 2 + 3], (codes[..., 3] >> 4).float())
    inside = (picked >= cal.lo) & (picked < cal.lo + 16 * cal.step)
    err = (cal.lo + (got + 0.5) * cal.step - picked).abs()
    assert (err[inside] <= cal.step.expand_as(err)[inside] * 0.5 + 1e-5).all()


def channel_inputs(G, p, D, R, M, H, phase, dtype=torch.bfloat16):
    """Random keys in host pages (a shuffled page table per slot), codes from a calibration on other keys, queries
    per row or per slot; rows ending at M, at the start (none), one page past it and half way; a random head mask."""
    P = M * SLOTS
    keys = torch.randn(P, H, p, D).to(dtype)
    cal = calibrate_channels(torch.randn(9, H, G, D), torch.randn(500, H, D), R)
    codes = quantize_channels(keys.transpose(1, 2), cal.channels, cal.lo, cal.inv_step).transpose(1, 2).contiguous()
    pt = torch.randperm(P, dtype=torch.int32)[: SLOTS * M].view(SLOTS, M)
    rs = torch.tensor([4, 0, 5, 2], dtype=torch.int32)
    by_slot = phase == PHASE_LATER
    q = torch.randn(SLOTS if by_slot else B, H * G, D).to(dtype)
    start = 2
    cand_end = torch.tensor([M, start, start + 1, M // 2], dtype=torch.int32)
    heads = torch.rand(B, H) < 0.6
    return q, codes, cal, pt, rs, start, cand_end, heads, by_slot


@pytest.mark.parametrize("G,p,D,R,M,H", [(1, 16, 64, 32, 37, 2), (3, 32, 128, 32, 50, 3), (4, 16, 128, 64, 21, 2),
                                         (8, 32, 64, 64, 40, 1), (4, 32, 128, 128, 33, 2)])
@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
def test_channel_sketch_pages_matches_reference(G, p, D, R, M, H, phase):
    """Every page in [cand_start, cand_end[b]) (all, none, one, part): the reference's scores, -inf before the start
    and past the end, a distribution over the row's pages; rows of heads outside the phase unwritten."""
    torch.manual_seed(2)
    q, codes, cal, pt, rs, start, cand_end, heads, by_slot = channel_inputs(G, p, D, R, M, H, phase)
    ref = naive_channel_sketch_pages(q, codes, cal.channels, cal.step, pt, rs, 0.125, heads, phase, by_slot, start,
                                     cand_end)
    with poisoned_outputs():
        out = channel_sketch_pages(*[t.to(DEV) for t in (q, codes, cal.channels, cal.step, pt, rs)], 0.125,
                                   heads.to(DEV), phase, by_slot, start, cand_end.to(DEV)).cpu()
    mine = heads == (phase == PHASE_NOW)
    assert_close("scores", ref[mine], out[mine], atol=1e-5, rtol=1e-4)
    assert torch.isnan(out[~mine]).all()
    for b in range(B):
        for h in range(H):
            if not mine[b, h]:
                continue
            end = min(int(cand_end[b]), M)
            finite = torch.isfinite(out[b, h])
            assert finite[start:end].all() and not finite[:start].any() and not finite[end:].any()
            if end > start:
                assert torch.isclose(out[b, h, start:end].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("G,p,M,H,programs", [(3, 16, 150, 2, 1), (8, 32, 100, 1, 3), (4, 16, 150, 3, 10_000)])
@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
def test_strided_programs_score_what_one_program_per_item_scores(G, p, M, H, programs, phase):
    """A 1-D grid of `programs` striding over the (row, head, chunk of pages) items (fewer programs than items, or
    more: then one per item) writes the very scores of the grid with a program per item, and the reference's."""
    torch.manual_seed(4)
    q, codes, cal, pt, rs, start, cand_end, heads, by_slot = channel_inputs(G, p, 64, 32, M, H, phase)
    args = [t.to(DEV) for t in (q, codes, cal.channels, cal.step, pt, rs)]
    ref = naive_channel_sketch_pages(q, codes, cal.channels, cal.step, pt, rs, 0.125, heads, phase, by_slot, start,
                                     cand_end, programs=programs)
    with poisoned_outputs():
        per_item = channel_sketch_pages(*args, 0.125, heads.to(DEV), phase, by_slot, start, cand_end.to(DEV)).cpu()
    with poisoned_outputs():
        strided = channel_sketch_pages(*args, 0.125, heads.to(DEV), phase, by_slot, start, cand_end.to(DEV),
                                       programs=programs).cpu()
    assert torch.equal(strided.isnan(), per_item.isnan())
    mine = heads == (phase == PHASE_NOW)
    assert torch.equal(strided[mine], per_item[mine])
    assert_close("scores", ref[mine], strided[mine], atol=1e-5, rtol=1e-4)


def test_channel_sketch_pages_without_head_mask():
    """heads None: every row and KV head scores."""
    torch.manual_seed(3)
    q, codes, cal, pt, rs, start, cand_end, _, _ = channel_inputs(4, 32, 128, 32, 24, 2, PHASE_NOW)
    ref = naive_channel_sketch_pages(q, codes, cal.channels, cal.step, pt, rs, 0.09, None, PHASE_NOW, False, start,
                                     cand_end)
    with poisoned_outputs():
        out = channel_sketch_pages(*[t.to(DEV) for t in (q, codes, cal.channels, cal.step, pt, rs)], 0.09,
                                   cand_start=start, cand_end=cand_end.to(DEV)).cpu()
    assert_close("scores", ref, out, atol=1e-5, rtol=1e-4)


def test_scores_are_the_attention_mass_of_the_decoded_keys():
    """The reference leaves out each query head's constant q . (lo + step / 2): its scores are the group mean of the
    softmax over pages of the page log-sum-exps of q . k~, k~ the bin centres on the calibrated channels and zero
    elsewhere (up to the fp16 rounding of the weights)."""
    torch.manual_seed(4)
    H, G, D, p, R, n = 2, 4, 128, 32, 32, 12
    keys = torch.randn(n, H, p, D)
    cal = calibrate_channels(torch.randn(3, H, G, D), keys.transpose(1, 2).flatten(0, 1), R)
    codes = quantize_channels(keys.transpose(1, 2), cal.channels, cal.lo, cal.inv_step).transpose(1, 2)
    q = torch.randn(1, H * G, D)
    scores = naive_channel_sketch_pages(q, codes, cal.channels, cal.step, torch.arange(n, dtype=torch.int32)[None],
                                        torch.zeros(1, dtype=torch.int32), D ** -0.5, cand_end=torch.tensor([n]))
    centres = cal.lo[:, None] + (decode_channels(codes) + 0.5) * cal.step[:, None]  # [n, H, p, R]
    dec = torch.zeros(n, H, p, D).scatter_(3, cal.channels.long()[None, :, None].expand(n, H, p, R), centres)
    logits = D ** -0.5 * torch.einsum("hgd,nhtd->hgnt", q[0].view(H, G, D), dec)
    want = torch.softmax(torch.logsumexp(logits, -1), -1).mean(1)
    torch.testing.assert_close(scores[0], want, atol=2e-3, rtol=1e-2)
    assert torch.equal(scores[0].argmax(-1), want.argmax(-1))


def test_channel_sketch_pages_refuses_bad_shapes():
    q, codes, cal, pt, rs, start, cand_end, _, _ = channel_inputs(4, 16, 64, 32, 8, 1, PHASE_NOW)
    args = [t.to(DEV) for t in (q, codes, cal.channels, cal.step, pt, rs)]
    with pytest.raises(AssertionError):
        channel_sketch_pages(args[0], args[1][..., :8], *args[2:], 0.1, cand_start=start, cand_end=cand_end.to(DEV))
    with pytest.raises(AssertionError):
        channel_sketch_pages(*args[:3], args[3].double(), *args[4:], 0.1, cand_start=start,
                             cand_end=cand_end.to(DEV))


@pytest.mark.parametrize("H,D,p,R", [(1, 64, 16, 32), (3, 128, 32, 64), (8, 64, 32, 32), (2, 128, 16, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offload_writes_the_channel_codes(H, D, p, R, dtype):
    """offload_pages with a calibration's channels: every valid page's codes (a partial last page's existing rows
    only), equal to the reference's (naive_write_channel_codes) and to quantize_channels of the page's keys; other
    host pages and rows untouched; the pages and summaries as without codes."""
    torch.manual_seed(5)
    T = 5 * p + 7
    kc = (torch.randn(T, H, D) * 1.3).to(dtype)  # partly outside the calibration range
    vc = torch.randn(T, H, D).to(dtype)
    cal = calibrate_channels(torch.randn(4, H, 2, D), torch.randn(300, H, D), R)
    src = torch.tensor([0, 3, 5, 2], dtype=torch.int32)
    dst = torch.tensor([4, 1, 2, 6], dtype=torch.int32)
    valid = torch.tensor([True, True, True, False])
    outs = []
    for fn, dev in ((naive_offload_pages, "cpu"), (offload_pages, DEV)):
        codes = torch.full((7, H, p, R // 2), 0xAB, dtype=torch.uint8, device=dev)
        host = torch.zeros(7, H, 2, p, D, dtype=dtype)
        if dev != "cpu" and dev.type == "cuda":
            host = host.pin_memory()
        summ = torch.zeros(7, H, 2, D, dtype=dtype, device=dev)
        fn(kc.to(dev), vc.to(dev), host, summ, src.to(dev), dst.to(dev), valid.to(dev), p, codes=codes,
           channels=tuple(t.to(dev) for t in (cal.channels, cal.lo, cal.inv_step)))
        outs.append((codes.cpu(), host.cpu(), summ.cpu()))
    (ref, ref_host, ref_summ), (out, out_host, out_summ) = outs
    assert torch.equal(ref, out) and torch.equal(ref_host, out_host) and torch.equal(ref_summ, out_summ)
    assert (out[[0, 3, 5, 6]] == 0xAB).all() and (out[2, :, 7:] == 0xAB).all()  # the partial page's missing rows
    want = quantize_channels(kc[:p], cal.channels, cal.lo, cal.inv_step).transpose(0, 1)
    assert torch.equal(out[4], want)
    assert torch.equal(out_host[4, :, 0], kc[:p].transpose(0, 1))


@triton.jit
def _log2_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _log2_sum(tl.load(x_ptr + i, mask=i < n, other=1.0)), mask=i < n)


def test_log2_sum_matches_log2_over_a_page_of_exponentials():
    """The sketch's log2 of a page's sum of exponentials (largest 1, so in [1, PAGE]) within 1e-6 of torch's over
    [1, 64] (its polynomial's 4e-7 and the fp32 rounding of exponent plus polynomial), at random values and powers of
    two; a NaN stays NaN."""
    torch.manual_seed(11)
    x = torch.cat([torch.rand(3001) * 63 + 1, 2.0 ** torch.arange(7.0), torch.tensor([1.0, 1.5, 31.999, 32.0])])
    out = torch.full_like(x, float("nan"), device=DEV)
    _log2_sum_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEV), out, x.numel(), BLOCK=1024)
    assert_close("log2", x.double().log2().float(), out.cpu(), atol=1e-6, rtol=0)
    nan = torch.tensor([float("nan"), 2.0], device=DEV)
    _log2_sum_kernel[(1,)](nan, nan, 2, BLOCK=2)
    assert nan[0].isnan() and nan[1].item() == pytest.approx(1.0, abs=1e-6)
