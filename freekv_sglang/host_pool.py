"""Host memory that holds every offloaded KV page: HND pages [P, L, H, 2, p, D] the GPU reads directly (in FP8, with an
int8 exponent per row beside them: freekv_kvstore.arena)."""

from __future__ import annotations

import functools
import weakref
from typing import Protocol

import torch

from freekv_kvstore import ArenaGeometry, cuda_host
from freekv_kvstore.client import arena_views


class HostPoolFull(RuntimeError):
    pass


class HostPool(Protocol):
    """Owner of host pages. `arena` is addressable by GPU kernels (pinned or CUDA-registered) on CUDA machines;
    `scales` holds an FP8 arena's row exponents [P, L, H, 2, p] int8 (None for other dtypes)."""

    arena: torch.Tensor
    scales: torch.Tensor | None

    def alloc(self, owner: int, n: int) -> list[int]: ...

    def free(self, owner: int) -> int: ...


class LocalHostPool:
    """An in-process pinned arena with a free list: the engine's default when no kvstore daemon is given."""

    def __init__(self, num_pages: int, num_layers: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, pin: bool | None = None):
        if num_pages < 1:
            raise ValueError(f"host pool needs at least one page, got num_pages={num_pages}")
        pin = torch.cuda.is_available() if pin is None else pin
        geometry = ArenaGeometry(num_layers, num_kv_heads, page_size, head_dim, dtype)
        raw = torch.empty(num_pages * geometry.page_bytes, dtype=torch.uint8)
        self.arena, self.scales = arena_views(raw, geometry, num_pages)
        if pin:
            # Registered rather than allocated with pin_memory=True: torch's pinned allocator rounds a block up
            # to a power of two, so a 69 GB arena would ask a 128 GB host for 128 GB.
            cuda_host.register(raw.data_ptr(), raw.numel(), "host KV pool")
            weakref.finalize(self, cuda_host.when_safe, functools.partial(_unregister, raw))
        self._free = list(range(num_pages - 1, -1, -1))
        self._owned: dict[int, list[int]] = {}
        self._refs = [0] * num_pages  # owners holding each page (a shared prefix page has several)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, owner: int, n: int) -> list[int]:
        if n > len(self._free):
            raise HostPoolFull(f"host KV pool full: {n} pages wanted, {len(self._free)} free of "
                               f"{self.arena.shape[0]}; raise the host pool size")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self._owned.setdefault(owner, []).extend(pages)
        return pages

    def alloc_extra(self, owner: int, n: int) -> list[int]:
        """alloc, for pages outside the engine's per-token needs (export_prefix's sink pages; see KVStoreHostPool)."""
        return self.alloc(owner, n)

    def hold(self, owner: int, pages: list[int]) -> None:
        """owner holds pages another owner holds too (a shared prefix): they return to the pool when the last
        holder is freed. An owner id that only holds may stand for a retained prefix."""
        pages = [int(p) for p in pages]
        if len(set(pages)) != len(pages) or not all(0 <= p < len(self._refs) and self._refs[p] for p in pages):
            raise ValueError(f"only distinct pages some owner holds can be shared, got {pages}")
        for p in pages:
            self._refs[p] += 1
        self._owned.setdefault(owner, []).extend(pages)

    def free(self, owner: int) -> int:
        """Let go of an owner's pages; returns how many of them went back to the pool (shared ones may stay)."""
        pages = self._owned.pop(owner, [])
        pooled = []
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                pooled.append(p)
        self._free.extend(reversed(pooled))
        return len(pooled)


class LayerSlice:
    """Layers [first, first + count) of another pool's arena, for an engine that holds only those layers of the
    model (FastKV's two engines, one before and one after the TSP layer, each writing its own layers of a host page).
    Pages are the other pool's: every other attribute and method is its."""

    def __init__(self, pool, first: int, count: int):
        if not 0 <= first < first + count <= pool.arena.shape[1]:
            raise ValueError(f"layers [{first}, {first + count}) are not within the arena's {pool.arena.shape[1]}")
        self.pool = pool
        self.arena = pool.arena[:, first:first + count]
        self.scales = None if pool.scales is None else pool.scales[:, first:first + count]

    def __getattr__(self, name):
        if name == "pool":
            raise AttributeError(name)
        return getattr(self.pool, name)


def _unregister(arena: torch.Tensor) -> None:
    # The finalizer holds `arena`, so the memory outlives its registration.
    cuda_host.unregister(arena.data_ptr(), "host KV pool")
