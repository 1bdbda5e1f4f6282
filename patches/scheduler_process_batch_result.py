"""Seam: AROUND sglang.srt.managers.scheduler.Scheduler.process_batch_result. Written against sglang 0.5.16.

SGLang's scheduler processes each step's results here: it streams the step's tokens and, for every request the step
finished, calls the radix cache's cache_finished_req (release_kv_cache), which under FreeKV exports the request's full
pages to the kvstore arena and retains them (freekv_sglang.radix). With the radix cache on, the finished requests of
one step are exported together when this returns (PrefixSharing.batched_exports): one launch a layer and one device
synchronisation for all of them, after their tokens went out.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "batch", "result")
PURPOSE = "export the requests a step finishes together, once the step's results are processed"


def hook(orig, self, batch, result):
    from freekv_sglang.radix import active_sharing

    sharing = active_sharing()  # None unless this process serves FreeKV with the radix cache
    if sharing is None:
        return orig(self, batch, result)
    with sharing.batched_exports():
        return orig(self, batch, result)
