"""benchmarks/decode.py reads its memory and concurrency figures from the servers' own log lines. Fed the lines
kept from the H100 concurrency run, its parsers must give the figures that run recorded in decode.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "docs/results/concurrency-h100"
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode  # noqa: E402


@pytest.mark.parametrize("config", ["full", "freekv"])
def test_parsers_reproduce_the_recorded_run(config, tmp_path):
    result = json.loads((RUN / "decode.json").read_text())
    cell = next(c for c in result["cells"] if c["config"] == config)
    log = tmp_path / "server.log"
    log.write_text((RUN / f"server-{config}-lines.txt").read_text())
    memory = decode.memory_cell(log.read_text(), result["context"] + result["output_len"])
    assert memory == {k: cell[k] for k in memory}
    assert memory["max_concurrent"] == cell["batch"] == (22 if config == "freekv" else 13)
    sched = decode.scheduler_cell(log.read_text())
    assert sched == {"max_running": cell["batch"], "max_queued": 0, "cuda_graph": True, "retractions": 0}


def test_scheduler_cell_reads_only_after_the_offset(tmp_path):
    line = ("[t] Decode batch, #running-req: {}, #token: 9, token usage: 0.50, cuda graph: {}, gen throughput "
            "(token/s): 1.00, #queue-req: {}\n")
    log = tmp_path / "server.log"
    log.write_text(line.format(30, "True", 7))
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(line.format(3, "False", 1) + "KV cache pool is full. Retract requests.\n")
    assert decode.scheduler_cell(decode.log_since(log, offset)) == {"max_running": 3, "max_queued": 1,
                                                                    "cuda_graph": False, "retractions": 1}
    assert decode.scheduler_cell(decode.log_since(log, log.stat().st_size)) == {}


def test_batch_figures_flag_a_batch_that_never_decoded_together():
    """Four 128K prompts prefill one after another, each decoding 128 tokens in about 1.1 s: each request has
    finished before the next one's first token, so the decode span holds one request, not a batch of four."""
    def req(ttft, decode_s=1.1, n=128):
        return {"ttft_s": ttft, "latency_s": ttft + decode_s, "tpot_s": decode_s / (n - 1)}

    staggered = decode.batch_figures([req(20.1), req(35.8), req(51.5), req(67.2)], 128)
    assert staggered["decoding_together"] == 1
    together = decode.batch_figures([req(9.8), req(9.9), req(10.0, 1.3), req(10.1, 1.2)], 128)
    assert together["decoding_together"] == 4
    assert together["decode_s"] == round(10.0 + 1.3 - 10.1, 3) and together["ttft_s_p50"] == 9.95
    # The first prefill began late (5 s of queueing), then one prefill each ~1.2 s: the median TTFT hides which.
    late = decode.batch_figures([req(t) for t in (6.2, 8.6, 7.4, 9.9)], 128)
    assert late["ttft_first_s"] == 6.2 and late["ttft_gap_s"] == 1.2 and late["ttft_s_p50"] == 8.0


def test_step_timeline_finds_the_slow_steps_the_mean_hides():
    """Two requests decode 6 steps together once the later one's first token is out at 2.0 s: step 1 takes 50 ms
    (every selection recalled), step 4 20 ms, the others 10 ms. The earlier request's first token (at 1.0 s, before
    the span) belongs to no step; its step tokens arrive 1 ms after the later request's."""
    def req(first, lag=0.0):
        stamps, t = [first], 2.0 + lag
        for gap in (0.050, 0.010, 0.010, 0.020, 0.010, 0.010):
            t += gap
            stamps.append(t)
        return {"ttft_s": first, "latency_s": stamps[-1], "tpot_s": (stamps[-1] - first) / 6, "stamps_s": stamps}

    fig = decode.batch_figures([req(2.0), req(1.0, lag=0.001)], 7)
    assert fig["decoding_together"] == 2 and fig["step_ms"] == round(1000 * 0.111 / 6, 3)
    # The median of the two requests' gaps: step 1 is 50 and 51 ms, the others equal.
    assert fig["step_gaps_ms"] == [50.5, 10.0, 10.0, 20.0, 10.0, 10.0]
    assert fig["first_step_ms"] == 50.5 and fig["step_ms_p50"] == 10.0
    assert fig["slowest_steps"][:2] == [[1, 50.5], [2, 10.0]] and [4, 20.0] in fig["slowest_steps"]
    assert len(fig["slowest_steps"]) == 5
    assert "step_ms_p50" not in decode.batch_figures([{k: v for k, v in req(2.0).items() if k != "stamps_s"}], 7)


