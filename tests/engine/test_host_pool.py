"""The in-process host pool: pages handed out and taken back per owner, a clear error when full, and on CUDA an
arena of exactly its own size that the GPU addresses as pinned memory."""

from __future__ import annotations

import gc

import pytest
import torch

from freekv_sglang.host_pool import HostPoolFull, LocalHostPool


def test_pages_go_back_to_the_pool_per_owner():
    pool = LocalHostPool(6, 2, 3, 16, 8, torch.float16, pin=False)
    assert pool.arena.shape == (6, 2, 3, 2, 16, 8)
    a = pool.alloc(owner=1, n=2)
    b = pool.alloc(owner=2, n=3)
    assert len(set(a) | set(b)) == 5 and pool.free_pages == 1
    assert pool.alloc(owner=1, n=1)[0] not in a + b
    assert pool.free(1) == 3 and pool.free_pages == 3
    assert pool.free(1) == 0  # a second free of the same owner gives nothing back twice
    assert sorted(pool.alloc(owner=3, n=3)) == sorted(set(range(6)) - set(b))


def test_full_pool_refuses_and_keeps_what_it_had():
    pool = LocalHostPool(4, 1, 1, 16, 8, torch.float32, pin=False)
    pool.alloc(owner=1, n=3)
    with pytest.raises(HostPoolFull, match="2 pages wanted, 1 free of 4"):
        pool.alloc(owner=2, n=2)
    assert pool.free_pages == 1 and pool.free(2) == 0 and pool.free(1) == 3


def test_needs_a_page():
    with pytest.raises(ValueError, match="at least one page"):
        LocalHostPool(0, 1, 1, 16, 8, torch.float32, pin=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_is_registered_at_its_exact_size_and_released():
    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    # 5 x 2 x 3 x 2 x 16 x 8 x 2 bytes = 15360: not a power of two.
    pool = LocalHostPool(5, 2, 3, 16, 8, torch.bfloat16)
    assert pool.arena.is_pinned()
    # Not from torch's pinned allocator, which would round the block up to a power of two.
    assert torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) == before
    pool.arena.copy_(torch.arange(pool.arena.numel()).reshape(pool.arena.shape))
    on_gpu = pool.arena.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), pool.arena)
    arena = pool.arena
    del pool, on_gpu
    gc.collect()
    assert not arena.is_pinned()  # unregistered when the pool died, while `arena` still holds the memory
