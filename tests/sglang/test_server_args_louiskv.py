"""--kv-retrieval louiskv and its --kv-* knobs: parsed into FreeKVConfig, refused naming the flag; served by SGLang
with the radix cache off (a prompt's host pages are in its own cluster order, so they cannot be shared)."""

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
    (["--kv-retrieval", "louiskv", "--kv-speculate-at", "next_recall"], "--kv-speculate-at"),
    (["--kv-retrieval", "freekv", "--kv-cluster-size", "16"], "--kv-cluster-size"),
])
def test_refused_naming_the_flag(argv, flag):
    with pytest.raises(FreeKVArgsError, match=flag):
        settings_from_argv(argv)


def test_sglang_serves_louiskv_without_the_radix_cache():
    louiskv, freekv = (settings_from_argv(["--kv-retrieval", m]) for m in ("louiskv", "freekv"))
    off = types.SimpleNamespace(disable_radix_cache=True, page_size=None)
    assert not server_args_problems(off, louiskv) and not server_args_problems(off, freekv)
    on = types.SimpleNamespace(disable_radix_cache=False, page_size=None)
    problems = server_args_problems(on, louiskv)
    assert len(problems) == 1 and problems[0].startswith("pass --disable-radix-cache with --kv-retrieval louiskv")
    assert not server_args_problems(on, freekv)


def test_sglang_cli_refuses_louiskv_with_the_radix_cache(plugins):
    """Through SGLang's own parsing (the radix cache is its default); the refusal names the policy and the flag."""
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", "dummy", "--kv-retrieval", "louiskv"]
    with pytest.raises(FreeKVArgsError) as e:
        prepare_server_args(base)
    assert "--kv-retrieval louiskv cannot run" in str(e.value) and "pass --disable-radix-cache" in str(e.value)
    sa = prepare_server_args([*base, "--disable-radix-cache", "--kv-cluster-size", "8"])
    assert sa._freekv.config.retrieval == "louiskv" and sa._freekv.config.cluster_size == 8
