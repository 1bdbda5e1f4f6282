"""FreeKVConfig: defaults, every refusal names its field, derived page counts, check_model."""

import dataclasses
import math

import pytest

from freekv_sglang.config import FreeKVConfig


def test_defaults_are_valid():
    c = FreeKVConfig()
    assert (c.budget, c.sink, c.window, c.page_size, c.tau, c.dense_layers) == (2048, 128, 512, 32, 0.9, 1)
    assert (c.sink_pages, c.select_pages, c.window_pages) == (4, 64, 16)
    # sink + selected slots + window ring (window + the page being filled)
    assert c.resident_pages == 4 + 64 + 16 + 1


def test_frozen():
    c = FreeKVConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.budget = 4096


@pytest.mark.parametrize("page_size", [1, 2, 16, 32, 64, 128])
def test_power_of_two_page_sizes_accepted(page_size):
    c = FreeKVConfig(budget=4 * page_size, sink=page_size, window=2 * page_size, page_size=page_size,
                     selection="rerank" if page_size >= 16 else "means")
    assert (c.select_pages, c.sink_pages, c.window_pages) == (4, 1, 2)
    assert c.resident_pages == 1 + 4 + 2 + 1


def test_derived_page_counts():
    c = FreeKVConfig(budget=1024, sink=0, window=64, page_size=16)
    assert (c.sink_pages, c.select_pages, c.window_pages, c.resident_pages) == (0, 64, 4, 69)


@pytest.mark.parametrize("page_size", [0, -32, 3, 24, 48, 100, 32.0, "32", None])
def test_bad_page_size_refused(page_size):
    with pytest.raises(ValueError, match="page_size"):
        FreeKVConfig(page_size=page_size)


