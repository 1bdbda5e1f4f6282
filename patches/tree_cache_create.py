"""Seam: AROUND sglang.srt.mem_cache.registry.create_tree_cache. Written against sglang 0.5.16.

With FreeKV on and the radix cache on (no --disable-radix-cache), the scheduler's tree cache is FreeKV's
(patches/_radix_cache.py: SGLang's RadixCache with hits cut to the kvstore arena's retained prefixes, and finished
requests exported there). Any other radix tree SGLang would pick here (hierarchical, hybrid, the experimental C++ or
unified trees) is refused, naming what to change.
"""

from __future__ import annotations

import os

from ._common import settings_of

TARGET = "sglang.srt.mem_cache.registry.create_tree_cache"
HOOK_TYPE = "AROUND"
PARAMS = ("ctx",)
PURPOSE = "build FreeKV's radix cache (hits cut to the kvstore's retained prefixes) when the radix cache is on"

_OTHER_TREES = ("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "SGLANG_ENABLE_UNIFIED_RADIX_TREE")


def hook(orig, ctx):
    if settings_of(ctx.server_args) is None or ctx.disable_radix_cache:
        return orig(ctx)
    from freekv_sglang.server_args import FreeKVArgsError

    from ._radix_cache import radix_cache_class

    problems = [f"unset ${name}" for name in _OTHER_TREES if os.environ.get(name, "").lower() in ("1", "true")]
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        problems.append("the model needs a hybrid radix tree")
    if ctx.enable_hierarchical_cache or ctx.server_args.radix_cache_backend:
        problems.append("drop --enable-hierarchical-cache / --radix-cache-backend")
    if problems:
        raise FreeKVArgsError("FreeKV's radix cache cannot be built (or pass --disable-radix-cache): "
                              + "; ".join(problems))
    return radix_cache_class()(ctx.params)
