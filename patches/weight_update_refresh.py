"""Seam: AROUND
sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager._observe_weight_load.
Written against sglang 0.5.16.

Every in-place weight update a scheduler runs (update_weights_from_disk, _distributed, _tensor and _ipc) happens inside
this context manager, once per TP rank. With --kv-early-weights fp8 the early correction projects from e4m3 copies
of each predicted layer's W_q (made in model_runner_post_pool); on leaving the update, whether it succeeded or rolled
back, each copy is re-derived from the model's present W_q, so the prediction never reads weights the model no longer
has. Without such copies (FreeKV off, or the model's own W_q) the context manager is returned unchanged.
"""

from __future__ import annotations

import contextlib
import logging

TARGET = ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
          "_observe_weight_load")
HOOK_TYPE = "AROUND"
PARAMS = ("self", "source")
PURPOSE = "re-derive --kv-early-weights fp8's W_q copies after a weight update"

logger = logging.getLogger("freekv_patches")


def hook(orig, self, source):
    manager = orig(self, source)
    runner = getattr(getattr(self, "tp_worker", None), "model_runner", None)
    if not getattr(runner, "_freekv_early_fp8", None):
        return manager
    return _refreshing(manager, runner, source)


@contextlib.contextmanager
def _refreshing(manager, runner, source: str):
    from .model_runner_post_pool import refresh_early_weights

    with manager:
        try:
            yield
        finally:
            n = refresh_early_weights(runner)
            logger.info("FreeKV: re-derived %d e4m3 W_q copies (--kv-early-weights fp8) after a weight update from %s",
                        n, source)
