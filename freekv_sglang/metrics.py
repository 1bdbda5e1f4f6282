"""FreeKV's Prometheus series, exported on SGLang's /metrics beside SGLang's own; off unless --enable-metrics.

SGLang's --enable-metrics runs prometheus_client in multiprocess mode: the launcher sets $PROMETHEUS_MULTIPROC_DIR
before any prometheus_client import (sglang's set_prometheus_multiproc_dir), every process (launcher, schedulers)
writes its series to mmap files there, and /metrics reads them all through
prometheus_client.multiprocess.MultiProcessCollector. FreeKV's series are plain prometheus_client Counters and
Gauges made in those same processes, named and labelled as SGLang's: the `sglang:` prefix, and

- in a scheduler process, the labels of that scheduler's SGLang series (model_name, engine_type, tp_rank, pp_rank,
  moe_ep_rank, and dp_rank / priority / --extra-metric-labels when SGLang adds them). freekv_patches turns them on
  (enable_scheduler_metrics) only where SGLang's scheduler series are on: rank 0 of the attention TP group, or every
  scheduler with --enable-metrics-for-all-schedulers;
- in the launcher (kvstore daemon restarts), model_name and engine_type (+ --extra-metric-labels), as SGLang's
  tokenizer series.

The engine's counters are read where FreeKV already logs them (FreeKVAttnBackend, every FREEKV_STATS_EVERY decode
steps, from a copy taken without a host sync and logged once it lands), never per step; the series therefore lag by
up to that many steps. The step timing below does synchronise the GPU when it is read.
Selection and recall time are sampled there too: with metrics on, the engine records timing events around the
selection and recall of 4 sparse layers spread over the depth, on the streams that run them, inside the captured
decode graph (StepTimer; timing every layer would cost ~10% of a one-request step), and each read observes the last
decode step's times, scaled to all sparse layers, in a histogram: one step in FREEKV_STATS_EVERY, not every step.

With metrics off nothing here imports prometheus_client or registers anything.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "sglang:freekv_"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PHASES = ("before_attention", "speculative")  # the `phase` label of the recall and timing series
# A step's selection or recall over all sparse layers: ~0.1 ms (1 request, little selecting) to tens of ms.
STEP_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

_lock = threading.Lock()
_scheduler_labels: dict[str, str] | None = None
_scheduler_series: SchedulerSeries | None = None
_restart_family: Any = None  # the launcher's Counter family


def enable_scheduler_metrics(labels: Mapping[str, object]) -> None:
    """Turn FreeKV's scheduler series on in this process, with the labels of SGLang's scheduler series here."""
    global _scheduler_labels
    _scheduler_labels = {str(k): str(v) for k, v in labels.items()}


def scheduler_metrics_enabled() -> bool:
    return _scheduler_labels is not None


def scheduler_series() -> SchedulerSeries | None:
    """This process's scheduler series (made on first use), or None while they are off."""
    global _scheduler_series
    if _scheduler_labels is None:
        return None
    with _lock:
        if _scheduler_series is None:
            if not _multiprocess_ready("scheduler"):
                return None
            _scheduler_series = SchedulerSeries(_scheduler_labels)
        return _scheduler_series


def count_aborted_requests(reason: str, n: int = 1) -> None:
    """Count requests FreeKV ended with an abort, by reason (freekv_sglang.kvstore_pool.HostPagesUnavailable.reason,
    e.g. kvstore_unreachable); a no-op while metrics are off."""
    series = scheduler_series()
    if series is not None and n:
        series.aborted_requests(reason).inc(n)


def _multiprocess_ready(where: str) -> bool:
    if os.environ.get(MULTIPROC_ENV):
        return True
    logger.warning("FreeKV metrics are on in the %s but $%s is not set, so /metrics could not see them: "
                   "not exporting them", where, MULTIPROC_ENV)
    return False


