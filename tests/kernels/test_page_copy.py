"""pages_from_host / pages_to_host against their torch references: whole pages of every KV head between the HND host
arena and NHD token rows anywhere in a buffer; staged_to_slots: staging pages into selection slots, GPU to GPU.
Nothing else is written."""

import pytest
import torch

from freekv_kernels.page_copy import (naive_pages_from_host, naive_pages_to_host, naive_staged_to_slots,
                                      pages_from_host, pages_to_host, staged_to_slots)
from freekv_kernels.testing import assert_close, device

DEV = device()
SHAPES = [(H, D, p) for H in (1, 3, 8) for D in (64, 80, 128) for p in (16, 32)]
DTYPES = [torch.bfloat16, torch.float32]


def arena(N, H, p, D, dtype, fill=None):
    """A host arena layer [N, H, 2, p, D], pinned on a CUDA machine so the kernel reaches it over UVA."""
    t = torch.randn(N, H, 2, p, D).to(dtype) if fill is None else torch.full((N, H, 2, p, D), fill, dtype=dtype)
    return t.pin_memory() if DEV.type == "cuda" else t


def case(H, D, p, dtype, n, seed):
    """n distinct host pages of an arena of 3n + 5, and n * p distinct token rows of a buffer of 2 n p + 7 rows in
    a shuffled order (SGLang's token locations need not be page-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    N, T = 3 * n + 5, 2 * n * p + 7
    pages = torch.randperm(N, generator=g)[:n].int()
    rows = torch.randperm(T, generator=g)[:n * p].long()
    return N, T, pages, rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_pages_from_host_write_exactly_their_rows(H, D, p, dtype):
    N, T, pages, rows = case(H, D, p, dtype, n=5, seed=H * 1000 + D * 10 + p)
    host = arena(N, H, p, D, dtype)
    ref_k, ref_v = (torch.full((T, H, D), float("nan"), dtype=dtype) for _ in range(2))
    naive_pages_from_host(host, pages, ref_k, ref_v, rows)
    k, v = (torch.full((T, H, D), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
    pages_from_host(host, pages.to(DEV), k, v, rows.to(DEV))
    written = torch.zeros(T, dtype=torch.bool)
    written[rows] = True
    for name, ref, out in (("k", ref_k, k.cpu()), ("v", ref_v, v.cpu())):
        assert_close(name, ref[written], out[written], atol=0, rtol=0)
        assert torch.isnan(out[~written]).all(), f"{name}: a row outside `rows` was written"
    # The reference itself: token t of page i, head h.
    i, t, h = 3, p - 1, H - 1
    assert torch.equal(ref_v[rows[i * p + t], h], host[pages[i], h, 1, t])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_pages_to_host_write_exactly_their_pages(H, D, p, dtype):
    N, T, pages, rows = case(H, D, p, dtype, n=4, seed=7 + H + D + p)
    k, v = torch.randn(T, H, D).to(dtype), torch.randn(T, H, D).to(dtype)
    ref = arena(N, H, p, D, dtype, fill=float("nan"))
    naive_pages_to_host(k, v, rows, ref, pages)
    out = arena(N, H, p, D, dtype, fill=float("nan"))
    pages_to_host(k.to(DEV), v.to(DEV), rows.to(DEV), out, pages.to(DEV))
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    mine = torch.zeros(N, dtype=torch.bool)
    mine[pages.long()] = True
    assert_close("arena", ref[mine], out[mine], atol=0, rtol=0)
    assert torch.isnan(out[~mine]).all(), "a page outside `pages` was written"
    assert torch.equal(ref[pages[1], H - 1, 0, 2], k[rows[p + 2], H - 1])


def test_a_round_trip_through_a_strided_pool_returns_the_pages():
    """K and V as views of one [T, 2, H, D] buffer (non-contiguous rows), as an interleaved pool would hand them."""
    H, D, p, n = 8, 128, 16, 6
    N, T, pages, rows = case(H, D, p, torch.bfloat16, n, seed=3)
    host = arena(N, H, p, D, torch.bfloat16)
    buf = torch.full((T, 2, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    pages_from_host(host, pages.to(DEV), buf[:, 0], buf[:, 1], rows.to(DEV))
    back = arena(N, H, p, D, torch.bfloat16, fill=0.0)
    pages_to_host(buf[:, 0], buf[:, 1], rows.to(DEV), back, pages.to(DEV))
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(back[pages.long()], host[pages.long()])


def fp8_arena(N, H, p, D, L=2):
    """Layer 1 of an FP8 arena of L layers, as the kvstore maps it (pages and row exponents strided views of one byte
    range), all bytes 0x7F (e4m3 NaN, exponent 127); pinned on CUDA. Returns the raw bytes too."""
    from freekv_kvstore import ArenaGeometry
    from freekv_kvstore.client import arena_views

    g = ArenaGeometry(L, H, p, D, "float8_e4m3fn")
    raw = torch.full((N * g.page_bytes,), 0x7F, dtype=torch.uint8)
    raw = raw.pin_memory() if DEV.type == "cuda" else raw
    pages, scales = arena_views(raw, g, N)
    return raw, pages[:, 1], scales[:, 1]


@pytest.mark.parametrize("H,D,p", [(1, 64, 16), (3, 80, 32), (8, 128, 16), (8, 64, 32)])
def test_fp8_arena_pages_to_host_and_back(H, D, p):
    """pages_to_host quantises each row into an FP8 arena as the reference does, bit for bit, writing only its pages
    (values and exponents); pages_from_host widens them back into exactly their rows, as the reference does."""
    from freekv_kernels.fp8_rows import naive_dequantize_rows, naive_quantize_rows

    n = 5
    N, T, pages, rows = case(H, D, p, torch.bfloat16, n, seed=H + D + p)
    scale = torch.exp2(torch.randint(-12, 13, (T, H, 1)).float())
    k, v = ((torch.randn(2, T, H, D) * scale).to(torch.bfloat16))
    arenas = []
    for fn in (naive_pages_to_host, pages_to_host):
        raw, host, exps = fp8_arena(N, H, p, D)
        fn(k.to(DEV), v.to(DEV), rows.to(DEV), host, pages.to(DEV), host_scales=exps)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        arenas.append((raw, host, exps))
    (raw_ref, host, exps), (raw_out, _, _) = arenas
    assert torch.equal(raw_out, raw_ref), f"{int((raw_out != raw_ref).sum())} arena bytes differ from the reference"
    mine = torch.zeros(N, dtype=torch.bool)
    mine[pages.long()] = True
    assert (host[~mine].view(torch.uint8) == 0x7F).all() and (exps[~mine] == 0x7F).all()
    i, h = 2, H - 1
    q, e = naive_quantize_rows(k[rows[i * p:(i + 1) * p], h])
    assert torch.equal(host[pages[i], h, 0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(exps[pages[i], h, 0], e)
    outs = []
    for fn in (naive_pages_from_host, pages_from_host):
        kb, vb = (torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2))
        fn(host, pages.to(DEV), kb, vb, rows.to(DEV), host_scales=exps)
        outs.append((kb.cpu(), vb.cpu()))
    written = torch.zeros(T, dtype=torch.bool)
    written[rows] = True
    for kv, src in enumerate((k, v)):
        want = naive_dequantize_rows(*naive_quantize_rows(src[written]), torch.bfloat16)
        for name, out in zip(("naive", "triton"), outs):
            assert torch.equal(out[kv][written], want), name
            assert out[kv][~written].isnan().all(), f"{name}: a row outside `rows` was written"


def test_bad_shapes_are_refused():
    host = arena(4, 2, 16, 64, torch.float32)
    k = torch.zeros(64, 2, 64, device=DEV)
    pages = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="need 32 rows"):
        pages_from_host(host, pages, k, k.clone(), torch.arange(31, device=DEV))
    with pytest.raises(ValueError, match="disagree"):
        pages_from_host(host, pages, torch.zeros(64, 3, 64, device=DEV), k, torch.arange(32, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_staged_to_slots_fills_exactly_the_held_slots(H, D, p, dtype):
    """Rows of three request slots (one twice over, in a batch of padding-like order), some slots empty: each held
    slot's tile comes from its staging page, head by head; every other row of the slot buffer stays poisoned."""
    g = torch.Generator().manual_seed(H * 100 + D + p)
    R, N, W, B = 5, 4, 6, 3
    req = torch.tensor([3, 0, 4], dtype=torch.int32)
    slots = torch.randint(-1, W, (R, H, N), generator=g, dtype=torch.int32)
    slots[3, 0] = -1  # a head with nothing selected
    stage = torch.stack([torch.randperm(2 * W, generator=g)[:W] for _ in range(B)]).int()  # [B, W]
    slot_pages = (torch.randperm(B * N + 2, generator=g)[:B * N] + 1).view(B, N).int()  # page 0 untouched
    T, Ts = (B * N + 3) * p, 2 * W * p
    src_k, src_v = (torch.randn(Ts, H, D, generator=g).to(dtype) for _ in range(2))
    ref_k, ref_v = (torch.full((T, H, D), float("nan"), dtype=dtype) for _ in range(2))
    naive_staged_to_slots(src_k, src_v, stage, slots, req, slot_pages, ref_k, ref_v, p)
    k, v = (torch.full((T, H, D), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
    staged_to_slots(src_k.to(DEV), src_v.to(DEV), stage.to(DEV), slots.to(DEV), req.to(DEV), slot_pages.to(DEV), k, v,
                    p)
    held = torch.zeros(T, H, dtype=torch.bool)
    for b, r in enumerate(req.tolist()):
        for h, s in (slots[r] >= 0).nonzero().tolist():
            held[int(slot_pages[b, s]) * p:(int(slot_pages[b, s]) + 1) * p, h] = True
    assert held.any() and not held.all()
    for name, ref, out in (("k", ref_k, k.cpu()), ("v", ref_v, v.cpu())):
        assert_close(name, ref[held], out[held], atol=0, rtol=0)
        assert torch.isnan(out[~held]).all(), f"{name}: a row of an empty slot (or of no slot) was written"
    # The reference itself: slot 1 of row 2's head 0 holds logical page j, token p - 1.
    j = int(slots[4, 0, 1])
    if j >= 0:
        assert torch.equal(ref_k[int(slot_pages[2, 1]) * p + p - 1, 0], src_k[int(stage[2, j]) * p + p - 1, 0])


def test_staged_to_slots_refuses_disagreeing_shapes():
    k = torch.zeros(64, 2, 64, device=DEV)
    req = torch.zeros(2, dtype=torch.int32, device=DEV)
    stage = torch.zeros(2, 3, dtype=torch.int32, device=DEV)
    slot_pages = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="slots must be"):
        staged_to_slots(k, k, stage, torch.zeros(3, 2, 5, dtype=torch.int32, device=DEV), req, slot_pages, k, k, 16)
    with pytest.raises(ValueError, match="one row per"):
        staged_to_slots(k, k, stage[:1], torch.zeros(3, 2, 4, dtype=torch.int32, device=DEV), req, slot_pages, k, k,
                        16)
