"""select_chain (pooling, churn replay and select_slots in one launch) against its torch reference and against the
three launches it replaces; the channel sketch's unpooled log-sum-exps it pools."""

import pytest
import torch
from freekv_kernels.channel_sketch import channel_sketch_pages, naive_channel_sketch_pages
from freekv_kernels.churn_replay import replay_churn
from freekv_kernels.page_rerank.triton import _full_scan, _pool
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW, select_slots
from freekv_kernels.page_select.triton import _heads_args, one_stage
from freekv_kernels.select_chain import LsePool, Replay, naive_select_chain, select_chain
from freekv_kernels.select_chain.naive import naive_pool_lse
from freekv_kernels.testing import assert_close, device, poisoned_outputs, run_without_interpreter
from test_channel_sketch import B as SKETCH_B
from test_channel_sketch import channel_inputs

DEV = device()
B, R, START = 4, 6, 2


def chain_inputs(G, H, M, K, V, seed):
    """Log-sum-exps of M - START candidate pages per (row, head) (NaN past each row's end, in the padding heads and
    in the other phase's rows, as the sketch leaves them), rows ending at M, at the start (none), one page past it
    and half way; slot tables with holes, victim entries (some free) and last step's codes and ops; a head mask,
    flags and draws. Built on CPU, so every device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    gp = 1 << (G - 1).bit_length()
    lse = torch.randn(B, H, M - START, gp, generator=g) * 3
    cand_end = torch.tensor([M, START, START + 1, M // 2], dtype=torch.int32)
    for b in range(B):
        lse[b, :, max(0, int(cand_end[b]) - START):] = float("nan")
    lse[..., G:] = float("nan")
    req_slots = torch.tensor([4, 0, 5, 2], dtype=torch.int32)
    slots = torch.full((R, H, K), -1, dtype=torch.int32)
    victims = torch.full((R, H, max(V, 1)), -1, dtype=torch.int32)
    for r in range(R):
        for h in range(H):
            pages = torch.randperm(M, generator=g).int()
            n = int(torch.randint(0, K + 1, (1,), generator=g))
            slots[r, h, torch.randperm(K, generator=g)[:n]] = pages[:n]
            victims[r, h, :V] = torch.where(torch.rand(V, generator=g) < 0.25, -1, pages[K:K + V])
    age = torch.randint(0, 5, victims.shape, dtype=torch.int32, generator=g)
    heads = torch.rand(B, H, generator=g) < 0.6
    flags = heads & (torch.rand(B, H, generator=g) < 0.5)
    recall = torch.randint(0, 3, (B, H, K), dtype=torch.int8, generator=g)
    ops = torch.randint(0, 1 << 20, (B, H, K), dtype=torch.int32, generator=g)
    draws = torch.rand(B, H, generator=g)
    return [t.to(DEV) for t in (lse, cand_end, req_slots, slots, victims, age, heads, flags, recall, ops, draws)]


def run(fn, inputs, G, M, phase, V, replay_rate, returns, hysteresis, keep=None):
    """fn over clones of the state it writes; returns that state (slots, recall codes, statistics, victim entries,
    their stamps, victim ops)."""
    lse, cand_end, req_slots, slots, victims, age, heads, flags, recall, ops, draws = inputs
    slots, victims, age, recall, ops = (t.clone() for t in (slots, victims, age, recall, ops))
    stats = torch.tensor([5.0, 7.0, 11.0, 13.0][:4 if V else 2], dtype=torch.float64, device=DEV)
    cache = (victims, age, ops) if V else (None, None, None)
    replay = None if replay_rate is None else Replay(draws, replay_rate, returns, keep)
    with poisoned_outputs():
        fn(LsePool(lse, START, cand_end, G, M), slots, req_slots, heads, phase, flags, recall, False, stats,
           int(req_slots[3]), hysteresis, *cache, replay=replay)
    return slots, recall, stats, victims, age, ops


def three_launches(pool, slots, req_slots, heads, phase, flags, recall, recall_all, stats, pad, hysteresis,
                   victims, victim_age, victim_ops, replay=None):
    """What the engine launched before select_chain: the sketch's pooling kernel, replay_churn, select_slots."""
    scores = torch.empty(pool.lse.shape[0], pool.lse.shape[1], pool.num_pages, device=DEV)
    C, cand_args = _full_scan(req_slots, pool.cand_start, pool.cand_end, pool.num_pages)
    _pool(pool.lse, cand_args, False, _heads_args(heads, phase, req_slots), scores, C, pool.cand_start, pool.group)
    if replay is not None:
        replay_churn(scores, slots, req_slots, heads, phase, replay.draws, replay.rate, victims, replay.returns,
                     replay.keep)
    select_slots(scores, slots, req_slots, heads, phase, flags, recall, recall_all, stats, pad, hysteresis, victims,
                 victim_age, victim_ops)


