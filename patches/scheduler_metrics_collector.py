"""Seam: AFTER sglang.srt.managers.scheduler.Scheduler.init_metrics_collector. Written against sglang 0.5.16.

Runs in every scheduler process while its Scheduler is built, before the model worker (and so the FreeKV attention
backend) exists. SGLang decides there whether this scheduler exports Prometheus series (--enable-metrics; only rank 0
of the attention TP group unless --enable-metrics-for-all-schedulers: metrics_collector_context.
current_scheduler_metrics_enabled) and with which labels (SchedulerMetricsCollector.labels: model_name, engine_type,
tp_rank, pp_rank, moe_ep_rank, and dp_rank, priority, --extra-metric-labels when set). With FreeKV on and SGLang's
scheduler series on here, FreeKV's scheduler series (freekv_sglang.metrics) are turned on with the same labels;
otherwise nothing happens (FreeKV imports no prometheus_client).
"""

from __future__ import annotations

from ._common import settings_of

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_metrics_collector"
HOOK_TYPE = "AFTER"
PARAMS = ("self", "tp_rank", "pp_rank", "dp_rank")
PURPOSE = "turn FreeKV's scheduler metrics on, with the labels of SGLang's, where SGLang's are on"


def hook(result, self, *args, **kwargs):
    if settings_of(getattr(self, "server_args", None)) is None:
        return None
    ctx = getattr(self, "metrics_collector_context", None)
    collector = getattr(ctx, "collector", None)
    if ctx is None or not ctx.current_scheduler_metrics_enabled or collector is None:
        return None
    from freekv_sglang.metrics import enable_scheduler_metrics

    enable_scheduler_metrics(collector.labels)
    return None
