"""fp8_linear against its torch reference, and both against bf16/fp32 x @ W^T within e4m3's rounding."""

import pytest
import torch

from freekv_kernels.fp8_linear import fp8_linear, naive_fp8_linear
from freekv_kernels.fp8_linear.triton import TILES, Tiles
from freekv_kernels.fp8_rows import naive_quantize_rows
from freekv_kernels.testing import assert_close, device, poisoned_outputs, run_without_interpreter

DEV = device()


def case(m, n, k, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    # rows of unequal magnitude: each row's own exponent matters
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-6, 4, (n, 1), generator=gen).float())
    q, e = naive_quantize_rows(w)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    t = lambda v: None if v is None else v.to(DEV)  # noqa: E731
    return t(x), t(q), t(e), t(b), w


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 100, 200), (16, 32, 512), (37, 17, 1030)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tiles", [TILES, Tiles(bn=32, bk=128, gemv_bn=8, gemv_bk=128, gemv_rows=4),
                                   Tiles(gemv_rows=0), Tiles(gemv_rows=64, gemv_bn=8, gemv_bk=32)],
                         ids=["served", "small", "no-gemv", "all-gemv"])
def test_matches_reference(m, n, k, dtype, bias, tiles):
    """Odd shapes (M and N off the tiles, K past one tile and off it), every row its own exponent; both paths (the
    CUDA-core one for one row, up to 4 with "small", every M with "all-gemv"; the dot for every M with "no-gemv")."""
    x, q, e, b, w = case(m, n, k, dtype, bias, seed=m * n + k)
    with poisoned_outputs():
        y = fp8_linear(x, q, e, b, tiles=tiles)
    ref = naive_fp8_linear(x, q, e, b)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert_close("fp8_linear", ref, y, atol=tol * ref.abs().max().item(), rtol=tol)
    # e4m3 keeps 3 mantissa bits: the product stays within a few percent of the unquantized one
    exact = x.float() @ w.to(DEV).T + (0 if b is None else b.float())
    assert (ref.float() - exact).norm() <= 0.05 * exact.norm()


@pytest.mark.parametrize("tiles", [Tiles(gemv_rows=8, gemv_bk=128), Tiles(gemv_rows=0)], ids=["gemv", "dot"])
def test_strided_rows_of_x(tiles):
    """x as rows of a wider buffer (the early lane's normed residual may be a view): read through its row stride."""
    x, q, e, b, _ = case(5, 40, 300, torch.bfloat16, True, seed=7)
    wide = torch.full((x.shape[0], 320), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, 10:310] = x
    with poisoned_outputs():
        y = fp8_linear(wide[:, 10:310], q, e, b, tiles=tiles)
    ref = naive_fp8_linear(x, q, e, b)
    assert_close("fp8_linear strided", ref, y, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def test_bad_inputs():
    x, q, e, b, w = case(2, 16, 32, torch.bfloat16, True, seed=0)
    with pytest.raises(ValueError, match="w must be"):
        fp8_linear(x, w.to(DEV).to(torch.bfloat16), e)
    with pytest.raises(ValueError, match="one int8 or int32 exponent"):
        fp8_linear(x, q, e[:-1])
    with pytest.raises(ValueError, match="x must be"):
        fp8_linear(x[:, :-1], q, e)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, q, e, b[:-1])
    with pytest.raises(ValueError, match="contiguous"):
        fp8_linear(x, q, e.repeat_interleave(2)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        fp8_linear(x, q, e, b.repeat_interleave(2)[::2])
    with pytest.raises(ValueError, match="power of two"):
        Tiles(gemv_bk=96)
    with pytest.raises(ValueError, match=">= 16"):
        Tiles(bn=8)
    with pytest.raises(ValueError, match="16384"):
        Tiles(gemv_rows=4)  # 4 x 16 x 512 products
    with pytest.raises(ValueError, match="gemv_rows"):
        Tiles(gemv_rows=-1)


CHILD = r'''
from freekv_kernels.fp8_linear import triton as m
from freekv_kernels.testing import compile_sm90
types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "e_ptr": "*i8", "b_ptr": "*i8", "y_ptr": "*bf16"}
ptx = compile_sm90(m._fp8_linear_kernel, {"BM": 16, "BN": 16, "BK": 512, "STAGES": 3, "HAS_BIAS": False,
                   "DOT_F32": False, "GEMV": False}, types, 4)
assert "mma" in ptx and "cvt" in ptx
ptx = compile_sm90(m._fp8_linear_kernel, {"BM": 1, "BN": 16, "BK": 512, "STAGES": 3, "HAS_BIAS": False,
                   "DOT_F32": False, "GEMV": True}, types, 4)
assert "mma" not in ptx and "cvt" in ptx
ptx = compile_sm90(m._fp8_linear_kernel, {"BM": 4, "BN": 16, "BK": 128, "STAGES": 3, "HAS_BIAS": True,
                   "DOT_F32": False, "GEMV": True}, {**types, "b_ptr": "*bf16"}, 4)
assert "mma" not in ptx
print("compiled")
'''


def test_kernel_compiles_for_sm90():
    """The e4m3 rows widened for tensor-core dots (the interpreter takes the fp32 path), and for the CUDA-core path
    at one row and at four, compile for an H100."""
    assert run_without_interpreter(CHILD) == ["compiled"]
