"""benchmarks/trace_summary.py on a hand-made torch-profiler trace: GPU busy time merges overlapping kernels, and
the tables sum each name's time and calls in their groups."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import trace_summary  # noqa: E402


def test_summary_of_a_small_trace(tmp_path, capsys):
    def ev(cat, name, ts, dur, stream=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {"stream": stream}}
    events = [
        ev("python_function", "freekv_sglang/radix.py(1): export", 0, 10_000),
        ev("python_function", "other/lib.py(2): f", 0, 5_000),
        ev("cuda_runtime", "cudaDeviceSynchronize", 2_000, 3_000),
        ev("cuda_runtime", "cudaLaunchKernel", 1_000, 10),
        ev("cuda_driver", "cuLaunchKernelEx", 5_000, 2_500),  # waited for room in the launch queue
        ev("kernel", "_page_copy_kernel", 1_000, 2_000),
        ev("kernel", "_page_copy_kernel", 2_500, 2_000),  # overlaps the first: busy 1000..4500
        ev("kernel", "_fwd_kernel", 6_000, 1_000, stream=9),
        {"ph": "i", "name": "marker", "ts": 0},  # not a complete event: ignored
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert trace_summary.merged_busy([(1, 3), (2, 5), (6, 7)]) == 5
    sys.argv = ["trace_summary.py", str(path), "--steps", "2"]
    trace_summary.main()
    out = capsys.readouterr().out
    assert "CPU span 10.00 ms, GPU span 6.00 ms, GPU busy 4.50 ms" in out
    assert "    4.00      2  _page_copy_kernel" in out and "    1.00      1  _fwd_kernel" in out
    assert "    3.00      1  cudaDeviceSynchronize" in out and "cudaLaunchKernel" not in out  # a launch's usual µs
    assert "    2.50      1  cuLaunchKernelEx in freekv_sglang/radix.py(1): export" in out
    assert "   10.00      1  freekv_sglang/radix.py(1): export" in out and "other/lib.py" not in out
    # The sync ran inside export (other/lib.py also encloses it, but does not match --match).
    assert "    3.00      1  cudaDeviceSynchronize in freekv_sglang/radix.py(1): export" in out
    # Per stream and per step (2 steps): stream 7 busy 3.5 ms of the 6 ms span, stream 9 1 ms (0.5 per step).
    assert "GPU span 3.000 ms per step" in out
    assert "       7     1.750  58.3%      1.0  _page_copy_kernel 2.000" in out
    assert "       9     0.500  16.7%      0.5  _fwd_kernel 0.500" in out


def test_layer_split_of_a_small_trace(tmp_path, capsys):
    """benchmarks/trace_layers.py: one sparse layer (the first and last of each step are left out) split into its
    parts, and the kernel that runs through the idle time before the output projection."""
    import trace_layers

    def ev(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    def layer(t):
        return [ev("qkv_gemm", t, 20), ev("_query_similarity_kernel", t + 22, 5),
                ev("_select_slots_kernel", t + 30, 10), ev("_recall_pages_kernel", t + 41, 50), ev("BatchPrefillWithPagedKVCacheKernel", t + 100, 90),
                ev("MergeStatesKernel", t + 190, 4), ev("_channel_lse_kernel", t + 195, 40),
                ev("_recall_pages_kernel", t + 240, 300),  # speculative: not in the chain
                ev("o_gemm", t + 230, 15), ev("void cublasLt::splitKreduce_kernel<32, 16>", t + 246, 2),
                ev("gateup_gemm", t + 250, 80), ev("down_gemm", t + 335, 40)]

    events = [e for i in range(4) for e in layer(1000 * i)] + [ev("python", 0, 9, cat="python_function")]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    names = dict(qkv="qkv_gemm", oproj="o_gemm", gateup="gateup_gemm", down="down_gemm")
    rows, seen, overlap, inside = trace_layers.split_layers(trace_layers.load(str(path)), 3, names)
    assert rows == [dict(layer=1000, qkv=20, chain=73, chain_recall=50, attention=94, recalled=0, idle_before_oproj=36,
                         oproj=15, gate_up=80, down=40)]
    assert seen["_channel_lse_kernel"] == 1 and overlap["_channel_lse_kernel"] == 35
    # The chain's kernels (by stream: here every event's tid), not the speculative recall after attention.
    assert inside == {("_select_slots_kernel", 1): [10], ("_recall_pages_kernel", 1): [50]}
    # Unnamed, the projections are the first three GEMMs after the merge (the split-K reduction is not one), and the
    # QKV projection the GEMM right before the similarity check.
    assert trace_layers.split_layers(trace_layers.load(str(path)), 3, dict(qkv="qkv_gemm"))[0] == rows
    assert trace_layers.qkv_name(trace_layers.load(str(path))) == "qkv_gemm"
    assert trace_layers.split_layers(trace_layers.load(str(path)), 3, {})[0] == rows
    sys.argv = ["trace_layers.py", str(path), "--layers", "3", "--qkv", "qkv_gemm", "--oproj", "o_gemm", "--gateup",
                "gateup_gemm", "--down", "down_gemm"]
    trace_layers.main()
    out = capsys.readouterr().out
    assert "1 sparse layers" in out and "idle_before_oproj        36.0     36.0" in out
    assert "   1.00    50.0    50.0       1  _recall_pages_kernel" in out

    def split_layer(t):  # --kv-attention split: attend_kept beside the recall, then attend_recalled
        return [ev("qkv_gemm", t, 20), ev("_query_similarity_kernel", t + 22, 5),
                ev("_select_chain_kernel", t + 30, 10),
                ev("_recall_pages_kernel", t + 41, 50), ev("_attend_kept_kernel", t + 41, 70),
                ev("_attend_recalled_kernel", t + 115, 8), ev("_channel_lse_kernel", t + 124, 40),
                ev("_recall_pages_kernel", t + 170, 300), ev("o_gemm", t + 160, 15), ev("gateup_gemm", t + 180, 80),
                ev("down_gemm", t + 265, 40)]

    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [e for i in range(4) for e in split_layer(1000 * i)]}, f)
    rows, _, _, _ = trace_layers.split_layers(trace_layers.load(str(path)), 3, names)
    assert rows == [dict(layer=1000, qkv=20, chain=14, chain_recall=50, attention=82, recalled=8, idle_before_oproj=37,
                         oproj=15, gate_up=80, down=40)]


def test_layer_split_with_the_early_lane(tmp_path):
    """--kv-correct-at previous_mlp_only: the next layer's check, scoring, selection and recall run beside the MLP on
    a stream of their own (tid 2 here), after the predicted query's projection, a GEMM that must not be taken for the
    down projection (nor, preceding a similarity check, for the QKV projection that delimits layers)."""
    import trace_layers

    def ev(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    def layer(t):
        return [ev("qkv_gemm", t, 20), ev("_query_similarity_kernel", t + 22, 5),
                ev("_head_token_index_kernel", t + 28, 4), ev("BatchPrefillWithPagedKVCacheKernel", t + 40, 90),
                ev("MergeStatesKernel", t + 130, 4), ev("o_gemm", t + 140, 15), ev("gateup_gemm", t + 160, 80),
                ev("pred_q_gemm", t + 170, 20, tid=2), ev("_query_similarity_kernel", t + 192, 5, tid=2),
                ev("_channel_lse_kernel", t + 198, 20, tid=2), ev("_select_chain_kernel", t + 219, 15, tid=2),
                ev("down_gemm", t + 242, 40), ev("_recall_pages_kernel", t + 250, 30, tid=3),  # speculative
                ev("_recall_pages_kernel", t + 235, 60, tid=2)]

    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        # The step's first early lane (the first sparse layer's, beside the dense layer's MLP) precedes every layer.
        first = [ev("pred_q_gemm", -100, 20, tid=2), ev("_query_similarity_kernel", -78, 5, tid=2)]
        json.dump({"traceEvents": first + [e for i in range(4) for e in layer(1000 * i)]}, f)
    events = trace_layers.load(str(path))
    assert trace_layers.qkv_name(events) == "qkv_gemm"
    rows = trace_layers.split_layers(events, 3, {})[0]
    assert rows == [dict(layer=1000, qkv=20, chain=13, chain_recall=0, attention=94, recalled=0, idle_before_oproj=6,
                         oproj=15, gate_up=80, down=40, early_lane=135, early_past_mlp=13)]


def test_the_early_lanes_recall_is_the_one_the_next_attention_waits_for(tmp_path):
    """A replayed graph may run the early lane's recall on another stream than its check, and a later layer's
    speculative recall on the check's stream: the lane's recall is the one the next layer's attention waits for
    (session 53's trace read 190 / 122 µs from the first recall on the check's stream). Not a speculative recall
    that ends before that attention too (fewer programs), nor, with previous_mlp, the next layer's correction recall
    after its own similarity check."""
    import trace_layers

    def ev(name, ts, dur, tid=1, grid=None):
        e = {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
        if grid:
            e["args"] = {"grid": [grid, 1, 1]}
        return e

    def layer(t):
        return [ev("qkv_gemm", t, 20), ev("_query_similarity_kernel", t + 22, 5),
                ev("_recall_pages_kernel", t + 28, 8, grid=8192),  # previous_mlp's correction, after the check
                ev("_head_token_index_kernel", t + 36, 4), ev("BatchPrefillWithPagedKVCacheKernel", t + 40, 90),
                ev("MergeStatesKernel", t + 130, 4), ev("o_gemm", t + 140, 15), ev("gateup_gemm", t + 160, 80),
                ev("pred_q_gemm", t + 170, 20, tid=2), ev("_query_similarity_kernel", t + 192, 5, tid=2),
                ev("_channel_lse_kernel", t + 198, 20, tid=2), ev("_select_chain_kernel", t + 219, 15, tid=2),
                ev("down_gemm", t + 242, 40),
                ev("_recall_pages_kernel", t + 235, 60, tid=4, grid=8192),  # the lane's, one program a slot
                ev("_recall_pages_kernel", t + 260, 100, tid=3, grid=32),  # a speculative one, ending later
                ev("_recall_pages_kernel", t + 1030, 200, tid=2, grid=32)]  # a speculative one beside the next

    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [e for i in range(4) for e in layer(1000 * i)]}, f)
    rows = trace_layers.split_layers(trace_layers.load(str(path)), 3, {})[0]
    assert [(r["early_lane"], r["early_past_mlp"]) for r in rows] == [(135, 13)]
