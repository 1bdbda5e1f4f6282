"""--kv-host-dtype: FP8 host pages, parsed into FreeKVConfig, refused naming the flag with a KV cache it cannot
narrow, under either retrieval policy."""

import types

import pytest

from freekv_sglang.server_args import FreeKVArgsError, server_args_problems, settings_from_argv


@pytest.mark.parametrize("retrieval", ["freekv", "louiskv"])
def test_the_value_reaches_the_config(retrieval):
    s = settings_from_argv(["--kv-retrieval", retrieval, "--kv-host-dtype", "fp8_e4m3"])
    assert s.config.host_dtype == "fp8_e4m3"
    assert settings_from_argv(["--kv-retrieval", retrieval]).config.host_dtype == "auto"


def test_an_unknown_dtype_is_refused_naming_the_flag():
    with pytest.raises(FreeKVArgsError, match="--kv-host-dtype"):
        settings_from_argv(["--kv-retrieval", "freekv", "--kv-host-dtype", "fp8_e5m2"])


@pytest.mark.parametrize("kv_cache_dtype, refused", [("auto", False), ("bf16", False), ("bfloat16", False),
                                                     ("fp8_e4m3", True), ("fp8_e5m2", True), ("fp4_e2m1", True)])
def test_an_fp8_kv_cache_is_refused_naming_both_flags(kv_cache_dtype, refused):
    fp8 = settings_from_argv(["--kv-retrieval", "freekv", "--kv-host-dtype", "fp8_e4m3"])
    args = types.SimpleNamespace(disable_radix_cache=True, page_size=None, kv_cache_dtype=kv_cache_dtype)
    problems = [p for p in server_args_problems(args, fp8) if "--kv-host-dtype" in p]
    assert bool(problems) == refused
    if refused:
        assert f"--kv-cache-dtype is {kv_cache_dtype}" in problems[0]
    plain = settings_from_argv(["--kv-retrieval", "freekv"])
    assert not [p for p in server_args_problems(args, plain) if "--kv-host-dtype" in p]
    # the GPU's cache itself stays 16-bit with or without FP8 host pages
    for s in (fp8, plain):
        assert bool([p for p in server_args_problems(args, s) if p.startswith("drop --kv-cache-dtype")]) == refused
