"""Staging pages: where the sparse layers' K/V of prompts being prefilled live on the GPU.

Under FreeKV, SGLang's token pool keeps every token's KV only for the dense layers. The sparse layers
get a small buffer of staging pages, enough for the prefill in flight: a prompt's pages are staged
while it is prefilled (chunk by chunk), offloaded to the kvstore arena as they fill, and released once
its prefill completes, when the engine holds its sink and window pages and the arena holds the rest.
SGLang's token locations index the staging buffer through `page_map` (logical page -> staging page);
logical pages that hold no staged prompt map to the last, trash page, which absorbs stray writes.
"""

from __future__ import annotations

import torch


class StagingFull(RuntimeError):
    pass


class StagingPages:
    """Host-side allocator of staging pages 0..num_pages-1 (page num_pages is the trash page)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"staging needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.trash = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._owned: dict[int, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages(self, slot: int) -> list[int]:
        """Staging page of each logical page of the prompt staged in `slot`, in order."""
        return self._owned.get(slot, [])

    def grow(self, slot: int, num_pages: int) -> list[tuple[int, int]]:
        """Stage logical pages up to num_pages of `slot`; returns the new (logical page, staging page)s."""
        owned = self._owned.setdefault(slot, [])
        want = num_pages - len(owned)
        if want > len(self._free):
            raise StagingFull(f"FreeKV staging full: slot {slot} needs {want} more pages, {len(self._free)} of "
                              f"{self.num_pages} free; the sizing in freekv_sglang.memory_plan must cover the "
                              "prefill in flight")
        new = [(len(owned) + i, self._free.pop()) for i in range(max(want, 0))]
        owned.extend(page for _, page in new)
        return new

    def release(self, slot: int, keep: dict[int, int] | None = None) -> list[int]:
        """Free the pages of `slot`, but hand each page in `keep` (page -> new owner) to that owner instead: a page
        another row still reads outlives the prompt that staged it. Returns the pages freed."""
        pages = self._owned.pop(slot, [])
        for page, owner in (keep or {}).items():
            pages.remove(page)
            self._owned.setdefault(owner, []).append(page)
        self._free.extend(reversed(pages))
        return pages


def translate(page_map: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """Staging rows of token locations `loc` (same dtype as loc)."""
    return page_map[loc // page_size].to(loc.dtype) * page_size + loc % page_size
