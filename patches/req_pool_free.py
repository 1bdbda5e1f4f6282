"""Seam: BEFORE sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free. Written against sglang 0.5.16.

Every finished, aborted or retracted request gives its req_to_token slot back through ReqToTokenPool.free(req)
(mem_cache/common.py release_kv_cache, the scheduler's retraction and chunked paths). Before the slot is freed,
freekv_sglang.sglang_backend.on_request_freed(req.req_pool_idx) lets FreeKV drop the request's per-slot state.
Only pools of a FreeKV ModelRunner are marked (model_runner_post_pool.py sets pool._freekv_enabled).
"""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free"
HOOK_TYPE = "BEFORE"
PARAMS = ("self", "req")
PURPOSE = "tell FreeKV a request slot is freed (on_request_freed(req_pool_idx))"


def hook(self, req):
    if getattr(self, "_freekv_enabled", False) and getattr(req, "req_pool_idx", None) is not None:
        from freekv_sglang.sglang_backend import on_request_freed

        on_request_freed(req.req_pool_idx)
    return None
