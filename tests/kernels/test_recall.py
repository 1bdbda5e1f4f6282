"""recall_pages against its torch reference: for the entries of one phase, head h of the slot's GPU page gets the
host page its slot holds; nothing else is written, and entries of other phases are never dereferenced."""

import pytest
import torch

from freekv_kernels.fp8_rows import naive_dequantize_rows, naive_quantize_rows
from freekv_kernels.page_select.naive import unpack_victim_op, victim_op
from freekv_kernels.recall import naive_recall_pages, recall_pages
from freekv_kernels.testing import assert_close, device

DEV = device()
GUARD = 2  # NaN pages around the GPU cache: a write through a garbage index lands there and is caught
SHAPES = [(H, D, p) for H in (1, 3, 8) for D in (64, 128) for p in (16, 32)]
DTYPES = [torch.bfloat16, torch.float32]
GARBAGE = 1 << 28  # an index far outside every table: reading through it would fault (or hit NaN guards)


def host_randn(*shape, dtype):
    """The host arena: pinned on a CUDA machine so the kernel reads it over UVA."""
    t = torch.randn(*shape, dtype=dtype)
    return t.pin_memory() if DEV.type == "cuda" else t


def fp8_arena(*shape):
    """An FP8 host arena [..., p, D] and its row exponents [..., p], from bf16 rows of magnitudes 2**-20 .. 2**20,
    through an arena layout of freekv_kvstore (strided views of one page-major byte range), pinned on CUDA."""
    from freekv_kvstore import ArenaGeometry
    from freekv_kvstore.client import arena_views

    P, *layer, H, two, p, D = shape
    rows = torch.randn(*shape) * torch.exp2(torch.randint(-20, 21, shape[:-1]).float())[..., None]
    q, e = naive_quantize_rows(rows.to(torch.bfloat16))
    L = layer[0] if layer else 1
    g = ArenaGeometry(L, H, p, D, "float8_e4m3fn")
    raw = torch.empty(P * g.page_bytes, dtype=torch.uint8)
    pages, scales = arena_views(raw.pin_memory() if DEV.type == "cuda" else raw, g, P)
    if not layer:
        pages, scales = pages[:, 0], scales[:, 0]
    pages.copy_(q)
    scales.copy_(e)
    return pages, scales


