"""replay_churn (benchmarks only) against its torch reference, and the churn it makes select_slots produce."""

import pytest
import torch

from freekv_kernels.churn_replay import naive_replay_churn, replay_churn
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW, naive_select_slots
from freekv_kernels.testing import assert_close, device, run_without_interpreter

DEV = device()


def make_inputs(B, H, M, K, R=7, seed=0):
    """Scores with -inf outside each row's candidate range and at a few pages inside it; slots holding distinct
    pages (some candidates, some not, some empty) of the rows' request slots; fresh draws."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(B, H, M, generator=g)
    ends = torch.randint(K // 2, M + 1, (B,), generator=g)
    scores[(torch.arange(M)[None, None, :] >= ends[:, None, None]).expand(B, H, M)] = float("-inf")
    scores[torch.rand(B, H, M, generator=g) < 0.05] = float("-inf")
    scores[:, :, :2] = float("-inf")  # sink pages are never candidates
    req_slots = torch.randperm(R, generator=g)[:B].to(torch.int32)
    slots = torch.full((R, H, K), -1, dtype=torch.int32)
    for r in range(R):
        for h in range(H):
            n = int(torch.randint(0, K + 1, (1,), generator=g))
            slots[r, h, torch.randperm(K, generator=g)[:n]] = torch.randperm(M, generator=g)[:n].to(torch.int32)
    heads = torch.rand(B, H, generator=g) < 0.5
    draws = torch.rand(B, H, generator=g)
    return [t.to(DEV) for t in (scores, slots, req_slots, heads, draws)]


@pytest.mark.parametrize("B,H,M,K", [(1, 1, 17, 4), (3, 3, 300, 32), (5, 8, 1100, 64), (2, 4, 1030, 128)])
@pytest.mark.parametrize("rate", [0.0, 0.15, 1.0])
@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER, None])
def test_replay_churn_matches_reference(B, H, M, K, rate, phase):
    scores, slots, req_slots, heads, draws = make_inputs(B, H, M, K, seed=B * M + K)
    if phase is None:
        heads, phase = None, PHASE_NOW
    ref = scores.clone()
    naive_replay_churn(ref, slots, req_slots, heads, phase, draws, rate)
    out = scores.clone()
    replay_churn(out, slots, req_slots, heads, phase, draws, rate)
    assert_close("scores", ref, out, atol=0, rtol=0)
    mine = torch.ones(B, H, dtype=torch.bool, device=DEV) if heads is None else heads == (phase == PHASE_NOW)
    assert torch.equal(ref[~mine], scores[~mine]), "the other phase's heads changed"
    assert torch.equal(torch.isinf(ref), torch.isinf(scores)), "a candidate appeared or vanished"


@pytest.mark.parametrize("B,H,M,K,V", [(3, 3, 300, 32, 0), (2, 4, 1030, 128, 64)])
def test_kept_heads_replay_at_rate_zero(B, H, M, K, V):
    """keep: those heads' scores are the rate-0 replay's, the others' the rate's, in the reference and the kernel."""
    scores, slots, req_slots, heads, draws = make_inputs(B, H, M, K, seed=B * M + K + 3)
    victims = with_victims(slots.cpu(), scores, V, seed=V) if V else None
    returns = 0.5 if V else 0.0
    keep = (torch.arange(B * H).view(B, H) % 2 == 0).to(DEV)
    ref, out = scores.clone(), scores.clone()
    naive_replay_churn(ref, slots, req_slots, heads, PHASE_NOW, draws, 0.4, victims, returns, keep)
    replay_churn(out, slots, req_slots, heads, PHASE_NOW, draws, 0.4, victims, returns, keep)
    assert_close("scores", ref, out, atol=0, rtol=0)
    for rate, mask in ((0.0, keep), (0.4, ~keep)):
        alone = scores.clone()
        naive_replay_churn(alone, slots, req_slots, heads, PHASE_NOW, draws, rate, victims, returns)
        assert torch.equal(ref[mask], alone[mask])
    assert not torch.equal(ref, scores) and (ref[keep] < 2).all(), "a kept head promoted a page"


def changed_share(rate, hysteresis, steps=40, B=4, H=4, M=512, K=32):
    """select_slots after replay_churn, step after step: the share of a full head's slots that change per step."""
    g = torch.Generator().manual_seed(1)
    slots = torch.full((B, H, K), -1, dtype=torch.int32, device=DEV)
    req = torch.arange(B, dtype=torch.int32, device=DEV)
    recall = torch.zeros(B, H, K, dtype=torch.int8, device=DEV)
    later = torch.zeros(B, H, dtype=torch.bool, device=DEV)  # every head selects speculatively
    changed = 0
    for step in range(steps + 1):
        scores = torch.rand(B, H, M, generator=g).to(DEV)
        scores[:, :, :2] = float("-inf")
        draws = torch.rand(B, H, generator=g).to(DEV)
        old = slots.clone()
        naive_replay_churn(scores, slots, req, later, PHASE_LATER, draws, rate)  # = the kernel (tested above)
        naive_select_slots(scores, slots, req, later, PHASE_LATER, None, recall, hysteresis=hysteresis)
        if step:  # the first step fills the empty slots
            changed += int((slots != old).sum())
    return changed / (steps * B * H * K)


