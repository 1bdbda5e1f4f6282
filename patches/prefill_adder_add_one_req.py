"""Seam: AROUND sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req. Written against sglang 0.5.16.

The scheduler admits waiting requests into a prefill batch one by one: it matches a request against the prefix cache
(Req.init_next_round_input) and then asks the PrefillAdder to take it. Under FreeKV a cache hit's prefix must fit the
staging room; when it does not while other hits or prompts in prefill hold that room, the match asked to wait
(freekv_sglang.radix.PrefixSharing.deferred): the request is not admitted and the batch closes, as SGLang does for a
request that does not fit its token budget (AddReqResult.OTHER), so the request keeps its place in the queue and is
matched again next round with its whole prefix instead of prefilling most of it again. A request whose match stopped
short of a prompt's stashed chunk whose copies are still in flight (PrefixSharing.shares_in_flight) waits for them and
is matched again, if the batch has room for it (PrefillAdder.budget_state): else it would prefill that chunk again.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "req", "has_chunked_req", "truncation_align_size")
PURPOSE = ("leave a cache hit waiting (close the batch) while its prefix does not fit the staging room; match a "
           "request again once a chunk it shares has landed")


def hook(orig, self, req, has_chunked_req, truncation_align_size):
    from freekv_sglang.radix import active_sharing

    sharing = active_sharing()
    if sharing is None:
        return orig(self, req, has_chunked_req, truncation_align_size)
    from sglang.srt.managers.schedule_policy import AddReqResult

    if sharing.shares_in_flight(req) and self.budget_state() == AddReqResult.CONTINUE:
        sharing.await_in_flight(req)
        req.init_next_round_input(self.tree_cache)
    if sharing.deferred(req):
        return AddReqResult.OTHER
    return orig(self, req, has_chunked_req, truncation_align_size)
