"""FreeKV's Prometheus series (freekv_sglang.metrics) on SGLang's /metrics, with a real multiprocess directory.

prometheus_client picks multiprocess mode when it is first imported, so each "server process" here is a fresh
interpreter started with $PROMETHEUS_MULTIPROC_DIR set, as SGLang's launcher sets it before its schedulers spawn:
two schedulers (tp_rank 0 and 1) feed engine-like statistics, and a launcher supervises a real embedded kvstore
daemon that is killed with kill -9 and restarted. /metrics is then SGLang's own endpoint
(sglang.srt.utils.common.add_prometheus_middleware on an ASGI app, called in this process).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from freekv_patches import _kvstore, scheduler_metrics_collector

MP_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABELS = {"model_name": "smollm2", "engine_type": "unified", "pp_rank": 0, "moe_ep_rank": 0}
PAGE_BYTES = 2 * 32 * 128 * 2  # one KV head's page of K and V: page 32, head dim 128, bf16

SCHEDULER = """
import json, sys
from freekv_sglang import metrics
labels, updates, aborted = json.loads(sys.argv[1])
metrics.enable_scheduler_metrics(labels)
engine = metrics.engine_metrics()
for stats, kw in updates:
    engine.update(stats, **kw)
for reason, n in aborted:
    metrics.count_aborted_requests(reason, n)
"""

LAUNCHER = """
import json, os, signal, sys, threading
from freekv_kvstore import start_embedded
from freekv_sglang import metrics
handle = start_embedded(arena_gb=0.01)
try:
    metrics.watch_kvstore_restarts(handle, json.loads(sys.argv[1]))
    back = threading.Event()
    handle.add_restart_listener(lambda n: back.set())  # called after the metric's listener
    os.kill(handle.pid, signal.SIGKILL)
    assert back.wait(20), "the embedded kvstore was not restarted"
finally:
    handle.stop()
"""

OFF = """
import sys
from types import SimpleNamespace
from freekv_sglang import metrics
from freekv_patches import _kvstore, scheduler_metrics_collector
# A FreeKV scheduler whose SGLang metrics are off (no --enable-metrics), and a launcher without --enable-metrics.
scheduler = SimpleNamespace(server_args=SimpleNamespace(_freekv=object()),
                            metrics_collector_context=SimpleNamespace(current_scheduler_metrics_enabled=False,
                                                                      collector=None))
scheduler_metrics_collector.hook(None, scheduler, 0, 0, None)
assert metrics.engine_metrics() is None and metrics.scheduler_series() is None
metrics.count_aborted_requests("kvstore_unreachable", 3)
_kvstore._STARTED[object()] = None
_kvstore.export_kvstore_restarts(SimpleNamespace(enable_metrics=False))
assert "prometheus_client" not in sys.modules, "FreeKV imported prometheus_client with metrics off"
"""


def stats(steps, checks, flagged, now, speculative, hits_now, hits_speculative):
    """What FreeKVEngine.stats() returns (the keys the metrics read, and the rest)."""
    return {"steps": steps, "checks": checks, "flagged": flagged, "recall_pages_now": now,
            "recall_pages_speculative": speculative, "recall_page_bytes": PAGE_BYTES,
            "victim_hits_now": hits_now, "victim_hits_speculative": hits_speculative,
            "recall_bytes_now": float(now * PAGE_BYTES), "recall_bytes_speculative": float(speculative * PAGE_BYTES),
            "correction_rate": {1: flagged / max(checks, 1)}, "mean_cosine": {1: 0.9}}


def run_process(code: str, mp_dir, *args) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (MP_ENV, "prometheus_multiproc_dir")}
    env[MP_ENV] = str(mp_dir)
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]


def scrape_sglang_metrics(monkeypatch, mp_dir) -> str:
    """GET /metrics from SGLang's own Prometheus route (what launch_server mounts with --enable-metrics)."""
    from fastapi import FastAPI
    from sglang.srt.utils.common import add_prometheus_middleware

    monkeypatch.setenv(MP_ENV, str(mp_dir))
    app = FastAPI()
    add_prometheus_middleware(app)
    sent: list[dict] = []

    async def call():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/metrics", "raw_path": b"/metrics", "root_path": "",
                 "query_string": b"", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(call())
    assert sent[0]["status"] == 200, sent[0]
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()


