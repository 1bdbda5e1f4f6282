"""FreeKV with SGLang's radix cache on, on CPU: FreeKV's real radix cache (SGLang's RadixCache with the FreeKV hooks),
real Req objects, FreeKV's real token pool and attention backend (the duck-typed runner and wrapped backend of
test_freekv_backend.py) and a real kvstore daemon.

A finished request's full pages are exported and retained as a chain; a later request sharing part of its prompt (a
prefix ending mid-page) is matched to the full pages the arena holds, pinned at match time, prefilled from the
shared prefix (sparse layers' prefix staged from the arena, the dense layer's read from the radix node's slots) and
then decodes exactly as an engine fed its whole prompt. A chunked prompt is exported chunk by chunk, so a request
admitted while it still prefills hits its chunks; one aborted mid-prefill leaves them retained. A pin the scheduler
did not admit is let go; a restarted backend with the same model and port re-attaches its arena (the client id is not
the pid). Requests one step finishes are exported together, as they would be one by one."""

from __future__ import annotations

import itertools
from array import array
from types import SimpleNamespace

import pytest
import torch
from test_freekv_backend import (CFG, CTX, HQ, STAGING, TOKENS, D, H, L, P, Inner, Request, assert_filled_alike,
                                 decode_batch, extend_batch, layers, make_pool, reference_engine)

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from freekv_kvstore import start_embedded
from freekv_sglang.engine import merged_stats
from freekv_sglang.server_args import FreeKVServerSettings
from freekv_sglang import radix, sglang_backend
from freekv_sglang.sglang_backend import FreeKVAttnBackend, on_request_freed

SIZE = 6


@pytest.fixture(scope="module")
def daemon():
    handle = start_embedded(arena_gb=0.15)  # each backend keeps its 0.01 GB arena (a restart re-attaches it)
    yield handle
    handle.stop()