@pytest.mark.parametrize("hysteresis", [0.0, 1.0, 3.0])
def test_churn_rate_is_the_share_of_slots_that_change(hysteresis):
    assert changed_share(0.0, hysteresis) == 0.0
    assert changed_share(1.0, hysteresis) > 0.85  # the promoted count is binomial, capped at k
    assert changed_share(0.15, hysteresis) == pytest.approx(0.15, abs=0.03)


def with_victims(slots, scores, V, seed):
    """Victim entries per (request slot, head): pages no slot of the head holds, candidates or not, some free."""
    g = torch.Generator().manual_seed(seed)
    R, H, _ = slots.shape
    M = scores.shape[2]
    victims = torch.full((R, H, V), -1, dtype=torch.int32)
    for r in range(R):
        for h in range(H):
            held = set(slots[r, h].tolist())
            free = [m for m in torch.randperm(M, generator=g).tolist() if m not in held]
            n = int(torch.randint(0, V + 1, (1,), generator=g))
            victims[r, h, :n] = torch.tensor(free[:n], dtype=torch.int32)
    return victims.to(DEV)


@pytest.mark.parametrize("B,H,M,K,V", [(1, 1, 17, 4, 3), (3, 3, 300, 32, 32), (2, 4, 1030, 128, 64)])
@pytest.mark.parametrize("returns", [0.0, 0.5, 1.0])
def test_replay_churn_returns_match_reference(B, H, M, K, V, returns):
    scores, slots, req_slots, heads, draws = make_inputs(B, H, M, K, seed=B * M + K + V)
    victims = with_victims(slots.cpu(), scores, V, seed=V)
    ref, out = scores.clone(), scores.clone()
    naive_replay_churn(ref, slots, req_slots, heads, PHASE_NOW, draws, 0.3, victims, returns)
    replay_churn(out, slots, req_slots, heads, PHASE_NOW, draws, 0.3, victims, returns)
    assert_close("scores", ref, out, atol=0, rtol=0)


def test_returns_are_the_share_of_victim_hits():
    """Step after step, replay_churn with a return share and select_slots with a victim cache of one budget: the
    share of the changed slots that come from a victim entry is about the return share."""
    B, H, M, K, V = 4, 4, 512, 32, 32
    g = torch.Generator().manual_seed(2)
    slots = torch.full((B, H, K), -1, dtype=torch.int32, device=DEV)
    victims = torch.full((B, H, V), -1, dtype=torch.int32, device=DEV)
    age = victims.clone()
    ops = torch.zeros(B, H, K, dtype=torch.int32, device=DEV)
    req = torch.arange(B, dtype=torch.int32, device=DEV)
    recall = torch.zeros(B, H, K, dtype=torch.int8, device=DEV)
    later = torch.zeros(B, H, dtype=torch.bool, device=DEV)
    for returns in (0.0, 0.5):
        stats = torch.zeros(4, dtype=torch.float64, device=DEV)
        for step in range(31):
            scores = torch.rand(B, H, M, generator=g).to(DEV)
            draws = torch.rand(B, H, generator=g).to(DEV)
            naive_replay_churn(scores, slots, req, later, PHASE_LATER, draws, 0.15, victims, returns)
            naive_select_slots(scores, slots, req, later, PHASE_LATER, None, recall, False,
                               stats if step > 10 else None, -1, 1.0, victims, age, ops)
        assert float(stats[3] / stats[1]) == pytest.approx(returns, abs=0.06)


def test_bad_rate_refused():
    scores, slots, req_slots, heads, draws = make_inputs(2, 2, 40, 4)
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="churn rate"):
            replay_churn(scores, slots, req_slots, heads, PHASE_NOW, draws, bad)
        with pytest.raises(ValueError, match="churn rate"):
            naive_replay_churn(scores, slots, req_slots, heads, PHASE_NOW, draws, bad)
    for fn in (replay_churn, naive_replay_churn):
        with pytest.raises(ValueError, match="victim cache"):
            fn(scores, slots, req_slots, heads, PHASE_NOW, draws, 0.1, None, 0.5)


SM90 = r'''
from freekv_kernels.churn_replay import triton as churn
from freekv_kernels.testing import compile_sm90

types = {"scores_ptr": "*fp32", "slots_ptr": "*i32", "req_ptr": "*i32", "heads_ptr": "*i1", "draws_ptr": "*fp32",
         "vict_ptr": "*i32", "keep_ptr": "*u8", "rate_k": "fp32", "returns": "fp32"}
consts = {"HEADS": True, "WANT": 1, "KP": 64, "BLOCK": churn.CHURN_BLOCK, "PROMOTED": churn.PROMOTED, "TIE": churn.TIE,
          "VICTIMS": True, "VP": 64, "KEEP": True}
print(".entry _replay_churn_kernel" in compile_sm90(churn._replay_churn_kernel, consts, types, 4))
'''


def test_kernel_compiles_for_sm90():
    """The interpreter accepts code the GPU compiler refuses; compile for an H100 here, outside the interpreter."""
    assert run_without_interpreter(SM90) == ["True"]