def freekv_samples(text: str):
    """{(sample name, labels): value} and {family name: type} of the sglang:freekv_ series in an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    samples, types = {}, {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("sglang:freekv_"):
            types[family.name] = family.type
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def key(name, labels, **extra):
    return (name, tuple(sorted({**{k: str(v) for k, v in labels.items()}, **extra}.items())))


def test_series_on_sglang_metrics_endpoint(tmp_path, monkeypatch):
    mp_dir = tmp_path / "prometheus"
    mp_dir.mkdir()
    rank0, rank1 = {**LABELS, "tp_rank": 0}, {**LABELS, "tp_rank": 1}
    # rank 0: two reports (the second carries the totals); rank 1: one report and three aborted requests
    s1, s2 = stats(512, 20480, 2048, 300, 5000, 40, 900), stats(1024, 40960, 3072, 420, 9000, 70, 2100)
    # rank 0's engine times its steps (a GPU): two sampled steps; rank 1's does not (step_times None)
    t1 = {"selection": {"before_attention": 0.0004, "speculative": 0.0021},
          "recall": {"before_attention": 0.0009, "speculative": 0.0030}}
    t2 = {"selection": {"before_attention": 0.0007, "speculative": 0.0019},
          "recall": {"before_attention": 0.0012, "speculative": 0.0061}}
    kw1 = dict(resident_pages=2 * 85, arena_used_pages=300, arena_pages=1000)
    kw2 = dict(resident_pages=3 * 85, arena_used_pages=450, arena_pages=1000)
    aborted = [["kvstore_unreachable", 2], ["kvstore_session_lost", 1]]
    run_process(SCHEDULER, mp_dir, json.dumps([rank0, [[s1, {**kw1, "step_times": t1}],
                                                        [s2, {**kw2, "step_times": t2}]], []]))
    run_process(SCHEDULER, mp_dir, json.dumps([rank1, [[s1, {**kw1, "step_times": None}]], aborted]))
    launcher = _kvstore.launcher_metric_labels(SimpleNamespace(served_model_name="smollm2", disaggregation_mode="null",
                                                               extra_metric_labels={"cluster": "a"}))
    assert launcher == {"model_name": "smollm2", "engine_type": "unified", "cluster": "a"}
    run_process(LAUNCHER, mp_dir, json.dumps(launcher))

    samples, types = freekv_samples(scrape_sglang_metrics(monkeypatch, mp_dir))
    n = "sglang:freekv_"
    # The timing histograms: rank 0's two samples per phase; rank 1 observed nothing.
    for kind in ("selection", "recall"):
        name = f"{n}{kind}_seconds"
        for phase in ("before_attention", "speculative"):
            seen = [t[kind][phase] for t in (t1, t2)]
            assert samples.pop(key(name + "_count", rank0, phase=phase)) == 2
            assert samples.pop(key(name + "_sum", rank0, phase=phase)) == pytest.approx(sum(seen))
            for le in ("0.0005", "0.001", "0.0025", "0.005", "+Inf"):
                got = samples.pop(key(name + "_bucket", rank0, phase=phase, le=le))
                assert got == sum(x <= float(le) for x in seen), (name, phase, le)
            assert samples.pop(key(name + "_count", rank1, phase=phase), 0) == 0
        for k in [k for k in samples if k[0].startswith(name)]:  # the other buckets, and rank 1's zeros
            assert k[0] == name + "_bucket" or dict(k[1])["tp_rank"] == "1", k
            samples.pop(k)
    want = {key(n + "kvstore_restarts_total", launcher): 1}
    for labels, (st, kw), rate in ((rank0, (s2, kw2), (3072 - 2048) / (40960 - 20480)),
                                   (rank1, (s1, kw1), 2048 / 20480)):
        want.update({
            key(n + "decode_steps_total", labels): st["steps"],
            key(n + "kv_head_checks_total", labels): st["checks"],
            key(n + "kv_head_corrections_total", labels): st["flagged"],
            key(n + "correction_rate", labels): rate,  # over the last report's interval
            key(n + "recall_pages_total", labels, phase="before_attention"): st["recall_pages_now"],
            key(n + "recall_pages_total", labels, phase="speculative"): st["recall_pages_speculative"],
            key(n + "recall_bytes_total", labels, phase="before_attention"): st["recall_pages_now"] * PAGE_BYTES,
            key(n + "recall_bytes_total", labels, phase="speculative"): st["recall_pages_speculative"] * PAGE_BYTES,
            key(n + "victim_hits_total", labels, phase="before_attention"): st["victim_hits_now"],
            key(n + "victim_hits_total", labels, phase="speculative"): st["victim_hits_speculative"],
            key(n + "resident_pages", labels): kw["resident_pages"],
            key(n + "kvstore_used_pages", labels): kw["arena_used_pages"],
            key(n + "kvstore_free_pages", labels): kw["arena_pages"] - kw["arena_used_pages"],
        })
    for reason, count in aborted:  # by reason, only where FreeKV aborted requests
        want[key(n + "aborted_requests_total", rank1, reason=reason)] = count
    assert samples == pytest.approx(want)
    counters = ["decode_steps", "kv_head_checks", "kv_head_corrections", "recall_pages", "recall_bytes",
                "victim_hits", "aborted_requests", "kvstore_restarts"]
    gauges = ["correction_rate", "resident_pages", "kvstore_used_pages", "kvstore_free_pages"]
    histograms = ["selection_seconds", "recall_seconds"]
    assert types == {**{n + c: "counter" for c in counters}, **{n + g: "gauge" for g in gauges},
                     **{n + h: "histogram" for h in histograms}}


def test_nothing_registered_with_metrics_off(tmp_path):
    mp_dir = tmp_path / "prometheus"
    mp_dir.mkdir()
    run_process(OFF, mp_dir)
    assert os.listdir(mp_dir) == []


def scheduler(freekv: bool, enabled: bool):
    collector = SimpleNamespace(labels={**LABELS, "tp_rank": 0, "dp_rank": 1}) if enabled else None
    ctx = SimpleNamespace(current_scheduler_metrics_enabled=enabled, collector=collector)
    return SimpleNamespace(server_args=SimpleNamespace(_freekv=object() if freekv else None),
                           metrics_collector_context=ctx)


def test_scheduler_hook_hands_over_sglang_labels(monkeypatch):
    import freekv_sglang.metrics as metrics

    seen = []
    monkeypatch.setattr(metrics, "enable_scheduler_metrics", seen.append)
    scheduler_metrics_collector.hook(None, scheduler(freekv=False, enabled=True), 0, 0, None)
    scheduler_metrics_collector.hook(None, scheduler(freekv=True, enabled=False), 0, 0, None)
    assert seen == []
    scheduler_metrics_collector.hook(None, scheduler(freekv=True, enabled=True), 0, 0, 1)
    assert seen == [{**LABELS, "tp_rank": 0, "dp_rank": 1}]


def test_launcher_exports_each_embedded_daemon_once(monkeypatch):
    import freekv_sglang.metrics as metrics

    watched = []
    monkeypatch.setattr(metrics, "watch_kvstore_restarts", lambda handle, labels: watched.append((handle, labels)))
    monkeypatch.setattr(_kvstore, "_STARTED", {"daemon": None})
    monkeypatch.setattr(_kvstore, "_EXPORTED", set())
    args = SimpleNamespace(enable_metrics=True, served_model_name="m", disaggregation_mode="null",
                           extra_metric_labels=None)
    monkeypatch.delenv(MP_ENV, raising=False)
    _kvstore.export_kvstore_restarts(args)  # before SGLang set up its Prometheus directory
    assert watched == []
    monkeypatch.setenv(MP_ENV, "/nonexistent")
    _kvstore.export_kvstore_restarts(SimpleNamespace(enable_metrics=False))
    assert watched == []
    _kvstore.export_kvstore_restarts(args)
    _kvstore.export_kvstore_restarts(args)
    assert watched == [("daemon", {"model_name": "m", "engine_type": "unified"})]
