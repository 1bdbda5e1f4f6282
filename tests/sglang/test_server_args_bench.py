"""--kv-bench-correction-rate (benchmarks only): parsed into FreeKVConfig.replay_correction_rate, refused naming the
flag when out of range or given with LouisKV."""

import pytest

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, settings_from_argv


def test_the_rate_reaches_the_config():
    s = settings_from_argv(["--kv-retrieval", "freekv", "--kv-bench-correction-rate", "0.15"])
    assert s.config.replay_correction_rate == 0.15
    assert settings_from_argv(["--kv-retrieval", "freekv"]).config.replay_correction_rate is None


@pytest.mark.parametrize("argv", [
    ["--kv-retrieval", "freekv", "--kv-bench-correction-rate", "1.5"],
    ["--kv-retrieval", "freekv", "--kv-bench-correction-rate", "-0.1"],
    ["--kv-retrieval", "louiskv", "--kv-bench-correction-rate", "0.1"],
])
def test_refused_naming_the_flag(argv):
    with pytest.raises(FreeKVArgsError, match="--kv-bench-correction-rate"):
        settings_from_argv(argv)


def test_config_refuses_a_rate_for_louiskv_and_out_of_range():
    with pytest.raises(ValueError, match="LouisKV"):
        FreeKVConfig(retrieval="louiskv", replay_correction_rate=0.2)
    for bad in (True, "0.2", 2.0, float("nan")):
        with pytest.raises(ValueError, match="replay_correction_rate"):
            FreeKVConfig(replay_correction_rate=bad)