def entries(B, H, k, R, M, P, pages, phase, n_other=3, empty=None):
    """A batch of B rows (distinct request slots) with their slot tables, page tables and recall codes. Entries
    coded `phase` hold a valid logical page; the others hold garbage, as do the page-table entries they would
    name. slot_pages: distinct GPU pages per (row, slot), within `pages`. empty: a [B, H] bool mask of the
    (row, head) pairs with no entry of `phase` (theirs become the other phase); the other pairs get `phase` in
    their first and last slots too."""
    req_slots = torch.randperm(R)[:B].int()
    page_table = torch.full((R, M), GARBAGE, dtype=torch.int32)
    slots = torch.full((R, H, k), GARBAGE, dtype=torch.int32)
    recall = torch.randint(0, 3, (B, H, k), dtype=torch.int8)
    if empty is not None:
        recall.masked_fill_(empty[..., None] & (recall == phase), 3 - phase)
        recall[..., [0, k - 1]] = torch.where(empty[..., None], recall[..., [0, k - 1]], phase).to(torch.int8)
    for b, r in enumerate(req_slots.tolist()):
        page_table[r, :M // 2] = torch.randint(0, P, (M // 2,), dtype=torch.int32)
        for h in range(H):
            mine = recall[b, h] == phase
            slots[r, h, mine] = torch.randperm(M // 2)[:int(mine.sum())].int()
            slots[r, h, (~mine) & (torch.rand(k) < 0.5)] = -1
    slot_pages = torch.randperm(pages)[:B * k].int().view(B, k)
    return [t.to(DEV) for t in (page_table, slots, req_slots, slot_pages, recall)]


def recall_into(fn, host_layer, idx, phase, p, pages, extra_rows, fused_kv=False, programs=0, slot_block=0,
                host_scales=None):
    """Run `fn` into NaN caches of pages*p + extra_rows rows, each inside a NaN buffer with GUARD pages on both
    sides; returns the K and V buffers [rows, H, D]. fused_kv: K and V interleave in one [rows, 2, H, D] buffer,
    so the caches are non-contiguous views. An FP8 arena (host_scales) recalls into bf16 caches."""
    H, D = host_layer.shape[1], host_layer.shape[-1]
    dtype = torch.bfloat16 if host_scales is not None else host_layer.dtype
    rows = (pages + 2 * GUARD) * p + extra_rows
    shape = (rows, 2, H, D) if fused_kv else (2, rows, H, D)
    buf = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    kb, vb = buf.unbind(1 if fused_kv else 0)
    live = slice(GUARD * p, GUARD * p + pages * p + extra_rows)
    kw = {} if host_scales is None else {"host_scales": host_scales}
    fn(host_layer, kb[live], vb[live], *idx, phase, p, programs=programs, slot_block=slot_block, **kw)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return kb.cpu(), vb.cpu()


def expected(host_layer, idx, phase, p, shape, host_scales=None):
    """The guarded K and V buffers built straight from the contract (NaN where nothing is written); an FP8 arena's
    chunks widened to bf16 by the codec's reference."""
    page_table, slots, req_slots, slot_pages, recall = (t.cpu() for t in idx)
    dtype = torch.bfloat16 if host_scales is not None else host_layer.dtype
    k_exp, v_exp = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)

    def chunk(src, h, kv):
        if host_scales is None:
            return host_layer[src, h, kv].cpu()
        return naive_dequantize_rows(host_layer[src, h, kv].cpu(), host_scales[src, h, kv].cpu(), dtype)

    B, H, K = recall.shape
    for b in range(B):
        r = int(req_slots[b])
        for h in range(H):
            for s in range(K):
                if int(recall[b, h, s]) == phase:
                    src = int(page_table[r, int(slots[r, h, s])])
                    rows = slice((GUARD + int(slot_pages[b, s])) * p, (GUARD + int(slot_pages[b, s]) + 1) * p)
                    k_exp[rows, h] = chunk(src, h, 0)
                    v_exp[rows, h] = chunk(src, h, 1)
    return k_exp, v_exp


def check_recall(host_layer, idx, phase, p, pages, extra_rows, fused_kv=False, programs=0, slot_block=0,
                 host_scales=None):
    before = [t.clone() for t in idx]
    ref = recall_into(naive_recall_pages, host_layer, idx, phase, p, pages, extra_rows, fused_kv, programs, slot_block,
                      host_scales)
    out = recall_into(recall_pages, host_layer, idx, phase, p, pages, extra_rows, fused_kv, programs, slot_block,
                      host_scales)
    exp = expected(host_layer, idx, phase, p, ref[0].shape, host_scales)
    for name, e, r, o in (("k_cache", exp[0], ref[0], out[0]), ("v_cache", exp[1], ref[1], out[1])):
        mask = ~e.isnan()
        assert torch.equal(~r.isnan(), mask), f"{name}: the reference wrote outside the contract"
        assert torch.equal(~o.isnan(), mask), f"{name}: {int((~o.isnan() ^ mask).sum())} elements written wrongly"
        assert_close(name, e[mask], o[mask], atol=0, rtol=0)
        assert_close(name, e[mask], r[mask], atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(before, idx)), "an index input was modified"


@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,p", SHAPES)
def test_recall_pages(H, D, p, dtype, phase):
    R, M, P, B, k, pages = 6, 20, 13, 3, 5, 17
    host_layer = host_randn(P, H, 2, p, D, dtype=dtype)
    # T = 17*p + 5: the 5 rows past the last page are never written.
    check_recall(host_layer, entries(B, H, k, R, M, P, pages, phase), phase, p, pages, extra_rows=5)


@pytest.mark.parametrize("programs,slot_block", [(0, 0), (3, 0), (0, 4)])
@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("H,D,p", [(1, 64, 16), (3, 128, 32), (8, 64, 32), (8, 128, 16)])
def test_recall_pages_fp8_host(H, D, p, phase, programs, slot_block):
    """From an FP8 arena (every layer's pages and exponents strided views of one byte range, as the kvstore maps
    it): each recalled chunk is its e4m3 rows times their scales, in bf16, exactly as the codec's reference."""
    R, M, P, B, k, pages = 6, 20, 13, 3, 5, 17
    arena, scales = fp8_arena(P, 3, H, 2, p, D)
    check_recall(arena[:, 1], entries(B, H, k, R, M, P, pages, phase), phase, p, pages, extra_rows=5,
                 programs=programs, slot_block=slot_block, host_scales=scales[:, 1])


def test_recall_pages_fp8_host_needs_its_exponents():
    arena, scales = fp8_arena(3, 1, 2, 16, 64)
    idx = entries(1, 1, 2, 2, 4, 3, 2, 1)
    for fn in (naive_recall_pages, recall_pages):
        with pytest.raises(ValueError, match="row exponents"):
            recall_into(fn, arena, idx, 1, 16, 2, 0)
        with pytest.raises(ValueError, match="row exponents"):
            recall_into(fn, arena, idx, 1, 16, 2, 0, host_scales=scales[..., :8])
        with pytest.raises(ValueError, match="belong to an FP8 arena"):
            recall_into(fn, host_randn(3, 1, 2, 16, 64, dtype=torch.bfloat16), idx, 1, 16, 2, 0, host_scales=scales)


@pytest.mark.parametrize("programs", [1, 3, 16])
@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("H,p", [(1, 16), (8, 32)])
def test_recall_pages_few_programs(H, p, phase, programs):
    """Fewer programs than (row, head, slot) items: each strides over many (3 programs and H = 8: 40 each), the
    entries of both phases and code 0 interleaved among them."""
    R, M, P, B, k, pages = 6, 20, 13, 3, 5, 17
    host_layer = host_randn(P, H, 2, p, 64, dtype=torch.bfloat16)
    check_recall(host_layer, entries(B, H, k, R, M, P, pages, phase), phase, p, pages, extra_rows=5,
                 programs=programs)


@pytest.mark.parametrize("programs,slot_block", [(0, 0), (1, 0), (3, 0), (16, 0), (0, 4), (3, 4)])
@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("H,p", [(1, 16), (8, 32)])
@pytest.mark.parametrize("k", [5, 37])
def test_recall_pages_blocks(k, H, p, phase, programs, slot_block):
    """programs > 0 scans each (row, head) as one block of next_power_of_2(k) codes, the slots past k masked off
    (programs 0: one slot per program), or as blocks of slot_block codes, the last one partly past k: every other
    (row, head) has no entry of the phase (its blocks are skipped whole), the others hold several, their first and
    last slots among them."""
    R, M, P, B = 6, 2 * k, 13, 3
    empty = (torch.arange(B * H) % 2 == 0).view(B, H)
    host_layer = host_randn(P, H, 2, p, 64, dtype=torch.bfloat16)
    check_recall(host_layer, entries(B, H, k, R, M, P, B * k, phase, empty=empty), phase, p, B * k, extra_rows=5,
                 programs=programs, slot_block=slot_block)


@pytest.mark.parametrize("slot_block", [-1, 3, 6])
def test_recall_pages_rejects_slot_block(slot_block):
    host_layer = host_randn(3, 1, 2, 16, 64, dtype=torch.bfloat16)
    idx = entries(1, 1, 2, 2, 4, 3, 2, 1)
    with pytest.raises(ValueError, match="slot_block"):
        recall_into(recall_pages, host_layer, idx, 1, 16, 2, 0, slot_block=slot_block)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recall_pages_layer_view(dtype):
    """The kernel reads host_kv[:, layer] of a [P, L, H, 2, p, D] arena and writes K/V caches that are
    interleaved views of one buffer: all strides come from the tensors."""
    P, L, H, D, p, pages = 7, 3, 3, 64, 16, 9
    host_kv = host_randn(P, L, H, 2, p, D, dtype=dtype)
    idx = entries(2, H, 4, 5, 12, P, pages, 1)
    for layer, programs in ((0, 0), (L - 1, 5)):
        check_recall(host_kv[:, layer], idx, 1, p, pages, extra_rows=0, fused_kv=True, programs=programs)


@pytest.mark.parametrize("programs", [0, 4])
@pytest.mark.parametrize("B", [0, 2])
def test_recall_pages_nothing_to_recall(B, programs):
    """An empty batch, or no entry of the phase (codes of the other phase and 0 only): nothing is written."""
    P, H, D, p, pages = 4, 3, 64, 16, 6
    host_layer = host_randn(P, H, 2, p, D, dtype=torch.bfloat16)
    idx = entries(B, H, 3, 4, 8, P, pages, 1)
    idx[-1].clamp_(max=1)  # codes 0 and 1 only
    check_recall(host_layer, idx, 2, p, pages, extra_rows=3, programs=programs)


def victim_ops_for(idx, phase, V, seed):
    """Per (row, head): each entry of `phase` evicts into a distinct victim entry or none, and takes its page from
    an entry no item of the head evicts into, or from the host; entries of other phases get garbage ops."""
    g = torch.Generator().manual_seed(seed)
    recall = idx[-1].cpu()
    B, H, K = recall.shape
    ops = torch.randint(1 << 20, 1 << 30, (B, H, K), dtype=torch.int32, generator=g)
    for b in range(B):
        for h in range(H):
            order = torch.randperm(V, generator=g).tolist()
            items = (recall[b, h] == phase).nonzero().flatten().tolist()
            n_ev = min(len(items), V // 2)
            evict_to, read_from = order[:n_ev], order[n_ev:]
            for i, s in enumerate(items):
                ev = evict_to[i] if i < n_ev and torch.rand(1, generator=g) < 0.7 else -1
                src = read_from[i] if i < len(read_from) and torch.rand(1, generator=g) < 0.5 else -1
                ops[b, h, s] = victim_op(ev, src)
    return ops.to(DEV)


# (0, 4): the recall before attention under --kv-recall-block 4
@pytest.mark.parametrize("programs,slot_block", [(0, 0), (3, 0), (0, 4)])
@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("H,p", [(1, 16), (3, 32), (8, 16)])
def test_recall_pages_victims(H, p, phase, programs, slot_block):
    """With victim ops: an item's slot chunk goes to its evict entry before the slot is overwritten, and the slot
    takes its source entry's chunk (as it was before the launch) instead of the host's. Caches start random (the
    slots hold the pages they evict), victim pages sit after the slot pages."""
    R, M, P, B, k, V, D = 6, 20, 13, 3, 5, 8, 64
    host_layer = host_randn(P, H, 2, p, D, dtype=torch.bfloat16)
    idx = entries(B, H, k, R, M, P, B * k, phase)
    ops = victim_ops_for(idx, phase, V, seed=H * 10 + p + phase)
    base = B * k
    rows = (base + R * V) * p
    k0 = torch.randn(rows, H, D, dtype=torch.bfloat16)
    v0 = torch.randn(rows, H, D, dtype=torch.bfloat16)
    outs = []
    for fn in (naive_recall_pages, recall_pages):
        kc, vc = k0.clone().to(DEV), v0.clone().to(DEV)
        fn(host_layer, kc, vc, *idx, phase, p, programs=programs, slot_block=slot_block, victim_ops=ops,
           victim_base=base, victim_entries=V)
        outs.append((kc.cpu(), vc.cpu()))
    # The contract, from the caches as they were.
    page_table, slots, req_slots, slot_pages, recall = (t.cpu() for t in idx)
    k_exp, v_exp = k0.clone(), v0.clone()
    hits = evictions = 0
    for b, r in enumerate(req_slots.tolist()):
        for h in range(H):
            for s in range(k):
                if int(recall[b, h, s]) != phase:
                    continue
                ev, src = (int(x) for x in unpack_victim_op(ops[b, h, s].cpu()))
                dst = slice(int(slot_pages[b, s]) * p, (int(slot_pages[b, s]) + 1) * p)
                if ev >= 0:
                    e = slice((base + r * V + ev) * p, (base + r * V + ev + 1) * p)
                    k_exp[e, h], v_exp[e, h] = k0[dst, h], v0[dst, h]
                    evictions += 1
                if src >= 0:
                    e = slice((base + r * V + src) * p, (base + r * V + src + 1) * p)
                    k_exp[dst, h], v_exp[dst, h] = k0[e, h], v0[e, h]
                    hits += 1
                else:
                    hp = int(page_table[r, int(slots[r, h, s])])
                    k_exp[dst, h], v_exp[dst, h] = host_layer[hp, h, 0].cpu(), host_layer[hp, h, 1].cpu()
    assert hits and evictions
    for name, (kc, vc) in zip(("naive", "triton"), outs):
        assert torch.equal(kc, k_exp) and torch.equal(vc, v_exp), name


def test_recall_pages_victim_pages_must_fit():
    host_layer = host_randn(3, 1, 2, 16, 64, dtype=torch.bfloat16)
    idx = entries(1, 1, 2, 2, 4, 3, 2, 1)
    ops = torch.zeros(1, 1, 2, dtype=torch.int32, device=DEV)
    kc = torch.zeros(4 * 16, 1, 64, dtype=torch.bfloat16, device=DEV)
    for fn in (naive_recall_pages, recall_pages):
        with pytest.raises(ValueError, match="victim pages"):
            fn(host_layer, kc, kc.clone(), *idx, 1, 16, victim_ops=ops, victim_base=2, victim_entries=2)