NAMES = ("slots", "recall", "stats", "victims", "age", "ops")


SMALL = [(G, H, M, K, V, phase, rate) for G, H, M, K, V in [(1, 2, 40, 8, 0), (3, 2, 200, 16, 16)]
         for phase in (PHASE_NOW, PHASE_LATER) for rate in (None, 0.15)]
# More victim entries than slots (three budgets), and fewer; a slot count short of a power of two.
SMALL += [(2, 2, 120, 8, 24, PHASE_LATER, 0.15), (4, 2, 150, 12, 5, PHASE_NOW, 0.15)]
# Long rows (slow under the interpreter): the longest one-stage row, and a staged one (three launches), each phase
# once, both with the replay.
LONG = [(4, 2, 1000, 64, 64, PHASE_NOW, 0.15), (8, 1, 1100, 32, 8, PHASE_LATER, 0.15)]


@pytest.mark.parametrize("G,H,M,K,V,phase,replay_rate", SMALL + LONG)
def test_select_chain_matches_reference_and_three_launches(G, H, M, K, V, phase, replay_rate):
    """The pooled, replayed (about 15% of the slots, half of them back from the victim entries) and selected state
    of the phase's heads, the other heads' recall codes, the statistics: the reference's, and bit for bit those of
    the three launches (1100 pages: the staged top-k, so the launches themselves)."""
    inputs = chain_inputs(G, H, M, K, V, seed=G * 100 + M)
    returns = 0.5 if replay_rate and V else 0.0
    args = (inputs, G, M, phase, V, replay_rate, returns, 1.0)
    ref = run(naive_select_chain, *args)
    out = run(select_chain, *args)
    apart = run(three_launches, *args)
    assert one_stage(M, K) == (M <= 1024)
    for name, a, b, c in zip(NAMES, ref, out, apart):
        assert_close(name, a, b, atol=0, rtol=0)
        assert torch.equal(b, c), f"{name}: the fused launch differs from the three launches"
    slots_before = inputs[3]
    mine = inputs[6] == (phase == PHASE_NOW)
    rows = inputs[2].long()
    assert torch.equal(out[0][rows][~mine], slots_before[rows][~mine]), "a head outside the phase selected"
    assert not torch.equal(out[0][rows][mine], slots_before[rows][mine]), "no head of the phase selected"


@pytest.mark.parametrize("G,H,M,K,V,phase", [(3, 2, 200, 16, 16, PHASE_LATER), (2, 4, 120, 8, 0, PHASE_NOW),
                                               (8, 1, 1100, 32, 8, PHASE_LATER)])
def test_kept_heads_replay_no_churn(G, H, M, K, V, phase):
    """Replay.keep: the kept heads select as at rate 0, the others as at the replay's rate, in the reference, the
    fused launch and the three launches (1100 pages: staged)."""
    inputs = chain_inputs(G, H, M, K, V, seed=G * 7 + M)
    B = inputs[2].shape[0]
    keep = torch.rand(B, H, generator=torch.Generator().manual_seed(M)).lt(0.5).to(DEV)
    keep[0], keep[1] = True, False  # both kinds in every case
    returns = 0.5 if V else 0.0
    kept = [run(fn, inputs, G, M, phase, V, 0.6, returns, 1.0, keep)
            for fn in (naive_select_chain, select_chain, three_launches)]
    for name, *state in zip(NAMES, *kept):
        for other in state[1:]:
            assert_close(name, state[0], other, atol=0, rtol=0)
    rows = inputs[2].long()
    for rate, heads in ((0.0, keep), (0.6, ~keep)):
        alone = run(naive_select_chain, inputs, G, M, phase, V, rate, returns, 1.0)
        for i in (1, 5):  # recall codes and victim ops, by (row, head)
            if kept[0][i] is not None:
                assert torch.equal(kept[0][i][heads], alone[i][heads]), NAMES[i]
        for i in (0, 3, 4):  # slots and victim entries, by (request slot, head)
            assert torch.equal(kept[0][i][rows][heads], alone[i][rows][heads]), NAMES[i]


def test_select_chain_without_pool_or_replay_is_select_slots():
    """Page scores and no replay: select_slots' launch alone, its effects."""
    G, H, M, K = 4, 2, 200, 16
    inputs = chain_inputs(G, H, M, K, 0, seed=3)
    heads = inputs[6]
    scores = naive_pool_lse(LsePool(inputs[0], START, inputs[1], G, M), heads, PHASE_NOW).nan_to_num(0.0)
    state = []
    for fn in (select_chain, select_slots):
        slots, recall = inputs[3].clone(), inputs[8].clone()
        fn(scores.clone(), slots, inputs[2], heads, PHASE_NOW, inputs[7], recall)
        state.append((slots, recall))
    assert torch.equal(state[0][0], state[1][0]) and torch.equal(state[0][1], state[1][1])


