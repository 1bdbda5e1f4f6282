"""Seam: AROUND sglang.srt.managers.scheduler.Scheduler.update_running_batch. Written against sglang 0.5.16.

SGLang's scheduler calls update_running_batch(batch) before every decode step: it filters finished requests,
retracts requests when the KV pool is short, then prepare_for_decode() sets up the step. Before it runs, FreeKV takes
from the kvstore the host pages each request's next token needs (FreeKVAttnBackend.reserve_decode), so the step itself
never waits on the daemon; a request that cannot get them (daemon unreachable past its deadline, its session and arena
lost, the arena full) is aborted and taken out of the batch here (freekv_patches._aborts), with SGLang's own abort
machinery, before it could decode on pages that are gone. The rest of the batch goes on.
"""

from __future__ import annotations

from ._aborts import abort_lost_decode_requests
from ._common import settings_of

TARGET = "sglang.srt.managers.scheduler.Scheduler.update_running_batch"
HOOK_TYPE = "AROUND"
PARAMS = ("self", "batch")
PURPOSE = "reserve each decode request's host pages for the step; abort the requests that cannot get them"


def hook(orig, self, batch):
    if settings_of(getattr(self, "server_args", None)) is not None and not batch.is_empty():
        abort_lost_decode_requests(self, batch)
    return orig(self, batch)
