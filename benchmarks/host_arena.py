"""A pinned host arena layer in kvstore's layout for the kernel benchmarks (kernels.py, recall_before.py,
select_chain.py). Named apart from PyPI's `kernels`, which `import kernels` could find."""

from __future__ import annotations

import torch
from freekv_kvstore import ArenaGeometry
from freekv_kvstore.client import arena_views


class HostLayer:
    """A layer of a pinned host arena of `heads` KV heads, pages of `page` tokens of head dim `dim` (FP8: with its
    row exponents), and the bytes of one (page, head) chunk in it. Its content is left unfilled: irrelevant to a
    copy's speed, it costs only the pinning."""

    def __init__(self, pages: int, dtype: str, heads: int, page: int = 32, dim: int = 128):
        g = ArenaGeometry(1, heads, page, dim, dtype)
        raw = pinned_empty(pages * g.page_bytes, dtype=torch.uint8)
        self.layer, self.scales = (None if t is None else t[:, 0] for t in arena_views(raw, g, pages))
        self.chunk_bytes = g.page_bytes // heads
        self.kw = {} if self.scales is None else {"host_scales": self.scales}

    @property
    def pages(self) -> int:
        return self.layer.shape[0]


def pinned_empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, pin_memory=True)
