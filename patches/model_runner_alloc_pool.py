"""Seam: BEFORE sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool. Written against sglang 0.5.16.

Every token SGLang admits also needs room in the kvstore arena once its request decodes (FreeKV offloads the
whole context there), and SGLang admits requests by the free space of its own token pool. So before the pool is
sized, its token budget (server_args.max_total_tokens, which KVCacheConfigurator applies as an upper bound) is
capped at what this rank's arena holds: SGLang then queues requests when the arena would be full instead of FreeKV
failing an allocation mid-decode. A request of n tokens holds ceil(n / page) pages in SGLang's pool (FreeKV sets
SGLang's page size to --kv-page-size) and fewer host pages (its sink pages stay on the GPU), so the cap is exact
enough to never overflow.
"""

from __future__ import annotations

import logging

from ._common import settings_of

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"
HOOK_TYPE = "BEFORE"
PARAMS = ("self", "memory_pool_config")
PURPOSE = "cap SGLang's token pool at the kvstore arena's capacity, so admission counts host memory"

logger = logging.getLogger("freekv_patches")


def hook(self, memory_pool_config=None):
    server_args = getattr(self, "server_args", None)
    settings = settings_of(server_args)
    if settings is None:
        return None
    from freekv_sglang.server_args import FreeKVArgsError, host_page_capacity

    tp = getattr(self, "tp_size", 1)
    mc = self.model_config
    pages = host_page_capacity(settings, num_layers=mc.num_hidden_layers, num_kv_heads=mc.get_num_kv_heads(tp),
                               head_dim=mc.head_dim, dtype_bytes=self.kv_cache_dtype.itemsize, tp_size=tp)
    cap = pages * settings.config.page_size
    if cap < 1:
        raise FreeKVArgsError(f"--kvstore-arena-gb {settings.kvstore_arena_gb:g} holds no KV page of this model; "
                              "pass a larger --kvstore-arena-gb")
    if server_args.max_total_tokens is None or server_args.max_total_tokens > cap:
        logger.info("FreeKV: SGLang's KV pool capped at %d tokens, what --kvstore-arena-gb %g holds (%d host pages "
                    "per rank); requests beyond it queue", cap, settings.kvstore_arena_gb, pages)
        server_args.max_total_tokens = cap
    return None
