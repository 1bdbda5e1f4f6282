"""tsp_select (FastKV token-selective propagation) against its torch reference."""

import math

import pytest
import torch

from freekv_kernels.testing import assert_close, device, poisoned_outputs
from freekv_kernels.tsp_select import WINDOW, naive_tsp_scores, naive_tsp_select, pick_tokens, tsp_scores, tsp_select


def make_inputs(n, H, G, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(WINDOW, H * G, D, generator=g)
    k = torch.randn(n, H, D, generator=g)
    return q.to(dtype).to(device()), k.to(dtype).to(device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,H,G,D", [(301, 2, 1, 64), (130, 3, 3, 64), (517, 2, 4, 128), (259, 1, 8, 64)])
def test_scores_match_reference(n, H, G, D, dtype):
    """Odd lengths: several key tiles, a window straddling a tile boundary (n=130), GQA groups 1/3/4/8."""
    q, k = make_inputs(n, H, G, D, dtype, seed=n + G)
    scale = 1 / math.sqrt(D)
    with poisoned_outputs():
        out = tsp_scores(q, k, scale)
    ref = naive_tsp_scores(q, k, scale)
    assert_close("scores", ref, out, atol=1e-6, rtol=1e-4 if dtype == torch.float32 else 2e-3)
    assert abs(float(out.sum()) - float(ref.sum())) < 1e-3


@pytest.mark.parametrize("n,G,keep", [(301, 1, 64), (517, 4, 100), (259, 8, 250), (133, 3, 17)])
def test_selection_matches_reference(n, G, keep):
    q, k = make_inputs(n, 2, G, 64, torch.float32, seed=7 * n + G)
    scale = 0.125
    ref = naive_tsp_select(q, k, keep, scale)
    # The seeded inputs keep the pooled scores at the cut clear of fp32 rounding, so the two picks must agree.
    pooled = torch.nn.functional.avg_pool1d(naive_tsp_scores(q, k, scale)[None, None], 7, 1, 3)[0, 0]
    top = pooled.sort(descending=True).values
    assert top[keep - WINDOW - 1] - top[keep - WINDOW] > 1e-6
    with poisoned_outputs():
        out = tsp_select(q, k, keep, scale)
    assert_close("indices", ref, out)
    assert out.numel() == keep and torch.equal(out, out.sort().values) and out.unique().numel() == keep
    assert torch.equal(out[-WINDOW:].cpu(), torch.arange(n - WINDOW, n))


def test_ties_pick_earliest_positions():
    """Zero keys: every token before the window gets the same attention; the pool's zero padding lowers the first
    and last 3, so the pick is the interior's earliest positions, identically in both."""
    n, keep = 200, 40
    q = torch.randn(WINDOW, 4, 64, device=device())
    k = torch.zeros(n, 2, 64, device=device())
    want = torch.cat([torch.arange(3, 3 + keep - WINDOW), torch.arange(n - WINDOW, n)])
    for fn in (naive_tsp_select, tsp_select):
        assert torch.equal(fn(q, k, keep, 0.125).cpu(), want)


def test_needle_propagates():
    """A key that every window query attends to strongly (and its pooled neighbours) is selected."""
    q, k = make_inputs(400, 2, 4, 64, torch.float32, seed=3)
    k[123] = q[:, ::4].float().mean(0) * 4  # aligned with every group's first query head
    out = tsp_select(q, k, 24, 0.125)
    assert 123 in out.tolist()


def test_short_prompt_and_bad_keep():
    q, k = make_inputs(20, 2, 2, 64, torch.float32, seed=0)
    assert torch.equal(tsp_select(q, k, 20, 0.125).cpu(), torch.arange(20))
    with pytest.raises(ValueError, match="must exceed the observation window"):
        tsp_select(q, k, WINDOW, 0.125)
    with pytest.raises(ValueError, match="odd kernel"):
        naive_tsp_select(q, k, 16, 0.125, pool=4)


def test_pick_tokens_takes_window_and_best():
    scores = torch.zeros(20)
    scores[5] = 7.0
    out = pick_tokens(scores, 28, 11, WINDOW, 7)
    assert out.tolist() == [2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27]