def test_memory_cell_counts_a_lone_requests_summaries(tmp_path):
    """The 128K FreeKV server of the sixth session: one request slot plus the padding slot, and page summaries for
    the whole 24 GB arena. Without the summaries' size in its line the engine's bytes are split over both slots;
    with it, the request gets one slot's pages and the summaries of its own 4067 pages of 5722."""
    lines = [line for line in (ROOT / "docs/results/decode-h200-session6/server-lines.txt").read_text().splitlines()
             if "183104" in line or "24.0 GB" in line]
    assert len(lines) == 3
    # SGLang's own pool line was not kept; the run's decode.json cell recorded 183104 tokens in 19.98 GB.
    lines.append("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 183104, K size: 9.99 GB, V size: 9.99 GB")
    context = 130000 + 128
    old = decode.memory_cell("\n".join(lines), context)
    assert old["kv_gb_per_request"] == round(0.75 / 183104 * context + 1.42 / 2, 4)
    new = decode.memory_cell("\n".join(lines).replace("2 request slots;", "2 request slots (page summaries 0.73 GB);"),
                             context)
    want = 0.75 / 183104 * context + (1.42 - 0.73) / 2 + 0.73 * 4067 / 5722
    assert new["kv_gb_per_request"] == round(want, 4) and 1.39 < want < 1.40


@pytest.mark.parametrize("given, batches, context, chunk, expected", [
    (0, [1, 16], 32000, 32768, 16),  # one chunk per prompt: the largest batch
    (0, [4], 120000, 32768, 5),  # chunked prompts: one slot more, or the 4th waits for another to finish
    (0, [1, 4], 32769, 32768, 5),
    (6, [4], 120000, 32768, 6),  # an explicit --max-running wins
])
def test_max_running_requests_leaves_a_slot_for_a_chunked_prompt(given, batches, context, chunk, expected):
    assert decode.max_running_requests(given, batches, context, chunk) == expected


DECODE = ("[t] Decode batch, #running-req: {}, #token: 9, token usage: 0.50, cuda graph: True, gen throughput "
          "(token/s): 1.00, #queue-req: 0")
STATS = ("[t] FreeKV rank 0: {} decode steps, correction rate 0.300 (layers 0.290..0.310), recall {:.2f} GB before "
         "attention + 0.50 GB speculative, victim cache {} + 20 pages; {} checks, {} flagged, {} + {} pages recalled")


def test_the_stats_line_the_server_logs_parses(caplog):
    """The counts FreeKV's backend logs come back from decode.STATS as logged, raw counts included."""
    from types import SimpleNamespace

    from freekv_sglang.sglang_backend import FreeKVAttnBackend

    st = {"steps": 64, "correction_rate": {1: 0.25, 2: 0.35}, "recall_bytes_now": 3e9, "recall_bytes_speculative": 5e9,
          "victim_hits_now": 7, "victim_hits_speculative": 11, "checks": 4096, "flagged": 1229,
          "recall_pages_now": 183105, "recall_pages_speculative": 305175, "flagged_early": 977}
    with caplog.at_level("INFO", logger="freekv_sglang.sglang_backend"):
        FreeKVAttnBackend._log_stats(SimpleNamespace(rank=0, radix=None, _metrics=None), st)
    found = decode.STATS.findall(caplog.text)
    assert [float(x) for x in found[0]] == [64, 0.3, 3.0, 5.0, 7, 11, 4096, 1229, 183105, 305175, 977]


def test_stats_are_logged_once_their_copies_land_oldest_first():
    """The backend takes its stats snapshots without a host sync and logs each once its copy has landed, in the
    order taken (decode.py differences the lines as logged), never waiting for one."""
    from types import SimpleNamespace

    from freekv_sglang.sglang_backend import FreeKVAttnBackend

    class Snapshot:  # a StatsSnapshot whose copy lands when the test says
        def __init__(self, steps):
            self.steps, self.landed = steps, False

        def ready(self):
            return self.landed

        def stats(self):
            assert self.landed, "read before its copy landed"
            return {"steps": self.steps}

    older, newer = Snapshot(32), Snapshot(64)
    logged = []
    backend = SimpleNamespace(_pending_stats=[[(older, 0)], [(newer, 0)]], _log_stats=logged.append)
    FreeKVAttnBackend._log_ready_stats(backend)
    newer.landed = True
    FreeKVAttnBackend._log_ready_stats(backend)
    assert logged == []  # the newer one waits behind the older
    older.landed = True
    FreeKVAttnBackend._log_ready_stats(backend)
    assert [st["steps"] for st in logged] == [32, 64] and backend._pending_stats == []


