"""Seam: AROUND sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool. Written against
sglang 0.5.16.

Builds FreeKV's token pool (patches/_staging_pool.py) instead of MHATokenToKVPool: full-size buffers for the
dense layers, the staging pages of the memory plan (patches/kv_pool_config.py) for the sparse layers.
"""

from __future__ import annotations

from ._common import settings_of

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "max_total_num_tokens", "mha_pool_class", "quant_method")
PURPOSE = "build FreeKV's token pool: dense layers full size, sparse layers staging pages only"


def hook(orig, self, *args, **kwargs):
    settings = settings_of(self.server_args)
    if settings is None:
        return orig(self, *args, **kwargs)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from ._staging_pool import staging_pool_class

    plan = getattr(self.server_args, "_freekv_plan", None)
    base = kwargs.get("mha_pool_class")
    if plan is None or base is not MHATokenToKVPool or args or kwargs.get("quant_method") is not None:
        raise RuntimeError(f"FreeKV cannot build its token pool here (plan {plan is not None}, pool class "
                           f"{getattr(base, '__name__', base)}, quantized {kwargs.get('quant_method') is not None})")
    cls = staging_pool_class(base)

    def pool_class(*a, **kw):
        return cls(*a, freekv_dense_layers=settings.config.dense_layers, freekv_staging_pages=plan.staging_pages,
                   **kw)

    return orig(self, **{**kwargs, "mha_pool_class": pool_class})
