"""Seam: AROUND sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill. Written against sglang 0.5.16.

SGLang's scheduler builds the next prefill batch from its waiting queue here (get_next_batch_to_run). While the
kvstore cannot give this server host pages (its daemon unreachable past the deadline or of another protocol version,
or a lost session that cannot be opened anew), FreeKV answers every waiting request with an abort naming the daemon
and the cause (freekv_patches._aborts) instead of admitting it; the pool probes the daemon about once a second, so
requests are admitted again as soon as it answers. With --kv-prefill tsp, a request that asks for what TSP cannot give
(input-token logprobs or hidden states of a prompt longer than --kv-tsp-keep) is answered with an abort (400).
With the radix cache on, the prefix pins that matching took for
requests it did not admit are let go once the batch is built (freekv_sglang.radix).
"""

from __future__ import annotations

from ._aborts import reject_tsp_unservable, reject_waiting_requests
from ._common import settings_of, tsp_alone_of

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "running_batch")
PURPOSE = ("reject new requests with an abort while no kvstore can give host pages, or that --kv-prefill tsp cannot "
           "answer; let go of unadmitted requests' radix prefix pins")


def hook(orig, self, running_batch):
    settings = settings_of(getattr(self, "server_args", None))
    if settings is None:
        tsp = tsp_alone_of(getattr(self, "server_args", None))
        if tsp is not None and self.waiting_queue:
            reject_tsp_unservable(self, tsp.tsp_keep)
        return orig(self, running_batch)
    if self.waiting_queue:
        reject_waiting_requests(self)
    if self.waiting_queue and settings.config.prefill == "tsp":
        reject_tsp_unservable(self, settings.config.tsp_keep)
    plan = orig(self, running_batch)  # a NextBatchPlan in 0.5.16, not the batch
    from freekv_sglang.radix import active_sharing

    sharing = active_sharing()
    if sharing is not None:
        sharing.release_unadmitted(plan.batch_to_run)
    return plan