def test_engine_window_differences_the_lines_logged_while_the_whole_batch_decoded():
    """A cell of 4 requests: a stats line logged while 2 decoded (prefills still running) is left out, as is one in
    the old form without counts; the first and last lines after a decode line showing 4 give the window. A stats
    line of the cell before (the last one before this cell's text) is not in the text at all."""
    text = "\n".join([
        DECODE.format(2), STATS.format(16, 1.0, 0, 100, 30, 400, 500),
        DECODE.format(4), STATS.format(32, 2.0, 10, 300, 90, 1000, 1400),
        "[t] FreeKV rank 0: 40 decode steps, correction rate 0.300 (layers 0.290..0.310), recall 2.50 GB before "
        "attention + 0.50 GB speculative, victim cache 12 + 20 pages",
        STATS.format(48, 3.0, 30, 556, 166, 1600, 2200), DECODE.format(4),
        STATS.format(64, 4.0, 50, 812, 245, 2300, 3000), DECODE.format(1)])
    win = decode.engine_window(text, 4)
    assert win == {"window_checks": 512, "correction_rate": round(155 / 512, 4), "early_correction_rate": 0.0,
                   "recall_pages_per_check": round((1300 + 1600) / 512, 4),
                   "victim_pages_per_check": round(40 / 512, 4)}
    # --kv-correct-at previous_mlp: the lines end with the early corrections, differenced the same way.
    early = "\n".join(line + f", {n} flagged early" if "pages recalled" in line else line
                      for line, n in zip(text.splitlines(), [0, 7, 0, 20, 0, 40, 0, 75, 0]))
    assert decode.engine_window(early, 4)["early_correction_rate"] == round(55 / 512, 4)
    assert decode.engine_window(text, 2) == {}  # one line while 2 decoded
    assert decode.engine_window("\n".join(text.splitlines()[:4]), 4) == {}  # one counted line


def test_changed_share_and_recall_rate_per_request_layer_and_head_step():
    """Changed pages (recalled or from the victim cache) per check over the budget's pages; the recall's bytes per
    second: pages per check x batch x sparse layers x KV heads x a page's K and V in bf16 / the step time. The
    budget, page size and dense layers come from the server's flags."""
    llama = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
             "num_attention_heads": 32}
    qwen = {"num_hidden_layers": 28, "num_key_value_heads": 4, "hidden_size": 3584, "num_attention_heads": 28}
    flags = ["--kv-budget", "2048", "--kv-page-size", "32"]
    cell = {"recall_pages_per_check": 4.8, "victim_pages_per_check": 4.8, "batch": 16, "step_ms": 20.0}
    assert decode.changed_share(cell, flags) == 0.15  # 9.6 of 64 pages
    assert decode.changed_share(cell, ["--kv-budget", "4096", "--kv-page-size", "32"]) == 0.075
    assert decode.changed_share({"batch": 16}, flags) is None  # full KV: no window
    page = 2 * 32 * 128 * 2
    assert decode.recall_gbps(cell, flags, llama) == round(4.8 * 16 * 31 * 8 * page / 20e-3 / 1e9, 2)
    assert decode.recall_gbps(cell, [*flags, "--kv-dense-layers", "2"], llama) == round(4.8 * 16 * 30 * 8 * page
                                                                                         / 20e-3 / 1e9, 2)
    assert decode.recall_gbps(cell, flags, qwen) == round(4.8 * 16 * 27 * 4 * page / 20e-3 / 1e9, 2)
    assert decode.recall_gbps({**cell, "step_ms": None}, flags, llama) is None