@pytest.mark.parametrize("G,p,phase", [(1, 16, PHASE_NOW), (3, 32, PHASE_LATER), (4, 16, PHASE_LATER),
                                       (8, 32, PHASE_NOW)])
def test_unpooled_channel_sketch_pools_to_its_scores(G, p, phase):
    """channel_sketch_pages(pool=False): log-sum-exps that the reference's pooling turns into the pooled call's
    scores, equal to the reference's log-sum-exps on every candidate (the kernel writes nothing else)."""
    torch.manual_seed(5)
    M, H = 45, 2
    q, codes, cal, pt, rs, start, cand_end, heads, by_slot = channel_inputs(G, p, 64, 32, M, H, phase)
    args = [t.to(DEV) for t in (q, codes, cal.channels, cal.step, pt, rs)]
    common = (0.125, heads.to(DEV), phase, by_slot, start, cand_end.to(DEV))
    with poisoned_outputs():
        lse = channel_sketch_pages(*args, *common, pool=False)
        scores = channel_sketch_pages(*args, *common).cpu()
    ref_lse = naive_channel_sketch_pages(q, codes, cal.channels, cal.step, pt, rs, 0.125, heads, phase, by_slot, start,
                                         cand_end, pool=False)
    assert lse.shape == ref_lse.shape == (SKETCH_B, H, M - start, 1 << (G - 1).bit_length())
    mine = heads == (phase == PHASE_NOW)
    pooled = naive_pool_lse(LsePool(lse, start, cand_end.to(DEV), G, M), heads.to(DEV), phase).cpu()
    assert_close("scores", scores[mine], pooled[mine], atol=1e-6, rtol=1e-5)
    written = ~torch.isnan(ref_lse)
    assert written[mine].any() and not written[~mine].any()
    assert_close("lse", ref_lse[written], lse.cpu()[written], atol=1e-4, rtol=1e-4)


def test_select_chain_refuses_bad_inputs():
    inputs = chain_inputs(4, 2, 60, 8, 4, seed=1)
    lse, cand_end, req_slots, slots, victims, age, heads, flags, recall, ops, draws = inputs
    with pytest.raises(ValueError, match="lse must be fp32"):
        select_chain(LsePool(lse[..., :2], START, cand_end, 4, 60), slots, req_slots, heads, PHASE_NOW, flags, recall)
    with pytest.raises(ValueError, match="victim cache"):
        select_chain(LsePool(lse, START, cand_end, 4, 60), slots, req_slots, heads, PHASE_NOW, flags, recall,
                     replay=Replay(draws, 0.1, 0.5))
    with pytest.raises(ValueError, match="churn rate"):
        select_chain(LsePool(lse, START, cand_end, 4, 60), slots, req_slots, heads, PHASE_NOW, flags, recall,
                     replay=Replay(draws, 1.5))


CHILD = r'''
from freekv_kernels.page_select import triton as page_select
from freekv_kernels.select_chain import triton as select_chain
from freekv_kernels.testing import compile_sm90

TYPES = {"lse_ptr": "*fp32", "cend_ptr": "*i32", "draws_ptr": "*fp32", "keep_ptr": "*u8", "rate_k": "fp32",
         "returns": "fp32",
         "in_ptr": "*fp32", "slots_ptr": "*i32", "req_ptr": "*i32", "heads_ptr": "*i1", "flags_ptr": "*i1",
         "recall_ptr": "*i8", "stats_ptr": "*fp64", "bonus": "fp32", "vict_ptr": "*i32", "age_ptr": "*i32",
         "vops_ptr": "*i32", "row_ptr": "*fp32"}
CONSTEXPRS = {"KP": 64, "CHUNK": 1024, "PACKED_IN": False, "PHASE": 1, "WANT": 1, "RECALL_ALL": False, "STATS": True,
              "NEG_INF_KEY": page_select._NEG_INF_KEY, "HYST": True, "VICTIMS": True, "VP": 64, "HIT_STATS": True,
              "SHIFT": 16, "SCRATCH": True, "POOL": True, "G": 4, "GP": 4, "POOL_BLOCK": 1024, "REPLAY": True,
              "R_KP": 64, "R_BLOCK": 1024, "PROMOTED": 1.0e4, "TIE": 1.0 / 1024, "KEEP": True}
ptx = compile_sm90(select_chain._select_chain_kernel, CONSTEXPRS, TYPES, 8)
assert ".entry _select_chain_kernel" in ptx and "bar.sync" in ptx
print("compiled")
'''


def test_select_chain_kernel_compiles_for_sm90():
    """The fused kernel with every stage (pooling, replay with the victim cache, hysteresis, statistics) compiles for
    an H100 with its barriers, in a child process without the interpreter."""
    assert run_without_interpreter(CHILD) == ["compiled"]
