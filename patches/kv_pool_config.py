"""Seam: AROUND sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config. Written
against sglang 0.5.16.

SGLang sizes its token pool as GPU budget / (KV bytes of a token over all layers) and then derives
max_running_requests. Under FreeKV a token costs GPU memory only in the dense layers; the sparse layers need
staging for the prefill in flight and, per request slot, the engine's resident pages. So FreeKV resolves the
config itself (freekv_sglang.memory_plan): the token pool holds what this rank's kvstore arena holds (capped by
--max-total-tokens), so admission counts host memory and requests beyond it queue; max_running_requests is what
the GPU has room for (capped by --max-running-requests). The plan is kept for the pool build
(patches/kv_pool_build.py) in server_args._freekv_plan.
"""

from __future__ import annotations

import logging

from ._common import settings_of

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "pre_model_load_memory")
PURPOSE = "size SGLang's pools for FreeKV: tokens from the kvstore arena, request slots from the GPU"

logger = logging.getLogger("freekv_patches")


def hook(orig, self, pre_model_load_memory, *args, **kwargs):
    sa = self.server_args
    settings = settings_of(sa)
    if settings is None:
        return orig(self, pre_model_load_memory, *args, **kwargs)
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    from freekv_sglang.engine import ModelShape
    from freekv_sglang.memory_plan import plan_memory
    from freekv_sglang.server_args import host_page_capacity

    mc, tp = self.model_config, sa.tp_size
    shape = ModelShape(mc.num_hidden_layers, mc.num_attention_heads // tp, mc.get_num_kv_heads(tp), mc.head_dim)
    dtype_bytes = self.kv_cache_dtype.itemsize
    host_pages = host_page_capacity(settings, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                                    head_dim=shape.head_dim, kv_dtype=self.kv_cache_dtype, tp_size=tp)
    plan = plan_memory(self._profile_available_bytes(pre_model_load_memory), cfg=settings.config, shape=shape,
                       dtype_bytes=dtype_bytes, host_pages=host_pages, context_len=mc.context_len,
                       prefill_tokens=max(sa.max_prefill_tokens or 0, sa.chunked_prefill_size or 0),
                       max_running_requests=sa.max_running_requests, max_total_tokens=sa.max_total_tokens,
                       hidden_size=mc.hidden_size if settings.config.early_weights == "fp8" else 0)
    sa._freekv_plan = plan  # the configurator has __slots__; the server args carry FreeKV state already
    logger.info("FreeKV memory plan: %s", plan.describe())
    return MemoryPoolConfig(max_total_num_tokens=plan.tokens, max_running_requests=plan.max_requests,
                            mem_fraction_static=sa.mem_fraction_static)
