"""--kv-retrieval louiskv and its --kv-* knobs: parsed into FreeKVConfig, refused naming the flag, and refused by
the SGLang server (whose chunked prefill LouisKV's prompt clustering does not take yet)."""

import types

import pytest

from freekv_sglang.server_args import FreeKVArgsError, server_args_problems, settings_from_argv, settings_from_env


def test_louiskv_knobs_reach_the_config():
    s = settings_from_argv(["--kv-retrieval", "louiskv", "--kv-boundary-threshold", "0.85", "--kv-cluster-size", "8",
                            "--kv-segment", "64", "--kv-kmeans-iters", "4", "--kv-budget", "1024"])
    c = s.config
    assert (c.retrieval, c.boundary_tau, c.cluster_size, c.segment, c.kmeans_iters, c.budget) == \
        ("louiskv", 0.85, 8, 64, 4, 1024)
    assert settings_from_argv(["--kv-retrieval", "freekv"]).config.retrieval == "freekv"
    assert settings_from_env({"SGLANG_KV_RETRIEVAL": "louiskv"}).config.retrieval == "louiskv"


@pytest.mark.parametrize("argv, flag", [
    (["--kv-retrieval", "louiskv", "--kv-boundary-threshold", "1.5"], "--kv-boundary-threshold"),
    (["--kv-retrieval", "louiskv", "--kv-cluster-size", "12"], "--kv-cluster-size"),
    (["--kv-retrieval", "louiskv", "--kv-segment", "40"], "--kv-segment"),
    (["--kv-retrieval", "louiskv", "--kv-kmeans-iters", "0"], "--kv-kmeans-iters"),
    (["--kv-retrieval", "louiskv", "--kv-selection", "means"], "--kv-selection"),
    (["--kv-retrieval", "louiskv", "--kv-correction-threshold", "0.5"], "--kv-correction-threshold"),
    (["--kv-retrieval", "freekv", "--kv-cluster-size", "16"], "--kv-cluster-size"),
])
def test_refused_naming_the_flag(argv, flag):
    with pytest.raises(FreeKVArgsError, match=flag):
        settings_from_argv(argv)


def test_sglang_refuses_louiskv_for_now():
    args = types.SimpleNamespace(disable_radix_cache=True, page_size=None)
    problems = server_args_problems(args, settings_from_argv(["--kv-retrieval", "louiskv"]))
    assert len(problems) == 1 and "--kv-retrieval louiskv is not served by SGLang yet" in problems[0]
    assert not server_args_problems(args, settings_from_argv(["--kv-retrieval", "freekv"]))
