"""Seam: AROUND
sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager._observe_weight_load.
Written against sglang 0.5.16.

Every in-place weight update a scheduler runs (update_weights_from_disk, _distributed, _tensor and _ipc) happens inside
this context manager, once per TP rank. With --kv-early-weights fp8 the early correction projects from e4m3 copies
of each predicted layer's W_q (made in model_runner_post_pool). On leaving an update, whether it succeeded or rolled
back, the copies are marked stale; the FreeKV backend re-derives them from the model's present W_q before its next
decode forward (EarlyQuery.refresh_weights), once however many updates came in between (an RL weight sync sends many
buckets). Without such copies (FreeKV off, or the model's own W_q) the context manager is returned unchanged.
"""

from __future__ import annotations

import contextlib

TARGET = ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
          "_observe_weight_load")
HOOK_TYPE = "AROUND"
PARAMS = ("self", "source")
PURPOSE = "mark --kv-early-weights fp8's W_q copies stale after a weight update"


def hook(orig, self, source):
    manager = orig(self, source)
    early = getattr(getattr(getattr(self, "tp_worker", None), "model_runner", None), "_freekv_early", None)
    if not getattr(early, "fp8_weights", None):
        return manager
    return _marking(manager, early)


@contextlib.contextmanager
def _marking(manager, early):
    with manager:
        try:
            yield
        finally:
            early.weights_stale = True
