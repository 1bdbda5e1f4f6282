"""--kv-bench-correction-rate, --kv-bench-churn and --kv-bench-returns (benchmarks only): parsed into FreeKVConfig's
replay_correction_rate, replay_churn and replay_returns, refused naming the flag when out of range or given with
LouisKV; and --kv-victim, the victim cache the returns need."""

import pytest

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, settings_from_argv

BENCH = [("--kv-bench-correction-rate", "replay_correction_rate"), ("--kv-bench-churn", "replay_churn")]


@pytest.mark.parametrize("flag,field", BENCH)
def test_the_value_reaches_the_config(flag, field):
    s = settings_from_argv(["--kv-retrieval", "freekv", flag, "0.15"])
    assert getattr(s.config, field) == 0.15
    assert getattr(settings_from_argv(["--kv-retrieval", "freekv"]).config, field) is None


def test_both_together():
    s = settings_from_argv(["--kv-retrieval", "freekv", "--kv-bench-correction-rate", "0.3", "--kv-bench-churn", "0.1"])
    assert (s.config.replay_correction_rate, s.config.replay_churn) == (0.3, 0.1)


@pytest.mark.parametrize("flag,field", BENCH)
@pytest.mark.parametrize("retrieval,value", [("freekv", "1.5"), ("freekv", "-0.1"), ("louiskv", "0.1")])
def test_refused_naming_the_flag(flag, field, retrieval, value):
    with pytest.raises(FreeKVArgsError, match=flag):
        settings_from_argv(["--kv-retrieval", retrieval, flag, value])


@pytest.mark.parametrize("field", [field for _, field in BENCH])
def test_config_refuses_louiskv_and_out_of_range(field):
    with pytest.raises(ValueError, match="LouisKV"):
        FreeKVConfig(retrieval="louiskv", **{field: 0.2})
    for bad in (True, "0.2", 2.0, float("nan")):
        with pytest.raises(ValueError, match=field):
            FreeKVConfig(**{field: bad})


def test_victim_cache_and_returns():
    s = settings_from_argv(["--kv-retrieval", "freekv", "--kv-victim", "1024", "--kv-bench-churn", "0.15",
                            "--kv-bench-returns", "0.5"])
    assert (s.config.victim, s.config.victim_pages, s.config.replay_returns) == (1024, 32, 0.5)
    assert settings_from_argv(["--kv-retrieval", "freekv"]).config.victim == 0
    for argv, names in ((["--kv-bench-returns", "0.5", "--kv-bench-churn", "0.15"], "--kv-victim"),
                        (["--kv-bench-returns", "0.5", "--kv-victim", "1024"], "--kv-bench-churn"),
                        (["--kv-victim", "1000"], "victim"),
                        (["--kv-victim", "1024", "--kv-recall", "all"], "--kv-victim")):
        with pytest.raises(FreeKVArgsError, match=names):
            settings_from_argv(["--kv-retrieval", "freekv", *argv])
    with pytest.raises(FreeKVArgsError, match="--kv-bench-returns"):
        settings_from_argv(["--kv-retrieval", "louiskv", "--kv-bench-returns", "0.5"])


def test_the_replay_selection_is_refused_without_the_churn_replay():
    assert settings_from_argv(["--kv-retrieval", "freekv", "--kv-selection", "replay", "--kv-bench-churn",
                               "0.15"]).config.selection == "replay"
    with pytest.raises(FreeKVArgsError, match="--kv-bench-churn"):
        settings_from_argv(["--kv-retrieval", "freekv", "--kv-selection", "replay"])
