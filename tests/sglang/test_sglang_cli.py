"""--kv-retrieval freekv through SGLang's own CLI parsing and ServerArgs: values, page size, pickling, refusals."""

import dataclasses
import os
import pickle
import subprocess
import sys
import time

import pytest

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FLAGS, FreeKVArgsError, FreeKVServerSettings

BASE = ["--model-path", "dummy"]
FREEKV = [*BASE, "--kv-retrieval", "freekv", "--disable-radix-cache"]


@pytest.fixture
def prepare(plugins):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args


def test_help_lists_every_flag():
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_KV_RETRIEVAL", "FREEKV_ARGS", "SGLANG_PLUGINS")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                         env=env, timeout=300)
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    for flag in FLAGS:
        assert flag in out.stdout, flag
    assert "{none,freekv,louiskv}" in out.stdout
    print(f"python -m sglang.launch_server --help: {elapsed:.1f} s")


def test_freekv_settings_reach_server_args(prepare):
    sa = prepare([*FREEKV, "--kv-budget", "1024", "--kv-sink", "64", "--kv-window", "256", "--kv-page-size", "64",
                  "--kv-correction-threshold", "0.8", "--kv-dense-layers", "2", "--kv-recall", "all",
                  "--kv-recall-programs", "64", "--kv-selection", "means", "--kv-rerank-factor", "8",
                  "--kvstore-arena-gb", "4", "--kvstore-timeout", "12.5"])
    want = FreeKVConfig(budget=1024, sink=64, window=256, page_size=64, tau=0.8, dense_layers=2, recall="all",
                        recall_programs=64, selection="means", rerank_factor=8)
    assert prepare([*FREEKV, "--kv-score-programs", "132"])._freekv.config.score_programs == 132
    assert prepare([*FREEKV, "--kv-recall-block", "8"])._freekv.config.recall_block == 8
    assert prepare([*FREEKV, "--kv-speculate-at", "next_recall"])._freekv.config.speculate_at == "next_recall"
    assert prepare([*FREEKV, "--kv-correct-at", "previous_mlp"])._freekv.config.correct_at == "previous_mlp"
    only = prepare([*FREEKV, "--kv-correct-at", "previous_mlp_only", "--kv-bench-correction-rate", "0.3"])
    assert (only._freekv.config.correct_at, only._freekv.config.replay_correction_rate) == ("previous_mlp_only", 0.3)
    early = prepare([*FREEKV, "--kv-correct-at", "previous_mlp", "--kv-bench-correction-rate", "0.3",
                     "--kv-bench-late-correction-rate", "0.05"])._freekv.config
    assert (early.replay_correction_rate, early.replay_late_rate) == (0.3, 0.05)
    assert prepare([*FREEKV])._freekv.config.attention == "fused"
    assert prepare([*FREEKV, "--kv-attention", "split"])._freekv.config.attention == "split"
    exact = prepare([*FREEKV, "--kv-attention", "backend", "--enable-deterministic-inference"])
    assert exact._freekv.config.attention == "backend" and exact.enable_deterministic_inference
    assert prepare([*FREEKV, "--kv-attention", "fused"])._freekv.config.attention == "fused"
    fp8 = prepare([*FREEKV, "--kv-correct-at", "previous_mlp_only", "--kv-early-weights", "fp8"])
    assert fp8._freekv.config.early_weights == "fp8"
    assert sa._freekv == FreeKVServerSettings(config=want, kvstore_endpoint=None, kvstore_arena_gb=4.0,
                                              kvstore_timeout_s=12.5)
    assert sa.page_size == 64
    assert sa.attention_backend == "triton"  # named for the user, before SGLang picks its own default
    back = pickle.loads(pickle.dumps(sa))  # what the scheduler processes receive
    assert back._freekv == sa._freekv and back.page_size == 64
    assert "_freekv" not in dataclasses.asdict(sa)  # /server_info does not change


def test_defaults_come_from_freekv_config(prepare):
    sa = prepare(FREEKV)
    assert sa._freekv.config == FreeKVConfig()
    assert sa._freekv.kvstore_endpoint is None and sa._freekv.kvstore_arena_gb == 16.0
    assert sa._freekv.kvstore_timeout_s == 5.0
    assert sa.page_size == FreeKVConfig().page_size


def test_matching_page_size_and_backend_are_kept(prepare):
    sa = prepare([*FREEKV, "--page-size", "32", "--attention-backend", "flashinfer",
                  "--kvstore-endpoint", "ipc:///tmp/x.sock"])
    assert sa.page_size == 32 and sa.attention_backend == "flashinfer"
    assert sa._freekv.kvstore_endpoint == "ipc:///tmp/x.sock"
    sa = prepare([*FREEKV, "--decode-attention-backend", "flashinfer", "--prefill-attention-backend", "triton"])
    assert sa.attention_backend is None  # the user named backends: nothing is set for them


def test_kv_retrieval_none_changes_nothing(prepare):
    plain = prepare(BASE)
    for argv in ([*BASE, "--kv-retrieval", "none"], [*BASE, "--kv-retrieval", "none", "--kv-budget", "64"],
                 [*BASE, "--kv-budget", "64"]):
        sa = prepare(argv)
        assert dataclasses.asdict(sa) == dataclasses.asdict(plain)
        assert "_freekv" not in vars(sa)
    assert plain.page_size is None and plain.attention_backend is None