class SchedulerSeries:
    """The scheduler process's FreeKV series, each a child with SGLang's scheduler labels."""

    def __init__(self, labels: Mapping[str, str]):
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)

        def counter(name: str, doc: str, phase: bool = False):
            family = Counter(PREFIX + name, doc, labelnames=[*names, "phase"] if phase else names)
            if phase:
                return {p: family.labels(**labels, phase=p) for p in PHASES}
            return family.labels(**labels)

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, labelnames=names, multiprocess_mode="mostrecent").labels(**labels)

        self.decode_steps = counter("decode_steps_total", "Decode steps FreeKV's engine ran.")
        self.checks = counter("kv_head_checks_total",
                              "Query-similarity checks: (request, KV head, sparse layer) per decode step.")
        self.corrections = counter("kv_head_corrections_total",
                                   "Checks flagged (group-mean cosine below --kv-correction-threshold): the KV head is "
                                   "reselected and recalled before attention.")
        self.correction_rate = gauge("correction_rate",
                                     "Flagged checks / checks over the last FREEKV_STATS_EVERY decode steps.")
        self.recall_pages = counter("recall_pages_total",
                                    "Pages of one KV head in one layer (page_size tokens, K and V) recalled from host "
                                    "memory, by phase: before attention (corrections, empty slots) or speculatively "
                                    "after it.", phase=True)
        self.recall_bytes = counter("recall_bytes_total", "Bytes recalled from host memory, by phase.", phase=True)
        self.victim_hits = counter("victim_hits_total",
                                   "Pages of one KV head in one layer that a selection took back from the GPU's "
                                   "victim cache (--kv-victim) instead of recalling them from host memory, by phase.",
                                   phase=True)
        self.resident_pages = gauge("resident_pages",
                                    "GPU pages held per sparse layer by the engine's active requests (sink, "
                                    "selected, window and the page being filled; each page_size tokens of every KV "
                                    "head).")
        self.kvstore_used_pages = gauge("kvstore_used_pages", "Pages of this scheduler's kvstore arena in use.")
        self.kvstore_free_pages = gauge("kvstore_free_pages", "Pages of this scheduler's kvstore arena free.")

        def histogram(name: str, doc: str):
            family = Histogram(PREFIX + name, doc, labelnames=[*names, "phase"], buckets=STEP_SECONDS_BUCKETS)
            return {p: family.labels(**labels, phase=p) for p in PHASES}

        self.selection_seconds = histogram("selection_seconds",
                                           "Seconds a sampled decode step spent scoring pages and committing slots, "
                                           "over the sparse layers (4 timed, scaled), by phase (one step in "
                                           "FREEKV_STATS_EVERY; GPU only).")
        self.recall_seconds = histogram("recall_seconds",
                                        "Seconds a sampled decode step spent recalling pages from host memory, over "
                                        "the sparse layers (4 timed, scaled), by phase (one step in "
                                        "FREEKV_STATS_EVERY; GPU only).")
        aborted = Counter(PREFIX + "aborted_requests_total",
                          "Requests FreeKV ended with an abort because their host pages could not be had, by reason: "
                          "kvstore_unreachable, kvstore_version_mismatch, kvstore_session_lost, kvstore_arena_full, "
                          "kvstore_error.", labelnames=[*names, "reason"])
        self.aborted_requests = lambda reason: aborted.labels(**labels, reason=reason)


class EngineMetrics:
    """Feeds one engine's cumulative statistics (FreeKVEngine.stats()) into the scheduler series as deltas."""

    KEYS = ("steps", "checks", "flagged", "recall_pages_now", "recall_pages_speculative", "victim_hits_now",
            "victim_hits_speculative")

    def __init__(self, series: SchedulerSeries):
        self.series = series
        self._last = dict.fromkeys(self.KEYS, 0)

    def update(self, stats: Mapping[str, Any], *, resident_pages: int, arena_used_pages: int | None = None,
               arena_pages: int | None = None, step_times: Mapping[str, Mapping[str, float]] | None = None) -> None:
        """step_times: FreeKVEngine.step_times() (the sampled step), or None where the engine does not time."""
        s = self.series
        d = {k: int(stats[k]) - self._last[k] for k in self.KEYS}
        if any(v < 0 for v in d.values()):  # a new engine's counters (never expected in a server): start over
            d = {k: int(stats[k]) for k in self.KEYS}
        self._last = {k: int(stats[k]) for k in self.KEYS}
        s.decode_steps.inc(d["steps"])
        s.checks.inc(d["checks"])
        s.corrections.inc(d["flagged"])
        if d["checks"]:
            s.correction_rate.set(d["flagged"] / d["checks"])
        page_bytes = int(stats["recall_page_bytes"])
        for phase, key in zip(PHASES, ("now", "speculative")):
            s.recall_pages[phase].inc(d["recall_pages_" + key])
            s.recall_bytes[phase].inc(d["recall_pages_" + key] * page_bytes)
            s.victim_hits[phase].inc(d["victim_hits_" + key])
        s.resident_pages.set(resident_pages)
        if arena_used_pages is not None and arena_pages is not None:
            s.kvstore_used_pages.set(arena_used_pages)
            s.kvstore_free_pages.set(arena_pages - arena_used_pages)
        if step_times:
            for kind, series in (("selection", s.selection_seconds), ("recall", s.recall_seconds)):
                for phase, seconds in step_times.get(kind, {}).items():
                    series[phase].observe(seconds)


def engine_metrics() -> EngineMetrics | None:
    """An EngineMetrics for a new engine of this process, or None while the scheduler series are off."""
    series = scheduler_series()
    return None if series is None else EngineMetrics(series)


def watch_kvstore_restarts(handle: Any, labels: Mapping[str, object]) -> Callable[[int], None] | None:
    """Export the restarts of an embedded kvstore daemon (handle: freekv_kvstore.EmbeddedKVStore, supervised in this
    process) as sglang:freekv_kvstore_restarts_total with labels. Returns the listener it added, or None when
    prometheus_client is not in multiprocess mode here."""
    global _restart_family
    labels = {str(k): str(v) for k, v in labels.items()}
    with _lock:
        if not _multiprocess_ready("launcher"):
            return None
        if _restart_family is None:
            from prometheus_client import Counter

            _restart_family = Counter(PREFIX + "kvstore_restarts_total",
                                      "Restarts of the embedded kvstore daemon after it died (its pages and page "
                                      "tables are re-adopted).", labelnames=list(labels))
        child = _restart_family.labels(**labels)
    seen = [0]
    seen_lock = threading.Lock()

    def on_restart(restarts: int) -> None:
        with seen_lock:
            if restarts > seen[0]:
                child.inc(restarts - seen[0])
                seen[0] = restarts

    handle.add_restart_listener(on_restart)
    on_restart(handle.restarts)  # any restart before the listener was in place
    return on_restart
