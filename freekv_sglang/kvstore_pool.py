"""The engine's host pool backed by the kvstore daemon's shared-memory arena."""

from __future__ import annotations

import torch

from freekv_kvstore import ArenaGeometry, KVStoreClient

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class KVStoreHostPool:
    """Pages come from the daemon (ALLOC/FREE per request); the GPU reads and writes the mapped arena."""

    def __init__(self, endpoint: str, *, num_layers: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, num_pages: int, rank: int, client_id: str, token: str | None = None,
                 timeout_s: float = 5.0):
        if dtype not in _DTYPES:
            raise ValueError(f"kvstore arenas hold {sorted(_DTYPES.values())}, not {dtype}")
        geom = ArenaGeometry(num_layers=num_layers, num_kv_heads=num_kv_heads, page_size=page_size,
                             head_dim=head_dim, dtype=_DTYPES[dtype])
        self.client = KVStoreClient.connect(endpoint, geometry=geom, num_pages=num_pages, rank=rank,
                                            client_id=client_id, token=token, timeout_s=timeout_s)
        self.arena = self.client.arena
        self.num_pages = self.client.num_pages
        # Pages this pool holds, counted from the daemon's answers (no call of its own: read by the metrics).
        self.used_pages = 0

    def alloc(self, owner: int, n: int) -> list[int]:
        pages = self.client.alloc(owner, n)
        self.used_pages += len(pages)
        return pages

    def free(self, owner: int) -> int:
        freed = self.client.free(owner)
        self.used_pages -= freed
        return freed

    def close(self) -> None:
        self.client.close()
