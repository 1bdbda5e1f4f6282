"""Session 44's microbenchmark (run as is on a GPU): select_slots' top-k, tl.topk over packed int64 (score, page) keys,
against a threshold search (a 32-step bitwise search for the k-th key, ties by page, then a compaction), 1,024 lanes
(32K context, page 32), k 64 (budget 2048), 8 and 128 rows (1 and 16 requests x 8 KV heads), 1-8 warps; each timed as
the replay of a CUDA graph (triton.testing.do_bench_cudagraph) and checked against torch.topk."""
import torch
import triton
import triton.language as tl

@triton.jit
def _keys(x_ptr, n, N: tl.constexpr):
    j = tl.arange(0, N)
    f = tl.load(x_ptr + j, mask=j < n, other=float("-inf"))
    bits = f.to(tl.int32, bitcast=True)
    return j, bits ^ ((bits >> 31) & 0x7FFFFFFF)

@triton.jit
def bitonic(x_ptr, out_ptr, n, N: tl.constexpr, KP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j, key = _keys(x_ptr + r * N, n, N)
    top = tl.topk((key.to(tl.int64) << 32) | (0x7FFFFFFF - j).to(tl.int64), KP)
    tl.store(out_ptr + r * KP + tl.arange(0, KP), 0x7FFFFFFF - top.to(tl.int32))

@triton.jit
def threshold(x_ptr, out_ptr, n, K, N: tl.constexpr, KP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j, key = _keys(x_ptr + r * N, n, N)
    u = key.to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned order = key order
    t = tl.zeros([], tl.uint32)
    for bit in tl.static_range(31, -1, -1):
        cand = t | (1 << bit)
        cnt = tl.sum((u >= cand).to(tl.int32))
        t = tl.where(cnt >= K, cand, t)
    above = u > t
    need = K - tl.sum(above.to(tl.int32))
    eq = u == t
    sel = above | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    rank = tl.cumsum(sel.to(tl.int32), 0) - 1
    i = tl.arange(0, KP)
    page = tl.sum(tl.where((rank[None, :] == i[:, None]) & sel[None, :], j[None, :] + 1, 0), axis=1) - 1
    tl.store(out_ptr + r * KP + i, page)

def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=200)

if __name__ == "__main__":
    N, KP, n = 1024, 64, 1000
    for R in (8, 128):
        x = torch.rand(R, N, device="cuda")
        out = torch.empty(R, KP, dtype=torch.int32, device="cuda")
        ref = torch.topk(x[:, :n], KP, dim=1).indices.sort(dim=1).values.int()
        for w in (1, 2, 4, 8):
            bitonic[(R,)](x, out, n, N=N, KP=KP, num_warps=w)
            ok1 = torch.equal(out.sort(dim=1).values, ref)
            t1 = bench(lambda: bitonic[(R,)](x, out, n, N=N, KP=KP, num_warps=w))
            out.fill_(-7)
            threshold[(R,)](x, out, n, KP, N=N, KP=KP, num_warps=w)
            ok2 = torch.equal(out.sort(dim=1).values, ref)
            t2 = bench(lambda: threshold[(R,)](x, out, n, KP, N=N, KP=KP, num_warps=w))
            print(f"R {R:4d} warps {w}: bitonic {t1*1e3:6.2f} us ok {ok1} | threshold {t2*1e3:6.2f} us ok {ok2}", flush=True)
