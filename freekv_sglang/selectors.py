"""Retrieval policies: which heads select when, and how the engine scores a KV head's candidate pages before its
top-k selection.

Each is a thin module over the one engine: it may own per-page sketches (allocated here, written by the engine's
offload through `codes`) and turns a query into scores [B, H, M] for select_slots (or into log-sum-exps that
select_chain pools); slot commit and recall stay the engine's. Candidates are a request's offloaded pages
[sink_pages, plan.cand_end). The selectors here are FreeKV's
(speculation with correction: the base class's trigger); LouisKV (louiskv.py) overrides the trigger, the prompt's
page order and the unit upkeep after offload.
"""

from __future__ import annotations

import torch
from freekv_kernels.channel_sketch import ChannelCalibration, calibrate_channels
from freekv_kernels.fp8_rows.naive import host_rows
from freekv_kernels.page_rerank import CODE_BITS, empty_codes
from freekv_kernels.page_rerank.naive import PER_BYTE
from freekv_kernels.page_select.naive import PHASE_LATER, in_phase
from freekv_kernels.select_chain import LsePool

from .config import CODE_SELECTIONS, FreeKVConfig


class Selector:
    name = ""
    speculative = True  # the heads that do not select before attention select after it, with the same query
    needs_whole_prompt = False  # prompts must come whole through prefill_layer, not staged page by page

    def __init__(self, engine):
        self.engine = engine

    def codes(self, layer: int) -> torch.Tensor | None:
        """The layer's key codes that offload_pages writes ([P, H, p, D / 4] 2-bit codes, or the channel codes of
        code_channels), or None."""
        return None

    def code_channels(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The layer's calibrated (channels, lo, inv_step) when its codes are channel codes, else None."""
        return None

    def trigger(self, plan, layer: int, q: torch.Tensor, heads: torch.Tensor, kv: tuple) -> torch.Tensor:
        """A sparse layer's first launch (compute stream): write heads [B, H] (the heads that select before
        attention), store q as the layer's previous query, write the step's K/V (kv: write_kv's arguments), and
        return the flags [B, H] of select_slots (heads whose every changed slot is recalled before attention).
        FreeKV: heads whose group-mean cosine of adjacent queries is below tau, or with empty slots to fill, in the
        launch that writes the K/V."""
        e, B = self.engine, q.shape[0]
        replay = None  # benchmarks: flags drawn at a replayed rate (the late one's own draws after anticipate's)
        if e.cfg.replay_late_rate is not None:
            replay = (e._replay_late[layer, :B], e.cfg.replay_late_rate)
        elif e.cfg.replay_correction_rate is not None:
            replay = (e._replay_u[layer, :B], e.cfg.replay_correction_rate)
        return e.ops.query_similarity(q, e.prev_q[layer], plan.req_slots, e.has_prev[layer], e.tau, e.shape.group,
                                      e._stat_sim[layer] if e.collect_stats else None, e.pad_slot,
                                      e.slot_table[layer], plan.n_slots, heads, self.picks(layer), e.scale, kv=kv,
                                      replay=replay)

    def picks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers (by request slot) for the sketch's picks that the similarity check writes, or None."""
        return None

    def prompt_pages(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor, pages: range):
        """The K/V [len(pages) * page_size, H, D] of a prompt's pages `pages` as they go to the host arena at prefill
        (every prompt of the request passes here, `pages` possibly empty)."""
        return k, v

    def after_offload(self, plan, layer: int) -> None:
        """Recall stream, after the offload of the pages leaving the window."""

    def score(self, plan, layer: int, q: torch.Tensor, heads: torch.Tensor, phase: int) -> torch.Tensor:
        raise NotImplementedError

    def select_input(self, plan, layer: int, q: torch.Tensor, heads: torch.Tensor,
                     phase: int) -> torch.Tensor | LsePool:
        """What the engine's select_chain ranks: score's scores, or scores it pools itself (one launch fewer)."""
        return self.score(plan, layer, q, heads, phase)

    def fill_input(self, plan, layer: int, q: torch.Tensor, heads: torch.Tensor,
                   phase: int) -> torch.Tensor | LsePool:
        """select_input for engine.fill_slots, whose query no similarity check has seen."""
        return self.select_input(plan, layer, q, heads, phase)

    def _bound(self, plan, layer, q, heads, phase, pooling) -> torch.Tensor:
        e = self.engine
        return e.ops.score_pages(q, e.summaries[layer], e.page_table, plan.req_slots, e.cfg.sink_pages, plan.cand_end,
                                 e.scale, pooling, heads, phase, phase == PHASE_LATER)


class MeanS(Selector):
    """FreeKV's group-consistent selection: per query head the softmax of the min / max upper bounds, mean over
    the group."""

    name = "means"

    def score(self, plan, layer, q, heads, phase):
        return self._bound(plan, layer, q, heads, phase, "mean_softmax")


class Quest(Selector):
    """Quest's page score (the min / max upper bound), max over the group."""

    name = "quest"

    def score(self, plan, layer, q, heads, phase):
        return self._bound(plan, layer, q, heads, phase, "max")


class Rerank(Selector):
    """Two stages over 2-bit key codes: a sketch scores every candidate page from its mid-range keys refined by the
    codes of the channels the group's query weighs most, then the best rerank_factor x k pages are rescored from all
    their codes as attention mass (group mean of per-query-head softmax of page log-sum-exps); rerank_factor 0
    rescores every page. The min / max bound is loose where one token of a page matters (a needle beside noise):
    the codes see the token."""

    name = "rerank"

    def __init__(self, engine):
        super().__init__(engine)
        e = engine
        H, D, p = e.shape.num_kv_heads, e.shape.head_dim, e.cfg.page_size
        num_host = e.host.arena.shape[0]
        self._codes = [None if dense else empty_codes(num_host, H, p, D, e.device) for dense in e.dense]
        # The sketch's picks by request slot, written with the query by the similarity check (one computation for
        # both phases; per layer, since a layer's speculative selection runs beside the next layers' triggers).
        nb = e.cfg.sketch_bytes(D) if e.cfg.sketches else 0
        gp = 1 << (e.shape.group - 1).bit_length()
        picks = [not dense and nb > 0 for dense in e.dense]
        self._sel = [torch.zeros(e.num_slots, H, nb, dtype=torch.int32, device=e.device) if on else None
                     for on in picks]
        self._qp = [torch.zeros(e.num_slots, H, nb * PER_BYTE, gp, dtype=torch.float32, device=e.device) if on
                    else None for on in picks]

    def picks(self, layer):
        return None if self._sel[layer] is None else (self._sel[layer], self._qp[layer])

    def codes(self, layer):
        return self._codes[layer]

    def fill_input(self, plan, layer, q, heads, phase):
        return self.score(plan, layer, q, heads, phase, fresh=True)

    def score(self, plan, layer, q, heads, phase, fresh=False):
        e = self.engine
        by_slot, start = phase == PHASE_LATER, e.cfg.sink_pages
        cand = None  # rerank_factor 0: every candidate page
        if e.cfg.rerank_factor:
            cand = e.ops.top_pages(self._sketch(plan, layer, q, heads, phase, fresh), e.cfg.rerank_pages, heads, phase)
        return e.ops.rerank_pages(q, e.summaries[layer], self._codes[layer], e.page_table, plan.req_slots, cand,
                                  e.scale, heads, phase, by_slot, start, plan.cand_end)

    def _sketch(self, plan, layer, q, heads, phase, fresh=False):
        """fresh: q's sketch picks are not in picks(layer) (no similarity check saw q): the kernel makes its own."""
        e = self.engine
        return e.ops.sketch_pages(q, e.summaries[layer], self._codes[layer], e.page_table, plan.req_slots, e.scale,
                                  e.cfg.sketch_bytes(e.shape.head_dim), heads, phase, phase == PHASE_LATER,
                                  e.cfg.sink_pages, plan.cand_end, None if fresh else self.picks(layer))


class Sketch(Rerank):
    """Rerank's first stage alone: every candidate page scored from its mid-range keys refined by the codes of the
    sketch_channels channels the group's query weighs most, as attention mass (the same pooling), no rescoring."""

    name = "sketch"

    def score(self, plan, layer, q, heads, phase, fresh=False):
        return self._sketch(plan, layer, q, heads, phase, fresh)


class Channels(Selector):
    """4-bit codes of channel_count key channels per KV head, chosen and quantised once per model by a calibration
    (the same steps for every page), nothing elsewhere: per query head the log-sum-exp of a page's logits, softmax
    over the pages, group mean, as one tensor-core product per (row, KV head) (freekv_kernels.channel_sketch).
    calibrate() must run for every sparse layer before the first page goes to the host (FreeKVModel.calibrate)."""

    name = "channels"

    def __init__(self, engine):
        super().__init__(engine)
        e = engine
        H, p, R = e.shape.num_kv_heads, e.cfg.page_size, e.cfg.channel_count
        num_host = e.host.arena.shape[0]
        self._codes = [None if dense else torch.zeros(num_host, H, p, R // 2, dtype=torch.uint8, device=e.device)
                       for dense in e.dense]
        # In place once calibrated, so a captured graph keeps its pointers.
        self._cal = [None if dense else ChannelCalibration(
            torch.zeros(H, R, dtype=torch.int32, device=e.device),
            *(torch.zeros(H, R, dtype=torch.float32, device=e.device) for _ in range(3))) for dense in e.dense]
        self._calibrated = [False] * len(e.dense)

    def calibrate(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """A sparse layer's calibration from queries q [T, Hq, D] and keys [T, H, D] of a calibration text, past its
        first `sink` tokens: sink pages are never scored, and their keys (an attention sink's are outliers) would
        stretch the ranges that the 16 bins cut."""
        e = self.engine
        H, G, D, s = e.shape.num_kv_heads, e.shape.group, e.shape.head_dim, e.cfg.sink
        if keys.shape[0] <= s:
            raise ValueError(f"a calibration needs more than the sink's {s} tokens, got {keys.shape[0]}")
        cal = calibrate_channels(q[s:].view(-1, H, G, D), keys[s:], e.cfg.channel_count)
        for have, new in zip(self._cal[layer], cal):
            have.copy_(new)
        self._calibrated[layer] = True

    def uncalibrated(self) -> list[int]:
        """The sparse layers that calibrate() has not reached."""
        return [layer for layer, (dense, done) in enumerate(zip(self.engine.dense, self._calibrated))
                if not dense and not done]

    def _check(self, layer: int) -> ChannelCalibration:
        if not self._calibrated[layer]:
            raise RuntimeError(f"selection 'channels': sparse layer {layer} has no calibration; run "
                               "FreeKVModel.calibrate (or Channels.calibrate per layer) before the first prompt")
        return self._cal[layer]

    def codes(self, layer):
        self._check(layer)
        return self._codes[layer]

    def code_channels(self, layer):
        cal = self._check(layer)
        return cal.channels, cal.lo, cal.inv_step

    def score(self, plan, layer, q, heads, phase, pool=True):
        e, cal = self.engine, self._check(layer)
        return e.ops.channel_sketch_pages(q, self._codes[layer], cal.channels, cal.step, e.page_table, plan.req_slots,
                                          e.scale, heads, phase, phase == PHASE_LATER, e.cfg.sink_pages,
                                          plan.cand_end, e.cfg.score_programs if phase == PHASE_LATER else 0, pool)

    def select_input(self, plan, layer, q, heads, phase):
        """The pages' log-sum-exps: select_chain pools them in its own launch."""
        e = self.engine
        return LsePool(self.score(plan, layer, q, heads, phase, pool=False), e.cfg.sink_pages, plan.cand_end,
                       e.shape.group, e.page_table.shape[1])


class Oracle(Selector):
    """The exact attention mass of the query on each candidate page, read from the host copy of the keys: per query
    head a softmax over every candidate token, summed per page, mean over the group. An upper bound for the accuracy
    harness (eager, host reads per step), not a serving path."""

    name = "oracle"

    def score(self, plan, layer, q, heads, phase):
        e = self.engine
        B, H, M = plan.req_slots.shape[0], e.shape.num_kv_heads, e.max_pages
        G, D = e.shape.group, e.shape.head_dim
        scores = torch.full((B, H, M), float("-inf"), dtype=torch.float32, device=e.device)
        mine = in_phase(heads, phase)
        # One host read each for the rows' ranges and phases, not one per row.
        ends, selecting = plan.cand_end.tolist(), [True] * B if mine is None else mine.any(1).tolist()
        for b, slot in enumerate(plan.req_slots.tolist()):
            end = min(int(ends[b]), M)
            if slot == e.pad_slot or end <= e.cfg.sink_pages or not selecting[b]:
                continue
            mass = page_attention_mass(e, layer, slot, (q[slot] if phase == PHASE_LATER else q[b]).view(H, G, D), end)
            scores[b, :, e.cfg.sink_pages:end] = mass
        return scores


class Replay(Selector):
    """Benchmarks only (FreeKVConfig.replay_churn): no scoring; every candidate page scores 0 and the replay's draws
    make the whole selection. A step with it against a step with another selector, both replaying the same churn
    (so recalling the same share of pages), is what that selector's scoring costs the step."""

    name = "replay"

    def __init__(self, engine):
        super().__init__(engine)
        self._pages = torch.arange(engine.max_pages, dtype=torch.int32, device=engine.device)

    def score(self, plan, layer, q, heads, phase):
        e = self.engine
        cand = (self._pages >= e.cfg.sink_pages) & (self._pages < plan.cand_end[:, None])  # [B, M]
        scores = torch.where(cand, 0.0, float("-inf"))
        return scores[:, None].expand(-1, e.shape.num_kv_heads, -1).contiguous()


class CandidateKeys:
    """Device copies of the exact keys of each request's offloaded pages, fetched from the host arena once per page
    (a request's candidate range only grows) and dropped when its slot changes owner: the oracle and the harness's
    diagnostics read them every layer of every step."""

    def __init__(self, engine):
        self.engine = engine
        self._keys: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (slot, layer) -> (owner, [n, H, p, D])

    def get(self, layer: int, slot: int, end: int) -> torch.Tensor:
        e, start = self.engine, self.engine.cfg.sink_pages
        owner, have = self._keys.get((slot, layer), (None, None))
        if owner != e._owner[slot] or have is None:
            have = torch.empty(0, *e.host.arena.shape[2:3], e.cfg.page_size, e.shape.head_dim, dtype=e.dtype,
                               device=e.device)
        if have.shape[0] < end - start:
            hp = e.page_table[slot, start + have.shape[0]:end].long().cpu()
            have = torch.cat([have, host_rows(e.host.arena, e.host.scales, (hp, layer, slice(None), 0), e.dtype)
                              .to(e.device)])
        self._keys[(slot, layer)] = (e._owner[slot], have)
        return have[:end - start]


def page_attention_mass(engine, layer: int, slot: int, q: torch.Tensor, end: int) -> torch.Tensor:
    """[H, n]: the group-mean attention mass of q [H, G, D] on a request's candidate pages [sink_pages, end),
    normalised over those pages' tokens, from the exact keys (engine.candidate_keys)."""
    keys = engine.candidate_keys.get(layer, slot, end).float()  # [n, H, p, D]
    s = engine.scale * torch.einsum("hgd,nhtd->hgnt", q.float(), keys)
    return torch.softmax(torch.logsumexp(s, dim=-1), dim=-1).mean(1)


SELECTORS = {cls.name: cls for cls in (Rerank, Sketch, MeanS, Quest, Channels, Oracle, Replay)}


def make_selector(cfg: FreeKVConfig, engine) -> Selector:
    if cfg.retrieval == "louiskv":
        from .louiskv import LouisKV  # it builds on Selector

        return LouisKV(engine)
    return SELECTORS[cfg.selection](engine)


def picks_bytes_per_slot(cfg: FreeKVConfig, num_kv_heads: int, group: int, head_dim: int) -> int:
    """GPU bytes of the sketch's picks per request slot and sparse layer (Rerank.picks; LouisKV has none)."""
    if not cfg.sketches:
        return 0
    nb, gp = cfg.sketch_bytes(head_dim), 1 << (group - 1).bit_length()
    return num_kv_heads * (nb * 4 + gp * nb * PER_BYTE * 4)


def sketch_bytes_per_token(cfg: FreeKVConfig, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> float:
    """GPU bytes of selection sketches per context token and sparse layer: the min / max page summaries, plus the
    key codes of the rerank and the sketch (or the channel codes), or LouisKV's unit table (a centroid and a token
    count per unit row, a unit range per page)."""
    H, D, p = num_kv_heads, head_dim, cfg.page_size
    summaries = H * 2 * D * dtype_bytes / p
    if cfg.retrieval == "louiskv":
        return summaries + H * (cfg.units_per_page * (D * dtype_bytes + 4) + 8) / p
    codes = H * D * CODE_BITS / 8 if cfg.selection in CODE_SELECTIONS else 0
    if cfg.selection == "channels":
        codes = H * cfg.channel_count / 2
    return summaries + codes
