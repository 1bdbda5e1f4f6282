"""Torch reference for FP8 host pages: each row of D values (one token of one KV head, K or V) is stored as e4m3
values times a power-of-two scale 2**e, e one int8 per row.

A power of two makes both directions exact but the one rounding to e4m3 (round to nearest even): x * 2**-e and
q * 2**e change only the exponent, and an e4m3 value widened to bf16 or fp32 is exact. So the Triton kernels, the
interpreter and this reference agree bit for bit. e is the smallest exponent that puts the row's largest magnitude
at or below e4m3's largest finite value (448): the row keeps e4m3's full 3-bit mantissa, relative error <= 2**-4.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # 1.75 * 2**8, e4m3fn's largest finite value
# Scales clamped to 2**[-120, 120], so 2**-e is a normal float32 built from its bits: a row whose largest magnitude is
# below 2**-112 keeps fewer bits (values below 2**-130 become zeros); one above 2**128 cannot occur in bf16 or fp32.
EXP_MIN, EXP_MAX = -120, 120


def row_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 e per row with amax * 2**-e <= 448 and e the smallest such (amax >= 0, float32)."""
    m, E = torch.frexp(amax)  # amax = m * 2**E, m in [0.5, 1)
    e = (E - 1) - 8 + (m > 0.875).to(torch.int32)  # (2m) * 2**(E-1) <= 1.75 * 2**8
    e = torch.where(amax > 0, e, EXP_MIN)
    return e.clamp(EXP_MIN, EXP_MAX)


def naive_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] e4m3, e [...] int8) with x ~= q * 2**e per row."""
    xf = x.float()
    e = row_exponents(xf.abs().amax(dim=-1))
    q = torch.ldexp(xf, (-e).unsqueeze(-1).float()).to(FP8_DTYPE)
    return q, e.to(torch.int8)


def naive_dequantize_rows(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] e4m3, e [...] int8 -> q * 2**e in dtype (exact for bf16, fp16 within range, fp32)."""
    return torch.ldexp(q.float(), e.float().unsqueeze(-1)).to(dtype)


def check_host_scales(host_layer: torch.Tensor, host_scales: torch.Tensor | None) -> bool:
    """Whether host_layer [N, H, 2, p, D] is an FP8 arena layer; its exponents host_scales [N, H, 2, p] int8 must come
    with it, and only with it."""
    if host_layer.dtype != FP8_DTYPE:
        if host_scales is not None:
            raise ValueError(f"host_scales belong to an FP8 arena; this one is {host_layer.dtype}")
        return False
    if host_scales is None or host_scales.dtype != torch.int8 or host_scales.shape != host_layer.shape[:-1]:
        got = None if host_scales is None else (tuple(host_scales.shape), host_scales.dtype)
        raise ValueError(f"an FP8 arena layer {tuple(host_layer.shape)} needs its row exponents host_scales "
                         f"{tuple(host_layer.shape[:-1])} int8, got {got}")
    return True


def host_rows(host_layer: torch.Tensor, host_scales: torch.Tensor | None, index, dtype: torch.dtype) -> torch.Tensor:
    """host_layer[index] widened to dtype: dequantised with its exponents for an FP8 arena."""
    if host_scales is None:
        return host_layer[index].to(dtype)
    return naive_dequantize_rows(host_layer[index], host_scales[index], dtype)


def store_host_rows(host_layer: torch.Tensor, host_scales: torch.Tensor | None, index, x: torch.Tensor) -> None:
    """host_layer[index] = x, quantised with its exponents into an FP8 arena."""
    if host_scales is None:
        host_layer[index] = x.to(host_layer.device, host_layer.dtype)
        return
    q, e = naive_quantize_rows(x)
    host_layer[index] = q.to(host_layer.device)
    host_scales[index] = e.to(host_scales.device)