def test_profile_starts_once_the_whole_batch_decodes(tmp_path):
    """--profile-steps: nothing is profiled while the log shows prefills or a partial batch decoding; the first
    decode line with the whole batch running starts SGLang's profiler for the asked steps, GPU activity only."""
    import http.server
    import threading
    import time

    posts = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            posts.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    log = tmp_path / "server.log"
    log.write_text("[2026-11-27 10:00:00] Decode batch, #running-req: 4, #token: 100\n")  # an earlier batch's
    offset = log.stat().st_size
    try:
        t = decode.profile_when_decoding(f"http://127.0.0.1:{srv.server_port}", log, offset, 4, 16, tmp_path / "tr")
        with open(log, "a") as f:
            f.write("[2026-11-27 10:00:01] Prefill batch, #new-seq: 1, #new-token: 8192\n"
                    "[2026-11-27 10:00:02] Decode batch [40], #running-req: 3, #token: 98304, token usage: 0.10\n")
        time.sleep(1.0)
        assert posts == [] and t.is_alive()
        with open(log, "a") as f:
            f.write("[2026-11-27 10:00:03] Decode batch [80], #running-req: 4, #token: 131072, token usage: 0.13\n")
        t.join(10)
    finally:
        srv.shutdown()
    assert posts == [("/start_profile", {"output_dir": str(tmp_path / "tr"), "num_steps": 16, "activities": ["GPU"],
                                       "with_stack": False})]


def test_triton_kernels_lists_one_entry_per_compiled_variant(tmp_path):
    """`jit` column: a Triton cache directory holds a folder per compiled variant with the kernel's metadata json
    (besides a __grp__ json and the binaries); two variants of one kernel count twice."""
    for entry, files in {"A1": ["_offload_pages_kernel.json", "__grp___offload_pages_kernel.json",
                                "_offload_pages_kernel.cubin"],
                         "B2": ["_offload_pages_kernel.json"], "C3": ["_plan_step_kernel.ttir"]}.items():
        (tmp_path / entry).mkdir()
        for f in files:
            (tmp_path / entry / f).write_text("{}")
    assert decode.triton_kernels(tmp_path) == {"A1/_offload_pages_kernel", "B2/_offload_pages_kernel"}


def test_jit_modules_lists_built_libraries_below_each_cache(tmp_path, monkeypatch):
    """`jit_modules` column: the shared libraries under FlashInfer's and tvm-ffi's caches, by root and path; sources,
    build files and a missing root list nothing."""
    fi, tvm = tmp_path / "home" / ".cache" / "flashinfer", tmp_path / "tvm"
    (fi / "0.6" / "90a" / "cached_ops" / "cascade").mkdir(parents=True)
    (fi / "0.6" / "90a" / "cached_ops" / "cascade" / "cascade.so").write_bytes(b"")
    (fi / "0.6" / "90a" / "cached_ops" / "cascade" / "cascade.cu").write_text("")
    (tvm / "clamp").mkdir(parents=True)
    (tvm / "clamp" / "clamp.so").write_bytes(b"")
    (tvm / "clamp" / "build.ninja").write_text("")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "home"))
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tvm))
    assert decode.jit_modules(decode.jit_caches()) == {"flashinfer/0.6/90a/cached_ops/cascade/cascade.so",
                                                       "tvm/clamp/clamp.so"}
    assert decode.jit_modules([tmp_path / "absent"]) == set()


@pytest.mark.parametrize("context, chunk, expected", [
    (32000, 32768, 4096),     # one chunk: the warm-up as asked
    (120000, 32768, 36864),   # chunked: one chunk more, so a chunk with a prefix runs
    (34000, 32768, 34000),    # never past the context
    (120000, -1, 4096),       # chunked prefill off
    (2000, 32768, 2000),
])
def test_warmup_runs_a_prefix_chunk_when_the_prompts_are_chunked(context, chunk, expected):
    assert decode.warmup_length(context, 4096, chunk) == expected


def test_recall_gbps_counts_the_host_dtype_bytes():
    """FP8 host pages carry 129 bytes a 128-wide row over the link, not bf16's 256."""
    model = {"head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 8}
    cell = {"batch": 16, "step_ms": 10.0, "recall_pages_per_check": 1.0}
    bf16 = decode.recall_gbps(cell, ["--kv-page-size", "32"], model)
    fp8 = decode.recall_gbps(cell, ["--kv-page-size", "32", "--kv-host-dtype", "fp8_e4m3"], model)
    assert bf16 == round(16 * 31 * 8 * 2 * 32 * 256 / 10.0 / 1e6, 2)
    assert fp8 == round(bf16 * 129 / 256, 2)
