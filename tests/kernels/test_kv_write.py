"""write_kv against its torch reference: row loc[b] of each cache gets row b's new K/V, nothing else is written."""

import pytest
import torch
from freekv_kernels.kv_write import naive_write_kv, write_kv
from freekv_kernels.testing import assert_close, device

DEV = device()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,H,D", [(1, 1, 64), (3, 3, 128), (5, 8, 64), (2, 2, 16)])
def test_write_kv(B, H, D, dtype):
    T = 4 * B + 3
    loc = torch.randperm(T)[:B].to(DEV)  # int64, as the plan holds it
    k, v = torch.randn(2, B, H, D, dtype=dtype, device=DEV)
    caches = {}
    for name, fn in (("naive", naive_write_kv), ("triton", write_kv)):
        kc, vc = torch.full((2, T, H, D), float("nan"), dtype=dtype, device=DEV)
        fn(k, v, kc, vc, loc)
        caches[name] = kc, vc
    written = torch.zeros(T, dtype=torch.bool, device=DEV)
    written[loc] = True
    for name, (kc, vc) in caches.items():
        assert kc[~written].isnan().all() and vc[~written].isnan().all(), f"{name}: a row outside loc was written"
        assert_close(f"{name} k_cache", k, kc[loc], atol=0, rtol=0)
        assert_close(f"{name} v_cache", v, vc[loc], atol=0, rtol=0)


def test_write_kv_strided_views():
    """K/V of one [B, 2, H, D] projection output into caches interleaved in one [T, 2, H, D] buffer."""
    B, H, D, T = 3, 2, 32, 11
    kv = torch.randn(B, 2, H, D, device=DEV)
    buf = torch.full((T, 2, H, D), float("nan"), device=DEV)
    loc = torch.tensor([7, 0, 4], device=DEV)
    write_kv(kv[:, 0], kv[:, 1], buf[:, 0], buf[:, 1], loc)
    assert torch.equal(buf[loc], kv)
    rest = torch.ones(T, dtype=torch.bool)
    rest[[7, 0, 4]] = False
    assert buf[rest.to(DEV)].isnan().all()
