"""--kv-hysteresis: parsed into FreeKVConfig.hysteresis, refused naming the flag when negative, not finite, with
Quest's scores (logits, not attention masses) or with LouisKV."""

import pytest

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, settings_from_argv


def test_the_value_reaches_the_config():
    s = settings_from_argv(["--kv-retrieval", "freekv", "--kv-hysteresis", "1.5"])
    assert s.config.hysteresis == 1.5
    assert settings_from_argv(["--kv-retrieval", "freekv"]).config.hysteresis == FreeKVConfig().hysteresis


@pytest.mark.parametrize("argv", [
    ["--kv-retrieval", "freekv", "--kv-hysteresis", "-0.5"],
    ["--kv-retrieval", "freekv", "--kv-hysteresis", "inf"],
    ["--kv-retrieval", "freekv", "--kv-selection", "quest", "--kv-hysteresis", "1"],
    ["--kv-retrieval", "louiskv", "--kv-hysteresis", "1"],
])
def test_refused_naming_the_flag(argv):
    with pytest.raises(FreeKVArgsError, match="--kv-hysteresis"):
        settings_from_argv(argv)


def test_config_refuses_bad_values_and_other_scores():
    for bad in (True, "1", -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^hysteresis must be a finite number >= 0"):
            FreeKVConfig(hysteresis=bad)
    with pytest.raises(ValueError, match="not to quest"):
        FreeKVConfig(selection="quest", hysteresis=0.5)
    with pytest.raises(ValueError, match="not to louiskv"):
        FreeKVConfig(retrieval="louiskv", hysteresis=0.5)
    FreeKVConfig(selection="quest", hysteresis=0.0)
    for selection in ("sketch", "rerank", "means"):
        assert FreeKVConfig(selection=selection, hysteresis=2).hysteresis == 2


def test_default_applies_to_the_mass_selections_only():
    """Unset, FreeKV's sketch, rerank and means select with DEFAULT_HYSTERESIS; Quest, the oracle and LouisKV with
    none; a value given is used as given."""
    from freekv_sglang.config import DEFAULT_HYSTERESIS

    assert DEFAULT_HYSTERESIS > 0
    for selection in ("sketch", "rerank", "means"):
        assert FreeKVConfig(selection=selection).selection_hysteresis == DEFAULT_HYSTERESIS
        assert FreeKVConfig(selection=selection, hysteresis=0).selection_hysteresis == 0.0
    for cfg in (FreeKVConfig(selection="quest"), FreeKVConfig(selection="oracle"), FreeKVConfig(retrieval="louiskv")):
        assert cfg.selection_hysteresis == 0.0
    assert FreeKVConfig(selection="oracle", hysteresis=2).selection_hysteresis == 2.0