REFUSED = [
    # (extra argv, flag the message must name)
    (["--page-size", "16"], "--page-size"),
    (["--kv-page-size", "64", "--page-size", "32"], "--page-size"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
    (["--enable-dp-attention"], "--enable-dp-attention"),
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    (["--enable-hisparse"], "--enable-hisparse"),
    (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
    (["--disaggregation-mode", "decode"], "--disaggregation-mode"),
    (["--pp-size", "2"], "--pp-size"),
    (["--attention-backend", "fa3"], "--attention-backend"),
    (["--attention-backend", "torch_native"], "--attention-backend"),
    (["--decode-attention-backend", "fa3"], "--decode-attention-backend"),
    (["--prefill-attention-backend", "fa3"], "--prefill-attention-backend"),
    (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
    (["--enable-torch-compile"], "--enable-torch-compile"),
    (["--enable-torch-compile", "--kv-correct-at", "previous_mlp_only"], "--enable-torch-compile"),
    (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill"),
    (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "--cuda-graph-backend-prefill"),
    (["--cuda-graph-backend-decode", "breakable"], "--cuda-graph-backend-decode"),
    (["--cuda-graph-config", '{"decode": {"backend": "breakable"}}'], "--cuda-graph-backend-decode"),
    (["--tokenizer-worker-num", "2"], "--tokenizer-worker-num"),
    (["--kv-budget", "100"], "--kv-budget"),
    (["--kv-budget", "0"], "--kv-budget"),
    (["--kv-sink", "-32"], "--kv-sink"),
    (["--kv-window", "0"], "--kv-window"),
    (["--kv-page-size", "24"], "--kv-page-size"),
    (["--kv-correction-threshold", "1.5"], "--kv-correction-threshold"),
    (["--kv-dense-layers", "-1"], "--kv-dense-layers"),
    (["--kv-recall-programs", "-1"], "--kv-recall-programs"),
    (["--kv-score-programs", "-1"], "--kv-score-programs"),
    (["--kv-recall-block", "6"], "--kv-recall-block"),
    (["--kv-rerank-factor", "-1"], "--kv-rerank-factor"),
    (["--kv-correct-at", "previous_mlp", "--kv-selection", "sketch"], "--kv-correct-at"),
    (["--kv-correct-at", "previous_mlp", "--kv-bench-correction-rate", "0.3"], "--kv-bench-late-correction-rate"),
    (["--kv-bench-correction-rate", "0.3", "--kv-bench-late-correction-rate", "0.05"], "--kv-correct-at"),
    (["--kv-correct-at", "previous_mlp", "--kv-prefill", "tsp", "--disable-radix-cache",
      "--chunked-prefill-size", "-1"], "--kv-correct-at"),
    (["--kv-early-weights", "fp8"], "--kv-early-weights"),  # without the correction one layer early
    # fused attention (the default) and split pick their splits by the batch: not batch-invariant
    (["--enable-deterministic-inference"], "--kv-attention backend"),
    (["--enable-deterministic-inference", "--kv-attention", "split"], "--kv-attention backend"),
    (["--enable-deterministic-inference", "--kv-attention", "fused"], "--kv-attention backend"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype"),  # the GPU cache stays 16-bit
    (["--kvstore-arena-gb", "0"], "--kvstore-arena-gb"),
    (["--kvstore-timeout", "1"], "--kvstore-timeout"),  # shorter than an embedded daemon's restart
    (["--kvstore-timeout", "nan"], "--kvstore-timeout"),
    (["--kvstore-endpoint", "http://host:1"], "--kvstore-endpoint"),
]


@pytest.mark.parametrize("extra,flag", REFUSED, ids=[" ".join(e) for e, _ in REFUSED])
def test_refused_with_the_flag_named(prepare, extra, flag):
    with pytest.raises(FreeKVArgsError) as e:
        prepare([*FREEKV, *extra])
    assert flag in str(e.value)


def test_radix_cache_is_served_but_not_across_tp_ranks(prepare):
    sa = prepare([*BASE, "--kv-retrieval", "freekv"])
    assert not sa.disable_radix_cache and sa._freekv.config == FreeKVConfig()
    with pytest.raises(FreeKVArgsError, match="pass --disable-radix-cache with --tp-size 2"):
        prepare([*BASE, "--kv-retrieval", "freekv", "--tp-size", "2"])


def test_every_problem_is_listed_at_once(prepare):
    with pytest.raises(FreeKVArgsError) as e:
        prepare([*BASE, "--kv-retrieval", "freekv", "--enable-mixed-chunk", "--pp-size", "2", "--tp-size", "2"])
    for flag in ("--disable-radix-cache", "--enable-mixed-chunk", "--pp-size"):
        assert flag in str(e.value)


def test_bad_choice_is_an_argparse_error(prepare):
    with pytest.raises(SystemExit):
        prepare([*BASE, "--kv-retrieval", "quest"])
    with pytest.raises(SystemExit):  # the harness's oracle is not servable
        prepare([*FREEKV, "--kv-selection", "oracle"])
