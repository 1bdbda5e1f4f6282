"""On a CUDA machine: the client registers its arena with CUDA, so GPU kernels read and write it in place."""

from __future__ import annotations

import pytest
import torch

from freekv_kvstore import ArenaGeometry, KVStoreClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=16, head_dim=64, dtype="bfloat16")


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)

    def run(src: torch.Tensor, dst: torch.Tensor) -> None:
        n = src.numel()
        copy[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)

    return run


def test_registered_arena_is_read_and_written_by_a_gpu_kernel_in_place(daemons):
    d = daemons.start("ipc")
    with KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=64) as c:
        arena = c.arena
        assert arena.is_pinned()  # registered (cudaHostRegister) memory counts as pinned for torch and Triton
        copy = _copy_kernel()
        pages = c.alloc(1, 8)
        gpu = torch.randn((8, *arena.shape[1:]), device="cuda").to(arena.dtype)
        for j, p in enumerate(pages):  # the GPU writes straight into the host pages (zero-copy over UVA)
            copy(gpu[j], arena[p])
        torch.cuda.synchronize()
        assert torch.equal(arena[pages].view(torch.int16), gpu.cpu().view(torch.int16))
        back = torch.empty_like(gpu)
        for j, p in enumerate(pages):  # and reads them back the same way
            copy(arena[p], back[j])
        torch.cuda.synchronize()
        assert torch.equal(back.view(torch.int16), gpu.view(torch.int16))
        staged = arena[pages[0]].to("cuda", non_blocking=True)  # pinned: an asynchronous DMA copy works too
        torch.cuda.synchronize()
        assert torch.equal(staged.view(torch.int16), gpu[0].view(torch.int16))
        del arena, staged  # close() then unregisters and unmaps the arena
