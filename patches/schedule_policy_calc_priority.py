"""Seam: AROUND sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority. Written against sglang 0.5.16.

Before building a prefill batch, SGLang's scheduling policy matches every waiting request against the prefix cache
(for cache-aware ordering, and for the load snapshot under FCFS), each with the request attached. Under FreeKV a match
with a request pins the arena's prefix and counts its pages against the staging room, so ranking a long queue would
hold staging for requests the scheduler then does not admit and cut the hits of those it does. While the policy ranks,
FreeKV's radix cache answers with the radix tree's match only (freekv_sglang.radix.PrefixSharing.ranking_pass); the
admission match of each request (Req.init_next_round_input) pins as before.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "waiting_queue", "running_batch")
PURPOSE = "rank waiting requests on the radix tree's matches only: no arena pins, no staging room taken"


def hook(orig, self, waiting_queue, running_batch=None):
    from freekv_sglang.radix import active_sharing

    sharing = active_sharing()  # None unless this process serves FreeKV with the radix cache
    if sharing is None:
        return orig(self, waiting_queue, running_batch)
    with sharing.ranking_pass():
        return orig(self, waiting_queue, running_batch)
