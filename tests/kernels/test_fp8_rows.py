"""The FP8 row codec of host pages: the Triton kernels against the torch reference bit for bit (e4m3 bytes, int8
exponents, the widened values), on rows that reach every corner of e4m3 (subnormals, ties, carries into the next
binade, the largest finite value, zeros, signed zeros) and scales far from 1; and what the reference promises."""

import pytest
import torch

from freekv_kernels.fp8_rows import (FP8_DTYPE, dequantize_rows, naive_dequantize_rows, naive_quantize_rows,
                                     quantize_rows)
from freekv_kernels.testing import device, run_without_interpreter

DEV = device()


def rows(n, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g) * torch.logspace(-30, 30, n, base=2.0)[:, None]
    x[0] = 0.0
    x[1] = -0.0
    x[2] = 1e-40  # below the least scale's reach: stored as zeros
    # e4m3 values, ties between neighbours and values that round up into the next binade, at scale 1 (448 sets it)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].abs().unique()
    ties = (grid[1:] + grid[:-1]) / 2
    special = torch.cat([grid, ties, ties - ties * 2**-12, ties + ties * 2**-12, torch.tensor([127.2, 0.00097])])
    special = special[special <= 448]
    for i in range(3, n):
        if i % 4 == 3:
            pick = torch.randint(0, special.numel(), (D,), generator=g)
            x[i] = special[pick] * torch.where(torch.rand(D, generator=g) < 0.5, -1.0, 1.0)
            x[i, 0] = 448.0 * (1 - 2 * (i % 8 == 3))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,D", [(5, 16), (37, 64), (130, 80), (64, 128)])
def test_quantize_and_dequantize_match_the_reference_bit_for_bit(n, D, dtype):
    x = rows(n, D, dtype, seed=n * 1000 + D).to(DEV)
    q_ref, e_ref = naive_quantize_rows(x.cpu())
    q = torch.full((n, D), float("nan"), dtype=FP8_DTYPE, device=DEV)
    e = torch.full((n,), -128, dtype=torch.int8, device=DEV)
    quantize_rows(x, q, e)
    bad = (q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} of {q.numel()} e4m3 bytes differ"
    assert torch.equal(e.cpu(), e_ref)
    out = torch.full((n, D), float("nan"), dtype=dtype, device=DEV)
    dequantize_rows(q, e, out)
    ref = naive_dequantize_rows(q_ref, e_ref, dtype)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))


def test_the_reference_rounds_to_nearest_within_e4m3_precision():
    x = rows(200, 64, torch.float32, seed=3)
    q, e = naive_quantize_rows(x)
    y = naive_dequantize_rows(q, e, torch.float32)
    amax = x.abs().amax(-1)
    scale = torch.ldexp(torch.ones(200), e.float())
    assert ((amax / scale <= 448) & ((amax == 0) | (amax / scale > 224) | (e == -120))).all(), "not the least scale"
    # Normal e4m3 numbers: a relative error of at most 2**-4; below them the subnormals' quantum 2**-9 (times scale).
    err = (y - x).abs()
    assert (err <= torch.maximum(x.abs() * 2**-4, 2**-10 * scale[:, None])).all()
    assert torch.equal(y[1].view(torch.int32), x[1].view(torch.int32)), "a negative zero stays one"
    assert (y[2] == 0).all() and e[2] == -120


@pytest.mark.parametrize("bad", ["q_dtype", "e_shape", "out_shape"])
def test_disagreeing_outputs_are_refused(bad):
    x = torch.randn(4, 32, device=DEV)
    q = torch.empty(4, 32, dtype=torch.bfloat16 if bad == "q_dtype" else FP8_DTYPE, device=DEV)
    e = torch.empty(5 if bad == "e_shape" else 4, dtype=torch.int8, device=DEV)
    with pytest.raises(ValueError):
        if bad == "out_shape":
            dequantize_rows(q, e, torch.empty(4, 16, device=DEV))
        else:
            quantize_rows(x, q, e)


def test_the_codec_compiles_for_sm90_with_an_exact_cast():
    """The float32 rounding survives compilation for sm_90 (no reassociation folds (a + c) - c into a: ptxas sees
    a + 1.5 * 2**k and then - 1.5 * 2**k, both exact fused multiply-adds) and the cast to e4m3 is the hardware's."""
    child = r'''
from freekv_kernels.fp8_rows import triton as fp8
from freekv_kernels.testing import compile_sm90
ptx = compile_sm90(fp8._quantize_rows_kernel, {"BLOCK_R": 16, "BLOCK_D": 128},
                   {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "e_ptr": "*i8"}, 4)
adds = "0f3FC00000" in ptx and "0fBFC00000" in ptx or "sub.f32" in ptx or "sub.rn.f32" in ptx
print("cvt" if "e4m3x2.f32" in ptx else "no-cvt", "round" if adds else "folded")
'''
    assert run_without_interpreter(child) == ["cvt", "round"]