def make_backend(daemon, port=30000):
    model_config = SimpleNamespace(num_hidden_layers=L, num_attention_heads=HQ, head_dim=D,
                                   get_num_kv_heads=lambda tp: H // tp)
    req_pool = SimpleNamespace(size=SIZE, req_to_token=torch.zeros(SIZE + 1, CTX, dtype=torch.int32),
                               req_generation=torch.zeros(SIZE + 1, dtype=torch.int64))
    server_args = SimpleNamespace(disable_radix_cache=False, model_path="/models/tiny", port=port)
    runner = SimpleNamespace(model_config=model_config, tp_size=1, tp_rank=0, token_to_kv_pool=make_pool(),
                             req_to_token_pool=req_pool, kv_cache_dtype=torch.float32, page_size=P, device="cpu",
                             next_page=1, capture_tail_hooks=[], server_args=server_args)
    settings = FreeKVServerSettings(config=CFG, kvstore_endpoint=daemon.endpoint, kvstore_arena_gb=0.01)
    return FreeKVAttnBackend(runner, Inner(runner), settings), runner


class Allocator:
    """SGLang's token allocator as the radix cache sees it: new page-aligned slots past the requests' (runner.next_page),
    and what it frees is recorded."""

    device = "cpu"

    def __init__(self, runner):
        self.runner, self.freed = runner, []

    def available_size(self):
        return TOKENS - self.runner.next_page * P

    def alloc(self, n):
        first = self.runner.next_page * P
        self.runner.next_page += n // P
        return torch.arange(first, first + n)

    def free(self, idx):
        self.freed.extend(idx.tolist())


def make_cache(runner):
    """The FreeKV radix cache over the runner's pools (whose req_to_token rows SGLang's cache writes back to through
    req_to_token_pool.write, as a stash does)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from freekv_patches._radix_cache import radix_cache_class

    pool = runner.req_to_token_pool
    pool.write = lambda idx, values: pool.req_to_token.__setitem__(idx, values)
    return radix_cache_class()(CacheInitParams(disable=False, req_to_token_pool=runner.req_to_token_pool,
                                               token_to_kv_pool_allocator=Allocator(runner), page_size=P))


def sglang_req(rid, tokens):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=8))  # SGLang 0.5.16 holds arrays


def match(cache, req):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tokens = req.origin_input_ids
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key, limit=len(tokens) - 1), req=req))


def prefill_chunk(backend, reqs, chunk, pins=None):
    """One extend batch, the next chunk of each request (test_freekv_backend.extend_once with the prefix pins)."""
    fb, ranges = extend_batch(reqs, chunk)
    fb._freekv_prefix_pins = pins
    backend.init_forward_metadata(fb)
    backend.inner.prefix_reads.clear()
    for layer in layers():
        k = torch.cat([r.k[layer.layer_id][a:b] for r, (a, b) in zip(reqs, ranges)])
        v = torch.cat([r.v[layer.layer_id][a:b] for r, (a, b) in zip(reqs, ranges)])
        q = torch.cat([r.chunk_q(layer.layer_id, a, b) for r, (a, b) in zip(reqs, ranges)])
        backend.forward_extend(q, k.reshape(len(k), -1), v.reshape(len(k), -1), layer, fb)
    for lid, read in backend.inner.prefix_reads:  # every layer's prefix reads see the prompt's keys
        torch.testing.assert_close(read, torch.cat([r.k[lid][:a] for r, (a, _) in zip(reqs, ranges)]), atol=0, rtol=0)
    for r, (_, b) in zip(reqs, ranges):
        r.n = b


def run_prefill(backend, reqs, chunk, pins=None):
    """Chunks until every prompt is in, the batch's prefix pins on its first extend batch."""
    while any(r.n < r.prompt for r in reqs):
        prefill_chunk(backend, [r for r in reqs if r.n < r.prompt], chunk, pins)
        pins = None


def decode(backend, reqs, steps, ref=None, ref_slots=None):
    for _ in range(steps):
        fb = decode_batch(reqs)
        backend.init_forward_metadata(fb)
        plan = ref.begin_step(ref_slots) if ref is not None else None
        n = len(reqs)
        for layer in layers():
            q, k, v = torch.randn(n, HQ * D), torch.randn(n, H * D), torch.randn(n, H * D)
            out = backend.forward_decode(q, k, v, layer, fb)
            if ref is not None and layer.layer_id >= CFG.dense_layers:
                want = ref.attend(plan, layer.layer_id, q.view(n, HQ, D), k.view(n, H, D), v.view(n, H, D))
                torch.testing.assert_close(out, want.reshape(n, HQ * D), atol=1e-6, rtol=1e-6)
        if ref is not None:
            ref.end_step()


def finish(cache, backend, runner, r, req):
    """What SGLang's release_kv_cache does for a finished request: cache_finished_req, then the slot is freed."""
    req.req_pool_idx = r.slot
    req.output_ids = array("q", [7] * (r.n - r.prompt))
    cache.cache_finished_req(req, kv_len_to_handle=r.n)
    on_request_freed(r.slot)


def prefilled(cache, r, req):
    """What SGLang's prefill result does for a request whose prompt is in and that goes on decoding:
    cache_unfinished_req."""
    req.req_pool_idx = r.slot
    req._refresh_fill_ids()  # what init_next_round_input did when it was scheduled
    req.set_extend_range(0, r.prompt)
    if req.last_node is None:  # not stashed as chunks before
        req.last_node = cache.root_node
    cache.cache_unfinished_req(req)


def stash(cache, r, req):
    """What SGLang's scheduler does with a chunked prompt before its next chunk (stash_chunked_request): the chunks so
    far go to the tree, cache_unfinished_req(chunked=True)."""
    if req.req_pool_idx is None:
        req.req_pool_idx, req.last_node = r.slot, cache.root_node
        req._refresh_fill_ids()
    req.set_extend_range(0, r.n)
    cache.cache_unfinished_req(req, chunked=True)


def admit(backend, runner, req, prefix, slot, tokens):
    """The scheduler admits req, matched to prefix's first `tokens` tokens: its pin goes to the forward, its prefix
    locations (and K/V) are prefix's. Returns its Request and pin."""
    backend.radix.release_unadmitted(SimpleNamespace(reqs=[req]))
    (pin,) = backend.radix.take_pins([req])
    r = Request(runner, slot, len(req.origin_input_ids))
    r.locs[:tokens] = prefix.locs[:tokens]  # what prepare_for_extend writes from the prefix indices
    runner.req_to_token_pool.req_to_token[slot, :tokens] = prefix.locs[:tokens].int()
    for lid in range(L):  # the same tokens: the same K/V
        r.k[lid][:tokens], r.v[lid][:tokens] = prefix.k[lid][:tokens], prefix.v[lid][:tokens]
    r.n = tokens
    return r, pin


def arena_pages(backend):
    """The backend's arena: pages held by requests, and pages held only by retained prefixes."""
    host = backend.host
    arena = next(s for s in host.client.stats()["arenas"] if s["client_id"] == host.client.client_id)
    return arena["used_pages"], arena["cached_pages"]


@pytest.mark.parametrize("chunk", [1000, 24])
@pytest.mark.parametrize("export_at", ["finish", "prefill"])
def test_a_hit_skips_the_shared_prefill_and_decodes_like_the_whole_prompt(daemon, chunk, export_at, monkeypatch):
    backend, runner = make_backend(daemon)
    cache, staging = make_cache(runner), runner.token_to_kv_pool.staging
    tokens = list(range(100, 190))  # 90 tokens: 5 full pages and a partial one
    a = Request(runner, 1, len(tokens))
    req_a = sglang_req("a", tokens)
    run_prefill(backend, [a], chunk)
    # The forward that completed the prompt wrote its 5 full pages whole (sink and dense layers included): the export
    # after it only retains them, with no copy (nor device synchronisation) on the scheduler's side.
    assert backend.forward_exported(1) == 5
    export_prefix, backend.engine.export_prefix = backend.engine.export_prefix, None
    exported = backend.radix.exported_pages
    if export_at == "prefill":  # shared while A decodes
        prefilled(cache, a, req_a)
        assert backend.radix.exported_pages == exported + 5
    decode(backend, [a], 3)
    if export_at == "finish":
        finish(cache, backend, runner, a, req_a)
    backend.engine.export_prefix = export_prefix
    assert backend.radix.exported_pages == exported + 5  # 93 tokens: 5 full pages

    # B shares 3.5 pages of A's prompt (a prefix ending mid-page), then its own tokens: 3 pages hit.
    b_tokens = tokens[:56] + list(range(500, 540))
    req_b = sglang_req("b", b_tokens)
    result = match(cache, req_b)
    assert len(result.device_indices) == 3 * P
    assert torch.equal(result.device_indices, a.locs[:3 * P])
    assert req_b._freekv_prefix_pin.tokens == 3 * P
    b, pin = admit(backend, runner, req_b, a, 2, 3 * P)  # the forward takes its pin over
    run_prefill(backend, [b], chunk, pins=[pin])
    assert staging.free_pages == STAGING  # the prefix's staging pages went back with the prompt's
    eng = backend.engine
    assert eng.seq_len(2) == b.prompt and eng._shared[2] == 3
    assert eng.page_table[2, CFG.sink_pages:3].tolist() == list(pin.pages[CFG.sink_pages:])
    b.n = b.prompt
    ref, ref_slots = reference_engine([b])
    assert_filled_alike(eng, [2], ref, ref_slots)  # its slots filled from staging, the shared prefix's pages too
    decode(backend, [b], 12, ref, ref_slots)
    # B's export continues the keys its match hashed (5 full pages of its 96 tokens but the last) with its sixth page.
    hashed, keys_of = [], radix.prefix_keys
    monkeypatch.setattr(radix, "prefix_keys", lambda t, *a, **k: hashed.append(len(t)) or keys_of(t, *a, **k))
    prefilled(cache, b, req_b)
    assert hashed == [P] and len(req_b._freekv_keys) == 6
    monkeypatch.undo()
    assert backend.host.client.lookup_longest(backend.radix.keys(b_tokens, None))[0] == 5
    assert backend.radix.exported_pages == exported + 5 + 3  # B's 3 pages past its shared prefix
    if export_at == "prefill":  # A's pages were exported at its prefill: finishing adds none
        finish(cache, backend, runner, a, req_a)
        assert backend.radix.exported_pages == exported + 8


def test_a_chunked_prompt_is_shared_chunk_by_chunk_while_it_prefills(daemon):
    backend, runner = make_backend(daemon, port=30007)
    cache, radix, eng = make_cache(runner), backend.radix, backend.engine
    tokens = list(range(5000, 5150))  # 150 tokens: 9 full pages and a partial one, in chunks of 40 (2.5 pages)
    a, req_a = Request(runner, 1, len(tokens)), sglang_req("a", tokens)
    exported = radix.exported_pages
    sent, retain = [], backend.host.retain_chain  # (keys, linked to a parent) of each RETAIN_CHAIN
    backend.host.retain_chain = lambda keys, pages, parent=None: (sent.append((len(keys), parent is not None)),
                                                                  retain(keys, pages, parent))[1]
    for full in (2, 5):
        prefill_chunk(backend, [a], 40)
        stash(cache, a, req_a)
        assert radix.exported_pages == exported + full  # its full pages so far, the staged sink page included
    assert sent == [(2, False), (3, True)]  # the second chunk hashes and retains its 3 new pages only
    assert cache.total_size() == 5 * P and runner.token_to_kv_pool.staging.pages(1)  # A is still in prefill

    # B shares 4.5 pages of A's prompt: admitted now, it hits the 4 full pages A's first chunks exported.
    b_tokens = tokens[:72] + list(range(700, 730))
    req_b = sglang_req("b", b_tokens)
    assert torch.equal(match(cache, req_b).device_indices, a.locs[:4 * P])
    b, pin = admit(backend, runner, req_b, a, 2, 4 * P)
    assert pin.tokens == 4 * P and list(pin.pages) == (eng._sink_host[1] + eng._host_pages[1])[:4]
    # A's third chunk and B's suffix in one batch: both rows map A's prefix locations, A's staging pages and B's
    # prefix pages staged from the arena, of equal bytes (prefill_chunk checks every row's prefix reads).
    prefill_chunk(backend, [a, b], 40, pins=[None, pin])
    assert b.n == b.prompt and eng._shared[2] == 4
    stash(cache, a, req_a)
    assert radix.exported_pages == exported + 7
    # A key of A's chain released behind its back (as the daemon would evict it): the next export cannot link to it
    # and retains the whole chain again.
    assert backend.host.client.release(radix.keys(tokens[:7 * P], None)[-1])
    prefill_chunk(backend, [a], 40)  # A's last chunk
    assert a.n == a.prompt
    prefilled(cache, a, req_a)
    assert radix.exported_pages == exported + 9  # only the rest: each full page of A exported once
    assert sent[2:] == [(2, True), (2, True), (9, False)]  # the third chunk linked; the last refused, then whole
    # One chain of A's pages, B's pin its first four; A holds its 10 pages (its sink page once), B its 3 own.
    index, pages = backend.host.client.lookup_longest(radix.keys(tokens[:9 * P], None))
    assert index == 8 and pages == (eng._sink_host[1] + eng._host_pages[1])[:9] and pages[:4] == list(pin.pages)
    assert arena_pages(backend) == (10 + 3, 0)
    ref, ref_slots = reference_engine([a, b])
    decode(backend, [a, b], 12, ref, ref_slots)


def prompt_in_prefill(daemon, port, first_token):
    """A backend with its radix cache, and prompt A (150 tokens from first_token) prefilled in 3 chunks of 40 and
    stashed after each: 120 tokens in, 7 full pages exported, its last chunk to come."""
    backend, runner = make_backend(daemon, port=port)
    cache = make_cache(runner)
    tokens = list(range(first_token, first_token + 150))
    a, req_a = Request(runner, 1, len(tokens)), sglang_req("a", tokens)
    for _ in range(3):
        prefill_chunk(backend, [a], 40)
        stash(cache, a, req_a)
    return backend, runner, cache, tokens, a, req_a


def test_a_hit_on_a_prompt_in_prefill_reads_its_staging_pages(daemon):
    """B hits pages A exported while A still prefills: B's prefix rows read A's staging pages (no copy, no staging room
    taken), and when A's prefill completes first, the pages B still reads pass to B's prefix until B's prompt is in."""
    backend, runner, cache, tokens, a, req_a = prompt_in_prefill(daemon, 30009, 7000)
    radix, staging = backend.radix, backend.staging
    a_pages = list(staging.pages(1))
    req_b = sglang_req("b", tokens[:7 * P] + list(range(800, 860)))  # A's 7 exported pages, then 60 tokens of its own
    room = radix._stage_room()
    assert len(match(cache, req_b).device_indices) == 7 * P
    assert radix._stage_room() == room  # the hit's pages are staged already, as A's
    b, pin = admit(backend, runner, req_b, a, 2, 7 * P)
    assert pin.tokens == 7 * P
    # A's last chunk and B's first 40 own tokens in one batch: B's prefix rows are A's staging pages, filled by nothing.
    prefill_chunk(backend, [a, b], 40, pins=[None, pin])
    prefilled(cache, a, req_a)
    assert radix.prefix_staging(2) == a_pages[:7] and not backend._prefix_fill
    # A's prompt is in and its staging went, except the 7 pages B still reads: each now its host page's prefix owner.
    assert not staging.pages(1)
    assert all(staging.pages(-1 - hp) == [page] for hp, page in zip(pin.pages, a_pages))
    prefill_chunk(backend, [b], 40)  # B's last tokens read its prefix from those pages (checked by prefill_chunk)
    assert b.n == b.prompt and staging.free_pages == staging.num_pages  # B's prompt is in: all staging free
    ref, ref_slots = reference_engine([a, b])
    decode(backend, [a, b], 12, ref, ref_slots)


def test_a_prompt_aborted_mid_prefill_leaves_its_exported_chunks_to_the_tree_and_the_arena(daemon):
    backend, runner, cache, tokens, a, req_a = prompt_in_prefill(daemon, 30008, 6000)
    assert a.n == 120 and arena_pages(backend) == (8, 0)  # 7 full pages exported, the partial eighth A's own
    # Aborted before its last chunk: SGLang's release_kv_cache without insert, then the slot is freed.
    cache.cache_finished_req(req_a, is_insert=False, kv_len_to_handle=a.n)
    on_request_freed(1)
    backend._apply_frees()
    assert arena_pages(backend) == (0, 7)  # its partial page went; the exported pages stay retained
    assert cache.total_size() == cache.evictable_size() == 7 * P  # the tree keeps its chunks, unlocked
    # A request admitted later hits them (the staged sink page A exported included) and decodes like its whole prompt.
    req_c = sglang_req("c", tokens[:7 * P] + list(range(900, 920)))
    assert torch.equal(match(cache, req_c).device_indices, a.locs[:7 * P])
    c, pin = admit(backend, runner, req_c, a, 3, 7 * P)
    run_prefill(backend, [c], 40, pins=[pin])
    ref, ref_slots = reference_engine([c])
    decode(backend, [c], 12, ref, ref_slots)


def finished_prompt(daemon, port, first_token):
    """A backend with its radix cache, and prompt A (100 tokens from first_token) prefilled, finished and freed as the
    next step does: A's own pages gone, its retained prefix (6 full pages) cached."""
    backend, runner = make_backend(daemon, port=port)
    cache = make_cache(runner)
    tokens = list(range(first_token, first_token + 100))
    a = Request(runner, 1, len(tokens))
    run_prefill(backend, [a], 1000)
    finish(cache, backend, runner, a, sglang_req("a", tokens))
    backend._apply_frees()
    return backend, runner, cache, tokens


def test_a_pin_not_admitted_is_let_go_and_staging_bounds_hits(daemon, caplog):
    backend, runner, cache, tokens = finished_prompt(daemon, 30001, 1000)

    assert arena_pages(backend)[0] == 0
    waiting = sglang_req("w", tokens[:80] + [1])
    assert len(match(cache, waiting).device_indices) == 5 * P
    assert arena_pages(backend)[0] == 5  # pinned for the request
    backend.radix.release_unadmitted(SimpleNamespace(reqs=[]))  # not admitted: its pin goes
    assert not hasattr(waiting, "_freekv_prefix_pin") and arena_pages(backend)[0] == 0
    # Rows sharing a prefix stage its pages once: many sharers fit in one batch's staging room.
    room = backend.radix._stage_room()
    sharers = [sglang_req(f"s{i}", tokens[:80] + [i]) for i in range(room)]
    assert all(len(match(cache, r).device_indices) == 5 * P for r in sharers) and backend.radix._stage_room() == room - 5
    assert arena_pages(backend)[0] == 5  # pages held once however many requests pin them
    backend.radix.release_unadmitted(None)
    assert not backend.radix._pending_hp and arena_pages(backend)[0] == 0
    # With room for 2 pages only, a 5-page hit is pinned short, and the cut is counted (logged with the stats).
    backend.radix._stage_room = lambda: 2
    assert len(match(cache, sglang_req("short", tokens[:80] + [1])).device_indices) == 2 * P
    assert (backend.radix.cut_matches, backend.radix.cut_pages) == (1, 3)
    backend.radix.release_unadmitted(None)
    with caplog.at_level("INFO", logger="freekv_sglang.sglang_backend"):
        backend._log_stats(merged_stats(backend._snapshots()))
    assert "0 matches deferred for staging room, 1 cut to it (3 pages short)" in caplog.text


def test_ranking_pins_nothing_and_a_hit_short_of_held_room_waits(daemon):
    # The policy's ranking matches every waiting request: tree matches only, no pins. At admission a hit that does
    # not fit the room another admitted hit holds is deferred (the adder seam closes the batch), not cut.
    from sglang.srt.managers.schedule_policy import AddReqResult

    from freekv_patches import prefill_adder_add_one_req as adder_seam
    from freekv_patches import schedule_policy_calc_priority as rank_seam

    backend, runner = make_backend(daemon, port=30004)
    cache = make_cache(runner)
    first, second = list(range(5000, 5100)), list(range(6000, 6100))
    for rid, tokens in (("a", first), ("b", second)):
        req = Request(runner, 1, len(tokens))
        run_prefill(backend, [req], 1000)
        finish(cache, backend, runner, req, sglang_req(rid, tokens))
        backend._apply_frees()
    x, y = sglang_req("x", first[:80] + [1]), sglang_req("y", second[:80] + [1])
    ranked = rank_seam.hook(lambda self, queue, running: [len(match(cache, r).device_indices) for r in queue],
                            None, [x, y])
    assert ranked == [5 * P, 5 * P]  # the tree's matches
    assert not hasattr(x, "_freekv_prefix_pin") and not hasattr(y, "_freekv_prefix_pin")
    assert arena_pages(backend)[0] == 0 and not backend.radix.ranking
    # Admission: x pins 5 pages; with room for 7, y's 5 new pages do not fit beside them: y waits.
    room = backend.radix._stage_room
    backend.radix._stage_room = lambda: 7 - len(backend.radix._pending_hp)
    assert len(match(cache, x).device_indices) == 5 * P
    admitted = adder_seam.hook(lambda self, req, chunked, align: AddReqResult.CONTINUE, None, x, False, None)
    assert admitted == AddReqResult.CONTINUE
    assert len(match(cache, y).device_indices) == 0 and not hasattr(y, "_freekv_prefix_pin")
    assert adder_seam.hook(lambda *a: AddReqResult.CONTINUE, None, y, False, None) == AddReqResult.OTHER
    assert (backend.radix.deferred_matches, backend.radix.cut_matches) == (1, 0)
    assert arena_pages(backend)[0] == 5  # x's pin only
    # Waiting is bounded: past DEFER_LIMIT_S from its first deferral the hit is admitted cut to the room.
    y._freekv_deferred_since -= radix.DEFER_LIMIT_S
    assert len(match(cache, y).device_indices) == 2 * P and y._freekv_prefix_pin.tokens == 2 * P
    assert adder_seam.hook(lambda *a: AddReqResult.CONTINUE, None, y, False, None) == AddReqResult.CONTINUE
    assert (backend.radix.deferred_matches, backend.radix.cut_matches) == (1, 1)
    backend.radix.drop_pin(y)
    assert not hasattr(y, "_freekv_deferred_since")  # a later wait starts its own clock
    # Next round, x's prefill done and its pin gone: y fits whole.
    backend.radix.release_unadmitted(None)
    backend.radix._stage_room = room
    assert len(match(cache, y).device_indices) == 5 * P
    assert adder_seam.hook(lambda *a: AddReqResult.CONTINUE, None, y, False, None) == AddReqResult.CONTINUE
    backend.radix.release_unadmitted(None)
    assert arena_pages(backend)[0] == 0


def test_the_scheduler_seam_keeps_the_pins_of_the_batch_it_built(daemon):
    # get_new_batch_prefill returns a NextBatchPlan: the pins of the requests in its batch_to_run are the forward's.
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    from freekv_patches import scheduler_get_new_batch_prefill as seam

    backend, runner = make_backend(daemon, port=30003)
    cache = make_cache(runner)
    tokens = list(range(3000, 3050))
    a = Request(runner, 1, len(tokens))
    run_prefill(backend, [a], 1000)
    finish(cache, backend, runner, a, sglang_req("a", tokens))
    admitted, waiting = sglang_req("x", tokens[:40] + [1]), sglang_req("y", tokens[:40] + [2])
    assert len(match(cache, admitted).device_indices) == len(match(cache, waiting).device_indices) == 2 * P
    scheduler = SimpleNamespace(server_args=SimpleNamespace(_freekv=object()), waiting_queue=[])
    plan = NextBatchPlan(batch_to_run=SimpleNamespace(reqs=[admitted]), running_batch=None)
    assert seam.hook(lambda self, running: plan, scheduler, None) is plan
    assert admitted._freekv_prefix_pin.tokens == 2 * P and not hasattr(waiting, "_freekv_prefix_pin")
    (pin,) = backend.radix.take_pins([admitted])
    assert pin is not None
    backend.host.free(pin.owner)
    seam.hook(lambda self, running: NextBatchPlan(batch_to_run=None, running_batch=None), scheduler, None)


def test_the_kvstore_client_id_is_stable_across_restarts(daemon, monkeypatch):
    # One backend per scheduler process, as in a server (this test process has built others).
    monkeypatch.setattr(sglang_backend, "_INSTANCE", itertools.count())
    backend, runner = make_backend(daemon, port=30002)
    cid = backend.host.client.client_id
    assert cid.startswith("tiny-") and cid.endswith("-port30002-tp0")
    tokens = list(range(2000, 2050))
    a = Request(runner, 1, len(tokens))
    run_prefill(backend, [a], 1000)
    cache = make_cache(runner)
    finish(cache, backend, runner, a, sglang_req("a", tokens))
    backend._apply_frees()
    backend.host.close()  # the server stops; its retained prefix stays in the daemon
    monkeypatch.setattr(sglang_backend, "_INSTANCE", itertools.count())
    again, _ = make_backend(daemon, port=30002)
    assert again.host.client.client_id == cid and again.host.client.reattached
    keys = again.radix.keys(tokens[:48], None)
    assert again.host.client.lookup_longest(keys) is not None


@pytest.mark.parametrize("how", ["restart", "evicted"])
def test_a_prefix_the_tree_lacks_is_loaded_from_the_arena(daemon, monkeypatch, how):
    # The arena keeps a retained prefix whole (dense layers' slices included) while the tree lost it: evicted there,
    # or a new server on the same arena (its tree starts empty). A hit loads the dense layers into new token slots.
    monkeypatch.setattr(sglang_backend, "_INSTANCE", itertools.count())
    backend, runner = make_backend(daemon, port=30005 if how == "restart" else 30006)
    cache = make_cache(runner)
    tokens = list(range(4000, 4090))
    a = Request(runner, 1, len(tokens))
    run_prefill(backend, [a], 24)
    finish(cache, backend, runner, a, sglang_req("a", tokens))
    backend._apply_frees()
    if how == "restart":
        backend.host.close()
        monkeypatch.setattr(sglang_backend, "_INSTANCE", itertools.count())
        backend, runner = make_backend(daemon, port=30005)  # a new token pool: the dense layer's slots hold zeros
        assert backend.host.client.reattached
        cache = make_cache(runner)
    else:
        cache.evict(EvictParams(num_tokens=TOKENS))
    assert cache.total_size() == 0
    b_tokens = tokens[:56] + list(range(600, 640))
    req_b = sglang_req("b", b_tokens)
    result = match(cache, req_b)
    assert len(result.device_indices) == 3 * P and cache.total_size() == 3 * P
    assert req_b._freekv_prefix_pin.tokens == 3 * P
    locs = result.device_indices
    pool = runner.token_to_kv_pool
    torch.testing.assert_close(pool.get_key_buffer(0)[locs], a.k[0][:3 * P], atol=0, rtol=0)
    torch.testing.assert_close(pool.get_value_buffer(0)[locs], a.v[0][:3 * P], atol=0, rtol=0)
    # Matched again (another request of that prefix), the tree holds it now.
    other = sglang_req("c", b_tokens[:50] + [1])
    assert torch.equal(match(cache, other).device_indices, locs)
    backend.radix.release_unadmitted(SimpleNamespace(reqs=[req_b]))
    (pin,) = backend.radix.take_pins([req_b])
    b = Request(runner, 2, len(b_tokens))
    b.locs[:3 * P] = locs
    runner.req_to_token_pool.req_to_token[2, :3 * P] = locs.int()
    for lid in range(L):
        b.k[lid][:3 * P], b.v[lid][:3 * P] = a.k[lid][:3 * P], a.v[lid][:3 * P]
    b.n = 3 * P
    run_prefill(backend, [b], 24, pins=[pin])  # every layer's prefix reads (dense and sparse) see A's keys
    b.n = b.prompt
    ref, ref_slots = reference_engine([b])
    decode(backend, [b], 12, ref, ref_slots)


def test_a_full_arena_at_export_leaves_the_prompt_unshared_and_the_request_running(daemon):
    """The export needs host pages for the prompt's sink pages (the rest are the request's already), taken when its
    last chunk is prepared (the forward writes them): with the arena full but for the prompt's own pages it gets
    ArenaFull from the real daemon, there and at the export after the forward. The prompt is then not shared,
    nothing raises into the scheduler, the request decodes on, and a later match finds nothing in the arena."""
    backend, runner = make_backend(daemon, port=30009)
    cache, radix, client = make_cache(runner), backend.radix, backend.host.client
    tokens = list(range(7000, 7100))
    a, req_a = Request(runner, 1, len(tokens)), sglang_req("a", tokens)
    arena = next(s for s in client.stats()["arenas"] if s["client_id"] == client.client_id)
    filler, own = 10**6, -(-len(tokens) // P) - CFG.sink_pages
    client.alloc(filler, arena["free_pages"] - own)  # another owner takes every page the prompt does not
    run_prefill(backend, [a], 1000)
    assert backend.forward_exported(1) == 0
    exported = radix.exported_pages
    prefilled(cache, a, req_a)
    assert radix.exported_pages == exported and radix.export_failures == 1
    assert client.lookup_longest(radix.keys(tokens[:6 * P], None)) is None
    ref, ref_slots = reference_engine([a])
    decode(backend, [a], 8, ref, ref_slots)
    client.free(filler)
    req_b = sglang_req("b", tokens[:80] + [1, 2, 3])
    assert len(match(cache, req_b).device_indices) == 0  # the tree's match is cut to the arena's (none)
    finish(cache, backend, runner, a, req_a)  # with room again, the export at finish shares it
    assert radix.exported_pages == exported + 6


def finish_two(daemon, port, together):
    """Two requests prefilled and decoded past a sixth full page each (the prefill's forward wrote five), then
    finished, in one step's results when together (through the process_batch_result seam). Returns the
    backend, the requests and the sparse layers of the offload launches their exports made."""
    torch.manual_seed(7)
    backend, runner = make_backend(daemon, port=port)
    cache = make_cache(runner)
    rs = [Request(runner, slot, 90) for slot in (1, 2)]
    reqs = [sglang_req(name, list(range(first, first + 90))) for name, first in (("a", 100), ("b", 300))]
    run_prefill(backend, rs, 1000)
    for r, req in zip(rs, reqs):
        prefilled(cache, r, req)  # their five full prompt pages retained
    decode(backend, rs, 10)
    eng, calls = backend.engine, []
    offload = eng._offload
    eng._offload = lambda layer, *a, **k: calls.append(layer) or offload(layer, *a, **k)
    exported = backend.radix.exported_pages

    def process_results(scheduler, batch, result):  # SGLang's processing of the step that finishes both
        for r, req in zip(rs, reqs):
            finish(cache, backend, runner, r, req)
        if together:  # nothing written or retained before the step's results are processed
            assert backend.radix.exported_pages == exported and not calls

    if together:
        from freekv_patches import scheduler_process_batch_result as seam

        seam.hook(process_results, None, None, None)
    else:
        process_results(None, None, None)
    assert backend.radix.exported_pages == exported + 2
    assert [eng._complete[r.slot] for r in rs] == [6, 6]  # complete in the arena: a later export writes none again
    return backend, reqs, calls


def test_requests_finishing_in_one_step_are_exported_together(daemon):
    """One offload launch a sparse layer for both requests instead of one each, and the arena then holds for each the
    chain and the bytes (every layer, the page summaries too) that exporting them one by one retains."""
    apart, reqs, calls_apart = finish_two(daemon, 30011, together=False)
    together, _, calls_together = finish_two(daemon, 30012, together=True)
    sparse = [layer for layer in range(L) if layer >= CFG.dense_layers]
    assert calls_apart == sparse * 2 and calls_together == sparse
    for req in reqs:
        tokens = list(req.origin_input_ids) + [7] * 10
        hits = [b.host.client.lookup_longest(b.radix.keys(tokens, None)) for b in (apart, together)]
        assert hits[0][0] == hits[1][0] == 5  # the sixth key (its index) is the last retained
        (_, pages_apart), (_, pages_together) = hits
        assert len(pages_apart) == len(pages_together) == 6
        assert torch.equal(apart.host.arena[list(pages_apart)], together.host.arena[list(pages_together)])
        for layer in sparse:
            assert torch.equal(apart.engine.summaries[layer][list(pages_apart)],
                               together.engine.summaries[layer][list(pages_together)])


@pytest.fixture(scope="module")
def small_daemon():
    handle = start_embedded(arena_gb=0.05)  # the module's daemon is full of its tests' arenas by the end of the file
    yield handle
    handle.stop()


def test_a_steps_finished_requests_free_their_host_pages_in_one_kvstore_call(small_daemon, monkeypatch):
    backend, runner = make_backend(small_daemon, port=30011)
    rs = [Request(runner, slot, 70) for slot in (1, 2, 3)]
    run_prefill(backend, rs, 1000)
    held = arena_pages(backend)[0]
    assert held > 0
    calls = []
    free_many = backend.host.client.free_many
    monkeypatch.setattr(backend.host.client, "free_many", lambda ids: (calls.append(list(ids)), free_many(ids))[1])
    for r in rs:
        on_request_freed(r.slot)
    backend._apply_frees()
    assert [sorted(c) for c in calls] == [sorted(backend.engine._owner[r.slot] for r in rs)]
    assert arena_pages(backend)[0] == 0 and backend.host.used_pages == 0
    assert not any(backend.engine.is_active(r.slot) for r in rs)


def test_a_request_matched_again_hashes_its_prompt_once(small_daemon, monkeypatch):
    backend, runner, cache, tokens = finished_prompt(small_daemon, 30012, 4000)
    req = sglang_req("x", tokens[:80] + [1, 2, 3])
    hashed = []
    keys = backend.radix.keys
    monkeypatch.setattr(backend.radix, "keys", lambda *args: (hashed.append(1), keys(*args))[1])
    for _ in range(3):  # not admitted: matched again every scheduling round, to the same retained prefix
        assert len(match(cache, req).device_indices) == 5 * P
        backend.radix.release_unadmitted(SimpleNamespace(reqs=[]))
    assert len(hashed) == 1


def test_a_prompt_completed_in_a_step_is_retained_once_the_steps_results_are_processed(small_daemon):
    """Its forward wrote its pages; the RETAIN_CHAIN waits for the end of batched_exports (after the step's tokens
    went out), before the exports of the requests the step finished."""
    backend, runner = make_backend(small_daemon, port=30013)
    cache, radix = make_cache(runner), backend.radix
    tokens, done_tokens = list(range(5000, 5090)), list(range(6000, 6090))  # 5 full pages each
    a, req_a = Request(runner, 1, len(tokens)), sglang_req("a", tokens)
    b, req_b = Request(runner, 2, len(done_tokens)), sglang_req("b", done_tokens)
    run_prefill(backend, [b], 1000)
    decode(backend, [b], 2)
    run_prefill(backend, [a], 1000)
    assert backend.forward_exported(1) == 5
    exported = radix.exported_pages
    with radix.batched_exports():
        prefilled(cache, a, req_a)
        finish(cache, backend, runner, b, req_b)
        assert radix.exported_pages == exported
        assert backend.host.client.lookup_longest(radix.keys(tokens[:5 * P], None)) is None
    assert radix.exported_pages == exported + 10
    assert backend.host.client.lookup_longest(radix.keys(tokens[:5 * P], None))[0] == 4
    assert backend.host.client.lookup_longest(radix.keys(done_tokens[:5 * P], None))[0] == 4


class Landed:
    """A device event as retain_written reads it: query() is whether the copies queued before it are done;
    synchronize() waits for them."""

    def __init__(self) -> None:
        self.done = self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


def stand_in_landings(radix, monkeypatch) -> list[Landed]:
    """The events the stashes record from now on (a Landed each, in order), which the test completes by hand."""
    events = []
    monkeypatch.setattr(radix, "_copies_queued", lambda: (events.append(Landed()), events[-1])[1])
    return events


def test_a_stashed_chunk_is_retained_once_its_copies_land_oldest_first(small_daemon, monkeypatch):
    """No wait at a stash: its copies are queued, and its pages retained by a later export (or the end of a step's
    results) once they have landed, in stash order (a chunk's keys link to the one before). A slot freed with its
    copies in flight waits for them before its pages go back (and retains them); a chunk whose host pages went with
    a lost kvstore session is dropped."""
    backend, runner = make_backend(small_daemon, port=30014)
    cache, radix = make_cache(runner), backend.radix
    events = stand_in_landings(radix, monkeypatch)
    tokens = list(range(7000, 7150))
    a, req_a = Request(runner, 1, len(tokens)), sglang_req("a", tokens)
    keys = radix.keys(tokens[:9 * P], None)
    exported = radix.exported_pages
    for _ in range(2):
        prefill_chunk(backend, [a], 40)
        stash(cache, a, req_a)
    assert radix.exported_pages == exported and len(events) == 2  # both in flight: nothing retained
    assert backend.host.client.lookup_longest(keys) is None
    events[1].done = True
    assert radix.retain_written() == 0  # the second landed, but the first (its parent) not yet
    events[0].done = True
    with radix.batched_exports():  # the end of a step's results retains what landed
        pass
    assert radix.exported_pages == exported + 5 and backend.host.client.lookup_longest(keys)[0] == 4

    prefill_chunk(backend, [a], 40)
    stash(cache, a, req_a)  # in flight when A is aborted and its slot freed
    on_request_freed(a.slot)
    backend._apply_frees()
    assert events[2].waited and radix.exported_pages == exported + 7
    assert backend.host.client.lookup_longest(keys)[0] == 6 and not backend.engine.is_active(a.slot)

    b_tokens = list(range(8000, 8150))
    b, req_b = Request(runner, 2, len(b_tokens)), sglang_req("b", b_tokens)
    prefill_chunk(backend, [b], 40)
    stash(cache, b, req_b)  # in flight when the kvstore session holding B's pages is lost
    monkeypatch.setattr(backend.host, "owner_lost", lambda owner: owner == backend._owner(b.slot))
    events[3].done = True
    assert radix.retain_written() == 0 and not radix._written
    assert backend.host.client.lookup_longest(radix.keys(b_tokens[:2 * P], None)) is None


def test_a_request_sharing_a_chunk_in_flight_waits_for_it_when_the_batch_can_take_it(small_daemon, monkeypatch):
    """A sharer matched while the prompt's chunk still runs (its copies queued, not landed) stops short of it; the adder
    seam waits for those copies and matches it again when the batch being built has room for it, so it hits the chunk
    (full KV's tree serves an in-flight chunk). With no room (the chunked prompt fills the batch) nothing waits; a
    request sharing nothing of the chunks never waits."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from freekv_patches import prefill_adder_add_one_req as adder_seam

    backend, runner = make_backend(small_daemon, port=30015)
    cache, radix = make_cache(runner), backend.radix
    events = stand_in_landings(radix, monkeypatch)
    tokens = list(range(9000, 9150))
    a, req_a = Request(runner, 1, len(tokens)), sglang_req("a", tokens)
    for _ in range(2):
        prefill_chunk(backend, [a], 40)
        stash(cache, a, req_a)
    assert len(events) == 2 and not any(e.done for e in events)

    def admit(req, budget):
        """SGLang's loop: match the request (init_next_round_input), then ask the adder (through the seam)."""
        req.init_next_round_input(cache)
        adder = SimpleNamespace(budget_state=lambda: budget, tree_cache=cache)
        assert adder_seam.hook(lambda *args: AddReqResult.CONTINUE, adder, req, True, None) == AddReqResult.CONTINUE
        matched = len(req.prefix_indices)
        radix.release_unadmitted(SimpleNamespace(reqs=[]))
        return matched

    assert admit(sglang_req("o", list(range(20000, 20100))), AddReqResult.CONTINUE) == 0
    sharer = sglang_req("s", tokens[:80] + [1, 2, 3])
    assert admit(sharer, AddReqResult.OTHER) == 0  # the chunked prompt fills the batch: no wait
    assert not any(e.waited for e in events) and len(radix._written) == 2
    first_chunk = sglang_req("c", tokens[:40] + [1, 2, 3] * 20)  # shares only the first chunk's pages
    assert admit(first_chunk, AddReqResult.CONTINUE) == 40 // P * P
    assert events[0].waited and not events[1].waited and len(radix._written) == 1
    assert admit(sharer, AddReqResult.CONTINUE) == 80 // P * P
    assert events[1].waited and not radix._written
