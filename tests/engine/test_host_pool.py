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


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister that record their calls; unregistering a range that is not registered
    fails as CUDA does."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.registered: set[int] = set()

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr))
        if ptr in self.registered:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        if ptr not in self.registered:
            return 713
        self.registered.remove(ptr)
        return 0


def test_a_pool_released_inside_a_graph_capture_unregisters_after_it(monkeypatch):
    """A finalizer inside a capture must not call cudaHostUnregister (not permitted there: it breaks the capture and
    leaves the range registered); its release waits, with the memory alive, for the next registration."""
    from freekv_kvstore import cuda_host

    cudart, capturing = _FakeCudart(), [False]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    pool = LocalHostPool(2, 1, 1, 16, 8, torch.float32, pin=True)
    ptr = pool.arena.data_ptr()
    assert cudart.calls == [("register", ptr)]
    capturing[0] = True
    del pool
    gc.collect()
    assert cudart.calls == [("register", ptr)] and ptr in cudart.registered  # nothing called inside the capture
    capturing[0] = False
    other = LocalHostPool(2, 1, 1, 16, 8, torch.float32, pin=True)  # the next registration releases it first
    assert cudart.calls == [("register", ptr), ("unregister", ptr), ("register", other.arena.data_ptr())]
    assert not cuda_host._deferred
    del other
    gc.collect()  # outside a capture: released at once
    assert cudart.calls[-1][0] == "unregister" and not cudart.registered


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pool_collected_during_a_real_capture_keeps_the_capture_valid():
    pool = LocalHostPool(5, 2, 3, 16, 8, torch.bfloat16)
    arena = pool.arena
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        del pool
        gc.collect()  # the garbage collector runs the pool's finalizer inside the capture
        x.add_(1)
    assert arena.is_pinned()  # still registered: released after the capture
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.ones(4))
    LocalHostPool(1, 1, 1, 16, 8, torch.bfloat16)  # a registration outside a capture releases what waited
    assert not arena.is_pinned()