@pytest.mark.parametrize("field", ["budget", "sink", "window"])
@pytest.mark.parametrize("value", [16, 33, 2047 + 32, -32, 64.0, "64", None])
def test_sizes_must_be_whole_pages(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a non-negative multiple of page_size=32"):
        FreeKVConfig(**{field: value})


def test_sizes_checked_against_the_given_page_size():
    FreeKVConfig(budget=64, sink=16, window=16, page_size=16)
    with pytest.raises(ValueError, match="sink"):
        FreeKVConfig(budget=128, sink=16, window=64, page_size=64)


def test_sink_may_be_zero():
    assert FreeKVConfig(sink=0).sink_pages == 0


def test_budget_zero_refused():
    with pytest.raises(ValueError, match="^budget must be at least one page"):
        FreeKVConfig(budget=0)


def test_window_zero_refused():
    with pytest.raises(ValueError, match="^window must be at least one page"):
        FreeKVConfig(window=0)


@pytest.mark.parametrize("tau", [0, 0.0, 0.5, 1, 1.0])
def test_tau_in_unit_interval_accepted(tau):
    assert FreeKVConfig(tau=tau).tau == tau


@pytest.mark.parametrize("tau", [-0.01, 1.01, 2, -1, math.nan, math.inf, -math.inf, True, False, "0.9", None])
def test_bad_tau_refused(tau):
    with pytest.raises(ValueError, match="^tau must be a number in"):
        FreeKVConfig(tau=tau)


@pytest.mark.parametrize("dense_layers", [0, 1, 30])
def test_dense_layers_accepted(dense_layers):
    assert FreeKVConfig(dense_layers=dense_layers).dense_layers == dense_layers


@pytest.mark.parametrize("dense_layers", [-1, 1.0, "1", None])
def test_bad_dense_layers_refused(dense_layers):
    with pytest.raises(ValueError, match="^dense_layers must be a non-negative integer"):
        FreeKVConfig(dense_layers=dense_layers)


def test_replace_revalidates():
    c = FreeKVConfig()
    assert dataclasses.replace(c, budget=4096).select_pages == 128
    with pytest.raises(ValueError, match="budget"):
        dataclasses.replace(c, budget=100)


# --- check_model -------------------------------------------------------------------------------


def test_check_model_accepts_real_shapes():
    c = FreeKVConfig()
    c.check_model(num_layers=30, num_q_heads=9, num_kv_heads=3)  # SmolLM2-135M
    c.check_model(num_layers=32, num_q_heads=32, num_kv_heads=8)  # Llama-3.1-8B
    c.check_model(num_layers=28, num_q_heads=28, num_kv_heads=4)  # Qwen2.5-7B
    c.check_model(num_layers=32, num_q_heads=32, num_kv_heads=32)  # MHA: group size 1


def test_check_model_dense_layers_may_cover_all_layers():
    FreeKVConfig(dense_layers=30).check_model(num_layers=30, num_q_heads=9, num_kv_heads=3)


@pytest.mark.parametrize("q, kv", [(9, 2), (8, 3), (3, 9), (9, 0), (9, -3)])
def test_check_model_refuses_bad_head_ratio(q, kv):
    with pytest.raises(ValueError, match=r"query heads \(\d+\) must be a multiple of KV heads"):
        FreeKVConfig().check_model(num_layers=30, num_q_heads=q, num_kv_heads=kv)


def test_check_model_refuses_too_many_dense_layers():
    with pytest.raises(ValueError, match="^dense_layers=31 exceeds the model's 30 layers"):
        FreeKVConfig(dense_layers=31).check_model(num_layers=30, num_q_heads=9, num_kv_heads=3)


@pytest.mark.parametrize("field", ["page_size", "budget", "sink", "window", "dense_layers", "recall_programs",
                                   "recall_block", "score_programs"])
def test_bool_is_not_an_integer(field):
    with pytest.raises(ValueError, match=field):
        FreeKVConfig(**{field: True})


def test_recall_modes():
    assert FreeKVConfig(recall="all").recall == "all"
    with pytest.raises(ValueError, match="recall must be one of delta, all"):
        FreeKVConfig(recall="some")


def test_recall_programs():
    assert FreeKVConfig(recall_programs=0).recall_programs == 0  # one program per page
    for bad in (-1, 2.0, "8"):
        with pytest.raises(ValueError, match="^recall_programs must be a non-negative integer"):
            FreeKVConfig(recall_programs=bad)


def test_recall_block():
    assert FreeKVConfig().recall_block == 0  # one program per slot
    assert FreeKVConfig(recall_block=8).recall_block == 8
    for bad in (-1, 3, 2.0, "8"):
        with pytest.raises(ValueError, match="^recall_block must be 0 or a power of two"):
            FreeKVConfig(recall_block=bad)


def test_score_programs():
    assert FreeKVConfig().score_programs == 0  # one program per item
    assert FreeKVConfig(score_programs=132).score_programs == 132
    for bad in (-1, 2.0, "8"):
        with pytest.raises(ValueError, match="^score_programs must be a non-negative integer"):
            FreeKVConfig(score_programs=bad)
    with pytest.raises(ValueError, match="not 'means'.s: drop --kv-score-programs or use --kv-selection channels"):
        FreeKVConfig(score_programs=64, selection="means")


def test_selection_knobs():
    assert FreeKVConfig().selection == "channels" and FreeKVConfig().rerank_factor == 2  # rerank: the sketch's best 2k
    assert FreeKVConfig().channel_count == 32 and FreeKVConfig(sketch_channels=64).channel_count == 64
    sketch = FreeKVConfig(selection="sketch")
    assert sketch.sketch_bytes(128) == 8 and sketch.sketch_bytes(16) == 4  # min(32, head dim) / 4
    assert FreeKVConfig(selection="sketch", sketch_channels=16).sketch_bytes(128) == 4
    # Which selections run the sketch (and so hold its picks): the sketch, the rerank of candidates, not rerank/0.
    assert sketch.sketches and FreeKVConfig(selection="rerank").sketches and not FreeKVConfig().sketches
    assert not FreeKVConfig(selection="rerank", rerank_factor=0).sketches and not FreeKVConfig(selection="means").sketches
    assert not FreeKVConfig(retrieval="louiskv").sketches
    assert FreeKVConfig(rerank_factor=4).rerank_pages == 4 * FreeKVConfig().select_pages
    with pytest.raises(ValueError, match="selection must be one of"):
        FreeKVConfig(selection="topk")
    with pytest.raises(ValueError, match="rerank_factor"):
        FreeKVConfig(rerank_factor=-1)
    with pytest.raises(ValueError, match="page_size must be at least 16 tokens for selection 'channels'"):
        FreeKVConfig(page_size=8, budget=64, sink=64, window=64)
    with pytest.raises(ValueError, match="page_size must be at least 16 tokens for selection 'sketch'"):
        FreeKVConfig(page_size=8, budget=64, sink=64, window=64, selection="sketch")
    with pytest.raises(ValueError, match="page_size must be at least 16 tokens for selection 'rerank'"):
        FreeKVConfig(page_size=8, budget=64, sink=64, window=64, selection="rerank")
    FreeKVConfig(page_size=8, budget=64, sink=64, window=64, selection="means")  # MeanS takes any page size
    for bad in (-4, 6, 2.0):
        with pytest.raises(ValueError, match="^sketch_channels must be 0"):
            FreeKVConfig(sketch_channels=bad)
    with pytest.raises(ValueError, match="sketch_channels=32 exceeds the model's head dim 16: lower --kv-sketch-channels"):
        FreeKVConfig(sketch_channels=32, selection="sketch").check_model(num_layers=2, num_q_heads=4, num_kv_heads=2,
                                                                          head_dim=16)
    FreeKVConfig(sketch_channels=32, selection="means").check_model(2, 4, 2, 16)  # no sketch, nothing to fit
    FreeKVConfig(selection="sketch").check_model(2, 4, 2, 16)  # the sketch's default fits: min(32, head dim)
    # The channel sketch codes 32 channels at least: a smaller head dim needs another selection.
    with pytest.raises(ValueError, match="codes 32 key channels, more than the model's head dim 16: pick another "
                                         "--kv-selection"):
        FreeKVConfig().check_model(2, 4, 2, 16)
    with pytest.raises(ValueError, match="codes 128 key channels, more than the model's head dim 64: lower "
                                         "--kv-sketch-channels"):
        FreeKVConfig(sketch_channels=128).check_model(2, 4, 2, 64)
    FreeKVConfig().check_model(2, 4, 2, 32)


@pytest.mark.parametrize("head_dim", [8, 96, 80])
def test_check_model_refuses_head_dims_the_kernels_cannot_take(head_dim):
    with pytest.raises(ValueError, match=f"power-of-two head dim >= 16; this model's is {head_dim}"):
        FreeKVConfig().check_model(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=head_dim)
