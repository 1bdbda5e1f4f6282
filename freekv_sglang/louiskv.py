"""LouisKV (../shared/papers/louiskv.txt) as a retrieval policy over the FreeKV engine: what triggers a retrieval,
which units are scored, what is recalled; the layout, host arena, slot tables, selection, recall and attention are
the engine's.

- Trigger (paper 4.1): a request's layer retrieves at a semantic boundary, when the mean over all query heads of the
  cosine similarity of the adjacent queries q_{t-1}, q_t falls below boundary_tau (Algorithm 1, line 35; the first
  step always retrieves). Then every KV head of that request and layer reselects and recalls before attention;
  between boundaries nothing is selected or recalled, except that a head holding fewer pages than it could (a
  context shorter than the budget) fills its empty slots. Nothing selects speculatively after attention.
- Prompt units (4.2): after prefill each sparse layer's offloaded prompt keys are clustered per KV head with k-means
  (freekv_kernels.kmeans, n / cluster_size clusters), all of them at once: a prompt SGLang prefills in chunks is
  clustered from staging in its last chunk's forward (FreeKVEngine.store_staged_prompt), never per chunk. The host
  pages of those tokens are written in cluster order per KV head (attention does not depend on the order of its
  keys, which carry their RoPE already), so a cluster is one run of tokens over one or a few consecutive pages
  instead of scattered over the prompt.
- Output units (4.2): pages leaving the window form temporal segments: a page starts a new segment when a boundary
  fired at one of its tokens, or the open segment would exceed `segment` tokens; otherwise it joins the open one
  (freekv_kernels.segments). The prompt's last pages, in the window at prefill, become segments the same way.
- Scoring (Appendix B): per KV head the group-mean softmax of q_t over the centroids (the mean keys) of all of a
  request's units; a candidate page scores the best of the units it holds tokens of (freekv_kernels.unit_scores).
  The engine's top-k over these page scores takes units in score order and, for each, the pages holding it, until
  the budget's k pages are full: a cluster is recalled as the whole pages holding its run, the last unit taken may
  be cut at the budget, and the GPU never holds more than the budget's pages per head (O(budget), as for FreeKV).
The unit table (centroids, token counts, each page's unit range) is indexed by host page, like the page summaries.
"""

from __future__ import annotations

import dataclasses

import torch

from freekv_kernels.unit_scores import unit_scratch_size

from .selectors import Selector


@dataclasses.dataclass
class PromptUnits:
    """A prompt's clusters, per KV head, ordered by cluster with the empty clusters dropped (ordinals 0 .. C' - 1)."""

    order: torch.Tensor  # [H, N] int64: the token at each position of the cluster-ordered prompt
    centroids: torch.Tensor  # [H, C, D] float32: unit u's centroid at [:, u]; zero past the non-empty clusters
    counts: torch.Tensor  # [H, C] int32: tokens per unit, 0 past the non-empty clusters
    ranges: torch.Tensor  # [N // p, H, 2] int32: first and last unit ordinal of each page of the ordered prompt


def cluster_prompt(keys: torch.Tensor, num_clusters: int, iters: int, page_size: int, kmeans) -> PromptUnits:
    """keys [N, H, D] (N a multiple of page_size) -> PromptUnits, with kmeans = freekv_kernels.kmeans.kmeans_keys or
    its reference. Device work only, no host sync."""
    centroids, assign, sizes = kmeans(keys.transpose(0, 1), num_clusters, iters)
    ranked, order = torch.sort(assign, dim=1, stable=True)  # a cluster's tokens become one run, in token order
    H, C, D = centroids.shape
    nonempty = sizes > 0
    ordinal = torch.cumsum(nonempty, dim=1, dtype=torch.int64) - 1  # [H, C]: empty clusters take no ordinal
    target = torch.where(nonempty, ordinal, C)  # empty clusters land in an extra column, dropped
    units = centroids.new_zeros(H, C + 1, D).scatter_(1, target[..., None].expand(H, C, D), centroids)[:, :C]
    counts = sizes.new_zeros(H, C + 1).scatter_(1, target, sizes)[:, :C]
    pos = ordinal.gather(1, ranked.long())  # [H, N]: unit ordinal at each position
    ranges = torch.stack([pos[:, ::page_size], pos[:, page_size - 1::page_size]], dim=-1).transpose(0, 1)
    return PromptUnits(order=order, centroids=units, counts=counts, ranges=ranges.int().contiguous())


def reorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] with each KV head's tokens in `order` [H, N]."""
    return x.gather(0, order.T[..., None].expand(-1, -1, x.shape[2]))


class LouisKV(Selector):
    name = "louiskv"
    speculative = False
    needs_whole_prompt = True

    def __init__(self, engine):
        super().__init__(engine)
        e, cfg = engine, engine.cfg
        H, D, R, M = e.shape.num_kv_heads, e.shape.head_dim, e.num_slots, e.max_pages
        P, upp, dev = e.host.arena.shape[0], cfg.units_per_page, e.device

        def per_layer(make):
            return [None if dense else make() for dense in e.dense]

        self.centroids = per_layer(lambda: torch.zeros(P * upp, H, D, dtype=e.dtype, device=dev))
        self.counts = per_layer(lambda: torch.zeros(P * upp, H, dtype=torch.int32, device=dev))
        self.ranges = per_layer(lambda: torch.zeros(P, H, 2, dtype=torch.int32, device=dev))
        # Per request: which of its pages saw a boundary (segment starts), and its open segment per KV head.
        self.marks = per_layer(lambda: torch.zeros(R, M, dtype=torch.int8, device=dev))
        self.seg_sum = per_layer(lambda: torch.zeros(R, H, D, dtype=torch.float32, device=dev))
        self.seg_len = per_layer(lambda: torch.zeros(R, H, dtype=torch.int32, device=dev))
        self.seg_row = per_layer(lambda: torch.full((R, H), -1, dtype=torch.int32, device=dev))
        self.seg_ord = per_layer(lambda: torch.zeros(R, H, dtype=torch.int32, device=dev))
        # The softmax partials of one layer's scoring; layers score one after another on the select stream.
        self.scratch = torch.empty(R, H, unit_scratch_size(e.shape.group, M, upp), dtype=torch.float32, device=dev)

    def trigger(self, plan, layer, q, heads, kv):
        e = self.engine
        e.ops.semantic_boundary(q, e.prev_q[layer], plan.req_slots, e.has_prev[layer], e.cfg.boundary_tau,
                                e._step_lens[:q.shape[0]], e.cfg.page_size, self.marks[layer], e.slot_table[layer],
                                plan.n_slots, heads, e._stat_sim[layer] if e.collect_stats else None, e.pad_slot)
        e.ops.write_kv(*kv)
        return heads  # a head that selects recalls everything it changed before attention

    def score(self, plan, layer, q, heads, phase):
        e = self.engine
        return e.ops.unit_page_scores(q, self.centroids[layer], self.counts[layer], self.ranges[layer], e.page_table,
                                      plan.req_slots, e.cfg.sink_pages, plan.cand_end, e.scale, e.cfg.page_size,
                                      heads, phase, self.scratch)

    def after_offload(self, plan, layer):
        e, cfg = self.engine, self.engine.cfg
        e.ops.segment_pages(e.k_cache[layer], e._step_lens[:plan.req_slots.shape[0]], plan.req_slots,
                            plan.offload_src, plan.offload_dst, plan.offload_valid, self.marks[layer],
                            self.seg_sum[layer], self.seg_len[layer], self.seg_row[layer], self.seg_ord[layer],
                            self.centroids[layer], self.counts[layer], self.ranges[layer], cfg.page_size,
                            cfg.sink_pages, cfg.window_pages, cfg.segment)

    def prompt_pages(self, slot, layer, k, v, pages):
        e, cfg, p = self.engine, self.engine.cfg, self.engine.cfg.page_size
        self.marks[layer][slot] = 0
        self.seg_row[layer][slot] = -1
        self.seg_len[layer][slot] = 0
        if not pages:
            return k, v
        units = cluster_prompt(k, k.shape[0] // cfg.cluster_size, cfg.kmeans_iters, p, e.ops.kmeans_keys)
        upp = cfg.units_per_page
        u = torch.arange(len(pages) * upp, device=e.device)
        rows = e.page_table[slot, pages.start + u // upp].long() * upp + u % upp
        self.centroids[layer][rows] = units.centroids.transpose(0, 1).to(e.dtype)
        self.counts[layer][rows] = units.counts.T
        self.ranges[layer][e.page_table[slot, pages.start:pages.stop].long()] = units.ranges
        return reorder(k, units.order), reorder(v, units.order)
