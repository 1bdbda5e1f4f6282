"""FreeKVAttnBackend's glue, on CPU: FreeKV's real token pool (SGLang's MHATokenToKVPool with staging pages for
the sparse layers), a duck-typed runner, wrapped backend and batches, and a real kvstore daemon.

Prompts are prefilled in chunks through the wrapped backend: its writes and its prefix reads must land in
staging, the staging pages must be released when a prompt completes (or is freed mid-prefill), and decoding
must then match an engine fed the same prompts directly. Batches without the hooks' host-side fields, and
decode rows FreeKV never prefilled, are refused.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from freekv_kvstore import start_embedded
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_sglang.server_args import FreeKVServerSettings
from freekv_sglang import sglang_backend
from freekv_sglang.sglang_backend import FreeKVAttnBackend, on_request_freed

L, HQ, H, D, P = 3, 6, 2, 16, 16  # head dim 16: below the default channel sketch's 32 channels
CFG = FreeKVConfig(selection="sketch", budget=32, sink=16, window=16, page_size=P, tau=0.6, dense_layers=1)
SIZE, CTX, TOKENS, STAGING = 6, 512, 8192, 40  # request slots 1..SIZE (0 pads), max context, pool tokens


def make_pool(head_dim=D):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from freekv_patches._staging_pool import staging_pool_class

    return staging_pool_class(MHATokenToKVPool)(
        TOKENS, page_size=P, dtype=torch.float32, head_num=H, head_dim=head_dim, layer_num=L, device="cpu",
        enable_memory_saver=False, start_layer=0, end_layer=L, enable_alt_stream=False, enable_kv_cache_copy=False,
        post_capture_active=False, freekv_dense_layers=CFG.dense_layers, freekv_staging_pages=STAGING)


class Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode


class Inner:
    """The wrapped backend, Triton-like: plans the prefix locations of an extend batch, writes the chunk through
    the pool and reads the prefix at the (by then translated) planned locations."""

    def __init__(self, runner):
        self.runner, self.calls, self.prefix_reads = runner, [], []

    def init_forward_metadata(self, fb):
        self.calls.append("meta")
        if fb.forward_mode.is_extend():
            rt = self.runner.req_to_token_pool.req_to_token
            rows = [rt[s, :a].long() for s, a in zip(fb._freekv_req_slots_cpu.tolist(), fb.extend_prefix_lens_cpu)]
            self.forward_metadata = SimpleNamespace(kv_indices=torch.cat(rows))

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.calls.append("out_graph")

    def init_forward_metadata_in_graph(self, fb):
        self.calls.append("in_graph")

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        pool = self.runner.token_to_kv_pool
        pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, H, D), v.view(-1, H, D))
        idx = self.forward_metadata.kv_indices
        self.prefix_reads.append((layer.layer_id, pool.get_key_buffer(layer.layer_id)[idx].clone()))
        return torch.zeros_like(q)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("decode", layer.layer_id))
        return torch.zeros_like(q)


class UnifiedInner(Inner):
    """Triton's extend under --enable-deterministic-inference (its unified kernel): the chunk is written only when
    save_kv_cache, and read back, with the prefix, from the pool at out_cache_loc."""

    enable_deterministic = True

    def __init__(self, runner):
        super().__init__(runner)
        self.chunk_reads = []

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        pool = self.runner.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, H, D), v.view(-1, H, D))
        keys = pool.get_key_buffer(layer.layer_id)
        self.prefix_reads.append((layer.layer_id, keys[self.forward_metadata.kv_indices].clone()))
        self.chunk_reads.append((layer.layer_id, keys[fb.out_cache_loc].clone()))
        return torch.zeros_like(q)


@pytest.fixture(scope="module")
def daemon():
    handle = start_embedded(arena_gb=0.2)  # every test keeps its backend connected
    yield handle
    handle.stop()


def make_backend(daemon, tail_hooks=True, inner=Inner, timeout_s=5.0, cfg=CFG, tsp=None, head_dim=D, early=None):
    model_config = SimpleNamespace(num_hidden_layers=L, num_attention_heads=HQ, head_dim=head_dim,
                                   get_num_kv_heads=lambda tp: H // tp)
    req_pool = SimpleNamespace(size=SIZE, req_to_token=torch.zeros(SIZE + 1, CTX, dtype=torch.int32),
                               req_generation=torch.zeros(SIZE + 1, dtype=torch.int64))
    runner = SimpleNamespace(model_config=model_config, tp_size=1, tp_rank=0, token_to_kv_pool=make_pool(head_dim),
                             req_to_token_pool=req_pool, kv_cache_dtype=torch.float32, page_size=P, device="cpu",
                             next_page=1, capture_tail_hooks=[])  # page 0 absorbs padding writes
    if not tail_hooks:
        del runner.capture_tail_hooks
    if tsp is not None:
        runner._freekv_tsp = tsp
    if early is not None:
        runner._freekv_early = early
    settings = FreeKVServerSettings(config=cfg, kvstore_endpoint=daemon.endpoint, kvstore_arena_gb=0.01,
                                    kvstore_timeout_s=timeout_s)
    return FreeKVAttnBackend(runner, inner(runner), settings), runner


def layers():
    return [SimpleNamespace(layer_id=i, scaling=1 / math.sqrt(D), logit_cap=0.0) for i in range(L)]


class Request:
    """A request as SGLang holds it: page-aligned token locations, a prompt, and how much of it is prefilled."""

    def __init__(self, runner, slot: int, n: int):
        self.slot, self.prompt, self.n = slot, n, 0
        rp = runner.req_to_token_pool
        rp.req_generation[slot] += 1
        pages = -(-CTX // P)
        rp.req_to_token[slot] = torch.arange(runner.next_page * P, (runner.next_page + pages) * P)[:CTX].int()
        runner.next_page += pages
        self.locs = rp.req_to_token[slot].long()
        self.k = [torch.randn(n, H, D) for _ in range(L)]
        self.v = [torch.randn(n, H, D) for _ in range(L)]
        self.q = [torch.randn(n, HQ, D) for _ in range(L)]

    def chunk_q(self, layer: int, a: int, b: int) -> torch.Tensor:
        return self.q[layer][a:b].reshape(b - a, HQ * D)


def extend_batch(reqs, chunk: int):
    """The next chunk of each request (SGLang's chunked prefill); returns the batch and its rows' ranges."""
    ranges = [(r.n, min(r.n + chunk, r.prompt)) for r in reqs]
    fb = SimpleNamespace(
        forward_mode=Mode(decode=False), batch_size=len(reqs),
        seq_lens_cpu=torch.tensor([b for _, b in ranges]), extend_prefix_lens_cpu=[a for a, _ in ranges],
        seq_lens_sum=sum(b for _, b in ranges),
        out_cache_loc=torch.cat([r.locs[a:b] for r, (a, b) in zip(reqs, ranges)]),
        _freekv_req_slots_cpu=torch.tensor([r.slot for r in reqs]), _freekv_raw_bs=len(reqs),
        _freekv_prefill_done_cpu=[b == r.prompt for r, (_, b) in zip(reqs, ranges)])
    return fb, ranges


def extend_once(backend, reqs, chunk: int):
    """One extend batch: the next chunk of each request; each sparse layer's prefix reads (and chunk reads, for a
    backend that reads the chunk from the pool) see the prompt's keys."""
    fb, ranges = extend_batch(reqs, chunk)
    backend.init_forward_metadata(fb)
    inner = backend.inner
    inner.prefix_reads.clear()
    for layer in layers():
        rows = torch.cat([r.k[layer.layer_id][a:b] for r, (a, b) in zip(reqs, ranges)])
        v = torch.cat([r.v[layer.layer_id][a:b] for r, (a, b) in zip(reqs, ranges)])
        q = torch.cat([r.chunk_q(layer.layer_id, a, b) for r, (a, b) in zip(reqs, ranges)])
        backend.forward_extend(q, rows.reshape(len(rows), -1),
                               v.reshape(len(rows), -1), layer, fb)
    for lid, read in inner.prefix_reads:
        want = torch.cat([r.k[lid][:a] for r, (a, _) in zip(reqs, ranges)])
        torch.testing.assert_close(read, want, atol=0, rtol=0)
    for lid, read in getattr(inner, "chunk_reads", ()):
        torch.testing.assert_close(read, torch.cat([r.k[lid][a:b] for r, (a, b) in zip(reqs, ranges)]),
                                   atol=0, rtol=0)
    if hasattr(inner, "chunk_reads"):
        inner.chunk_reads.clear()
    for r, (_, b) in zip(reqs, ranges):
        r.n = b


def prefill(backend, reqs, chunk: int):
    """Prefill every prompt in chunks (extend_once until each prompt is in)."""
    while any(r.n < r.prompt for r in reqs):
        extend_once(backend, [r for r in reqs if r.n < r.prompt], chunk)


def decode_batch(reqs, pad_to=None):
    """The ForwardBatch of one decode step (lengths include the new token)."""
    for r in reqs:
        r.n += 1
    bs = pad_to or len(reqs)
    slots = torch.tensor([r.slot for r in reqs] + [0] * (bs - len(reqs)))
    lens = torch.tensor([r.n for r in reqs] + [1] * (bs - len(reqs)))
    return SimpleNamespace(forward_mode=Mode(decode=True), batch_size=bs, seq_lens_cpu=lens,
                           out_cache_loc=torch.tensor([int(r.locs[r.n - 1]) for r in reqs] + [0] * (bs - len(reqs))),
                           _freekv_req_slots_cpu=slots, _freekv_raw_bs=len(reqs))


def reference_engine(reqs, cfg=CFG):
    """An engine given each whole prompt, its last query and its slots filled from the host (the backend fills them
    from staging)."""
    shape = ModelShape(L, HQ, H, D)
    eng = FreeKVEngine(cfg, shape, max_requests=len(reqs), max_context=CTX, dtype=torch.float32, device="cpu")
    slots = []
    for r in reqs:
        s = eng.add_request()
        eng.begin_prefill(s, r.prompt)
        for layer in range(L):
            eng.prefill_layer(s, layer, r.k[layer], r.v[layer], r.q[layer][-1])
        slots.append(s)
    eng.fill_slots(slots)
    return eng, slots


def assert_filled_alike(eng, slots, ref, ref_slots):
    """The prefill left the same pages in the same slots of every sparse layer as the reference engine's fill, with
    the same bytes, and the same last queries."""
    p, lay = eng.cfg.page_size, eng.layout
    for layer in range(CFG.dense_layers, L):
        assert torch.equal(eng.prev_q[layer, slots], ref.prev_q[layer, ref_slots])
        assert eng.has_prev[layer, slots].all()
        for s, r in zip(slots, ref_slots):
            table = eng.slot_table[layer, s]
            assert torch.equal(table, ref.slot_table[layer, r]) and (table >= 0).any()
            for h, i in (table >= 0).nonzero().tolist():
                a, b = (lay.sparse_base(x) + CFG.sink_pages + i for x in (s, r))
                for mine, theirs in ((eng.k_cache, ref.k_cache), (eng.v_cache, ref.v_cache)):
                    assert torch.equal(mine[layer][a * p:(a + 1) * p, h], theirs[layer][b * p:(b + 1) * p, h])


@pytest.mark.parametrize("chunk", [1000, 37, 16])
def test_chunked_prefill_stages_then_decodes_like_the_engine(daemon, chunk):
    backend, runner = make_backend(daemon)
    pool = runner.token_to_kv_pool
    reqs = [Request(runner, 3, 150), Request(runner, 5, 70)]
    prefill(backend, reqs, chunk)
    assert pool.staging.free_pages == STAGING  # every prompt completed: its staging pages are back
    ref, ref_slots = reference_engine(reqs)
    assert_filled_alike(backend.engine, [3, 5], ref, ref_slots)
    lay = layers()
    for step in range(20):
        fb = decode_batch(reqs, pad_to=4 if step % 2 else None)  # odd steps: a padded replay view
        backend.init_forward_metadata(fb)
        plan = ref.begin_step(ref_slots)
        for layer in lay:
            bs = fb.batch_size
            q, k, v = torch.randn(bs, HQ * D), torch.randn(bs, H * D), torch.randn(bs, H * D)
            staged = [b.clone() for b in pool.k_buffer[1:]]
            out = backend.forward_decode(q, k, v, layer, fb)
            assert all(torch.equal(a, b) for a, b in zip(staged, pool.k_buffer[1:]))  # decode writes no staging
            if layer.layer_id < CFG.dense_layers:
                assert backend.inner.calls[-1] == ("decode", layer.layer_id)
                continue
            want = ref.attend(plan, layer.layer_id, q[:2].view(2, HQ, D), k[:2].view(2, H, D), v[:2].view(2, H, D))
            torch.testing.assert_close(out[:2], want.reshape(2, HQ * D), atol=1e-6, rtol=1e-6)
        ref.end_step()
    eng = backend.engine
    assert eng.seq_len(3) == reqs[0].n and eng.seq_len(5) == reqs[1].n

    # Finish request 3: its slot is released at the next step; a new request in slot 3 is prefilled afresh.
    on_request_freed(3)
    fb = decode_batch(reqs[1:])
    backend.init_forward_metadata(fb)
    assert not eng.is_active(3)
    for layer in lay:
        backend.forward_decode(torch.randn(1, HQ * D), torch.randn(1, H * D), torch.randn(1, H * D), layer, fb)
    new = Request(runner, 3, 40)
    prefill(backend, [new], chunk)
    backend.init_forward_metadata(decode_batch([new, reqs[1]]))
    assert eng.is_active(3) and eng.seq_len(3) == new.n


def test_sparse_layers_apply_the_checkpoints_kv_scales(daemon):
    """A layer carrying KV scales (a quantized checkpoint's, over a 16-bit cache) decodes through the engine's own
    attention with them: the reference engine's attend(kv_scale=) (test_engine checks that against scaled attention)."""
    backend, runner = make_backend(daemon)
    reqs = [Request(runner, 3, 150), Request(runner, 5, 70)]
    prefill(backend, reqs, 64)
    ref, ref_slots = reference_engine(reqs)
    scaled = [SimpleNamespace(**vars(layer), k_scale=torch.tensor(0.6), v_scale=torch.tensor(1.7), k_scale_float=0.6,
                              v_scale_float=1.7) for layer in layers()]
    for _ in range(3):
        fb = decode_batch(reqs)
        backend.init_forward_metadata(fb)
        plan = ref.begin_step(ref_slots)
        for layer in scaled:
            q, k, v = torch.randn(2, HQ * D), torch.randn(2, H * D), torch.randn(2, H * D)
            out = backend.forward_decode(q, k, v, layer, fb)
            if layer.layer_id >= CFG.dense_layers:
                want = ref.attend(plan, layer.layer_id, q.view(2, HQ, D), k.view(2, H, D), v.view(2, H, D),
                                  kv_scale=(0.6, 1.7))
                torch.testing.assert_close(out, want.reshape(2, HQ * D), atol=1e-6, rtol=1e-6)
        ref.end_step()
    broken = SimpleNamespace(**vars(scaled[-1]))
    broken.k_scale_float = None  # scales set, their floats not: refused naming the flag, not a TypeError
    fb = decode_batch(reqs)
    backend.init_forward_metadata(fb)
    for layer in scaled[:-1]:
        backend.forward_decode(torch.randn(2, HQ * D), torch.randn(2, H * D), torch.randn(2, H * D), layer, fb)
    with pytest.raises(RuntimeError, match="--kv-attention backend"):
        backend.forward_decode(torch.randn(2, HQ * D), torch.randn(2, H * D), torch.randn(2, H * D), broken, fb)


def test_deterministic_triton_reads_the_chunk_from_staging(daemon):
    """The unified extend kernel reads the chunk back from the pool: at staging rows for sparse layers (SGLang's
    token locations would index past the staging buffer), and the decode after it matches the engine. The kvstore
    calls wait --kvstore-timeout."""
    backend, runner = make_backend(daemon, inner=UnifiedInner, timeout_s=7.5)
    assert backend.host.client._channel.timeout_s == 7.5
    reqs = [Request(runner, 2, 90), Request(runner, 4, 45)]
    prefill(backend, reqs, 37)  # checks the chunk reads too
    assert runner.token_to_kv_pool.staging.free_pages == STAGING
    ref, ref_slots = reference_engine(reqs)
    fb = decode_batch(reqs)
    backend.init_forward_metadata(fb)
    plan = ref.begin_step(ref_slots)
    for layer in layers():
        q, k, v = torch.randn(2, HQ * D), torch.randn(2, H * D), torch.randn(2, H * D)
        out = backend.forward_decode(q, k, v, layer, fb)
        if layer.layer_id >= CFG.dense_layers:
            want = ref.attend(plan, layer.layer_id, q.view(2, HQ, D), k.view(2, H, D), v.view(2, H, D))
            torch.testing.assert_close(out, want.reshape(2, HQ * D), atol=1e-6, rtol=1e-6)
    ref.end_step()


@pytest.mark.parametrize("inner", [Inner, UnifiedInner])
def test_an_extend_batch_translates_its_locations_once_for_its_staged_layers(daemon, inner, monkeypatch):
    """Every staged layer of an extend batch writes the chunk at the same token locations: they go to staging rows
    once a batch, not once a layer, and a new batch (new page_map entries) translates its own. The prefix reads
    (and the unified kernel's chunk reads) still see the prompt's keys."""
    backend, runner = make_backend(daemon, inner=inner)
    pool, calls = runner.token_to_kv_pool, []
    translate = pool.translate
    monkeypatch.setattr(pool, "translate", lambda loc: (calls.append(len(loc)), translate(loc))[1])
    r = Request(runner, 1, 150)
    assert L - CFG.dense_layers > 1
    extend_once(backend, [r], 40)
    assert calls == [40]
    calls.clear()
    extend_once(backend, [r], 40)
    assert sorted(calls) == [40, 40]  # the chunk's locations, and the prefix's planned indices (40 tokens)
    # A new view of the same locations (SGLang's breakable prefill graph gives each layer its own) is the same
    # translation; other locations, or the next batch's, are not.
    fb, _ = extend_batch([r], 10)
    backend.init_forward_metadata(fb)
    rows = pool.staged_rows(fb.out_cache_loc)
    assert pool.staged_rows(fb.out_cache_loc[:]) is rows and pool.staged_rows(fb.out_cache_loc[:5]) is not rows
    r.n += 10
    fb, _ = extend_batch([r], 10)
    backend.init_forward_metadata(fb)  # maps the new chunk's pages: the rows of the last batch are forgotten
    assert pool._staged_rows is None


def test_a_prompt_freed_mid_prefill_releases_its_staging(daemon):
    backend, runner = make_backend(daemon)
    staging = runner.token_to_kv_pool.staging
    r = Request(runner, 2, 200)
    fb, _ = extend_batch([r], 64)
    backend.init_forward_metadata(fb)
    for layer in layers():
        backend.forward_extend(torch.randn(64, HQ * D), torch.randn(64, H * D), torch.randn(64, H * D), layer, fb)
    assert staging.free_pages == STAGING - 4
    on_request_freed(2)
    other = Request(runner, 4, 30)
    prefill(backend, [other], 64)
    assert staging.free_pages == STAGING and not backend.engine.is_active(2)


def test_a_reused_slot_is_recognised_by_its_generation(daemon):
    backend, runner = make_backend(daemon)
    first = Request(runner, 2, 60)
    prefill(backend, [first], 64)
    # No free hook fired (e.g. it was lost): a new prompt from token 0 in the same slot is a new request.
    second = Request(runner, 2, 90)
    prefill(backend, [second], 64)
    assert backend.engine.seq_len(2) == second.prompt
    # A decode row whose prompt FreeKV never saw is refused, not served from empty pages.
    third = Request(runner, 2, 40)
    third.n = third.prompt
    with pytest.raises(RuntimeError, match="without its prefill"):
        backend.init_forward_metadata(decode_batch([third]))


def test_batches_without_host_fields_are_refused(daemon):
    backend, runner = make_backend(daemon)
    r = Request(runner, 1, 40)
    fb, _ = extend_batch([r], 64)
    fb._freekv_prefill_done_cpu = None
    with pytest.raises(RuntimeError, match="hooks"):
        backend.init_forward_metadata(fb)
    prefill(backend, [r], 64)
    fb = decode_batch([r])
    fb._freekv_req_slots_cpu = None
    with pytest.raises(RuntimeError, match="hooks"):
        backend.init_forward_metadata(fb)


def test_captured_decode_joins_after_the_model_forward(daemon, monkeypatch):
    """Eager decode joins the side streams at the last layer; under CUDA-graph capture the last layer leaves them
    running and the hook SGLang calls after the captured forward (capture_tail_hooks) joins them."""
    backend, runner = make_backend(daemon)
    assert runner.capture_tail_hooks == [backend._join_after_forward]
    reqs = [Request(runner, 1, 90)]
    prefill(backend, reqs, 1000)
    joins = []
    monkeypatch.setattr(backend.engine, "end_step", lambda: joins.append(1))
    for capturing in (False, True):
        monkeypatch.setattr(sglang_backend, "_capturing", lambda: capturing)
        fb = decode_batch(reqs)
        backend.init_forward_metadata(fb)
        for layer in layers():
            backend.forward_decode(torch.randn(1, HQ * D), torch.randn(1, H * D), torch.randn(1, H * D), layer, fb)
        assert len(joins) == (0 if capturing else 1)
        joins.clear()
    runner.capture_tail_hooks[0](None, None, fb, 1)
    assert joins == [1]
    with pytest.raises(RuntimeError, match="capture_tail_hooks"):
        make_backend(daemon, tail_hooks=False)


class _Value:
    def __init__(self):
        self.value = 0

    def inc(self, n):
        assert n >= 0
        self.value += n

    def set(self, v):
        self.value = v


def _fake_series():
    from freekv_sglang.metrics import PHASES

    names = ("decode_steps", "checks", "corrections", "correction_rate", "resident_pages", "kvstore_used_pages",
             "kvstore_free_pages", "aborted_requests")
    return SimpleNamespace(**{n: _Value() for n in names}, recall_pages={p: _Value() for p in PHASES},
                           recall_bytes={p: _Value() for p in PHASES}, victim_hits={p: _Value() for p in PHASES})


def _arena_used_pages(backend) -> tuple[int, int]:
    """(used, total) pages of the backend's arena as the daemon counts them."""
    client = backend.engine.host.client
    (arena,) = [a for a in client.stats()["arenas"] if a["client_id"] == client.client_id]
    return arena["used_pages"], arena["num_pages"]


def test_metrics_are_fed_where_the_stats_are_logged(daemon, monkeypatch):
    """With SGLang's metrics on, the engine statistics FreeKV logs every STATS_EVERY decode steps also feed its
    Prometheus series (freekv_sglang.metrics; the exposition is tested in test_freekv_metrics.py): the engine's
    totals, the resident pages of the active requests, and the arena pages in use as the daemon counts them. Off,
    the backend has no metrics at all."""
    from freekv_sglang import metrics

    assert make_backend(daemon)[0]._metrics is None  # metrics off: nothing made
    series = _fake_series()
    reports = []

    class Recording(metrics.EngineMetrics):
        def update(self, stats, **kw):
            reports.append(stats)
            super().update(stats, **kw)

    monkeypatch.setattr(metrics, "engine_metrics", lambda: Recording(series))
    monkeypatch.setattr(sglang_backend, "STATS_EVERY", 4)
    backend, runner = make_backend(daemon)
    reqs = [Request(runner, 3, 150), Request(runner, 5, 70)]
    prefill(backend, reqs, 1000)

    def step(reqs):
        fb = decode_batch(reqs)
        backend.init_forward_metadata(fb)
        for layer in layers():
            n = len(reqs)
            backend.forward_decode(torch.randn(n, HQ * D), torch.randn(n, H * D), torch.randn(n, H * D), layer, fb)

    for _ in range(8):
        step(reqs)
    assert [r["steps"] for r in reports] == [4, 8]  # reported while preparing steps 4 and 8
    st, sparse = reports[-1], L - CFG.dense_layers
    assert series.decode_steps.value == 8
    assert series.checks.value == st["checks"] == 8 * len(reqs) * H * sparse
    assert 0 < series.corrections.value == st["flagged"] <= st["checks"]
    assert st["flagged"] / st["checks"] == pytest.approx(sum(st["correction_rate"].values()) / sparse)
    assert series.correction_rate.value == pytest.approx((st["flagged"] - reports[0]["flagged"]) / (st["checks"] / 2))
    now, spec = series.recall_pages["before_attention"].value, series.recall_pages["speculative"].value
    assert (now, spec) == (st["recall_pages_now"], st["recall_pages_speculative"]) and now > 0
    assert series.recall_bytes["before_attention"].value == st["recall_bytes_now"] == now * st["recall_page_bytes"]
    assert series.recall_bytes["speculative"].value == st["recall_bytes_speculative"]
    assert series.victim_hits["before_attention"].value == st["victim_hits_now"] == 0  # CFG keeps no victim cache
    assert series.resident_pages.value == 2 * CFG.resident_pages
    used, total = _arena_used_pages(backend)  # nothing allocated since step 8 was prepared
    assert (series.kvstore_used_pages.value, series.kvstore_free_pages.value) == (used, total - used)
    assert used > 0

    # Request 3 finishes: its pages go back, and the next report sees one request and the daemon's count.
    on_request_freed(3)
    for _ in range(4):
        step(reqs[1:])
    assert len(reports) == 3 and series.resident_pages.value == CFG.resident_pages
    used_after, _ = _arena_used_pages(backend)
    assert series.kvstore_used_pages.value == used_after < used
    assert series.aborted_requests.value == 0


def test_a_staged_layer_bounds_its_writes_by_its_staging_rows(monkeypatch):
    """SGLang bounds a layer's KV write by the token pool (size + page_size; on CUDA its store kernel asserts): a staged
    layer writes staging rows, past that bound when the arena (the token pool) is smaller than the staging (H200,
    session 14: a 17,360-token pool, 24,832 staging rows, a device-side assert while capturing prefill graphs)."""
    from sglang.srt.mem_cache import memory_pool

    from freekv_patches._staging_pool import staging_pool_class

    pool = staging_pool_class(memory_pool.MHATokenToKVPool)(
        64, page_size=P, dtype=torch.float32, head_num=H, head_dim=D, layer_num=L, device="cpu",
        enable_memory_saver=False, start_layer=0, end_layer=L, enable_alt_stream=False, enable_kv_cache_copy=False,
        post_capture_active=False, freekv_dense_layers=CFG.dense_layers, freekv_staging_pages=STAGING)
    seen, store = [], memory_pool._set_kv_buffer_impl

    def bounded(k, v, k_cache, v_cache, indices, **kw):
        seen.append(kw["size_limit"])
        assert int(indices.max()) < kw["size_limit"] <= k_cache.shape[0], "a write past the bound it was given"
        return store(k, v, k_cache, v_cache, indices, **kw)

    monkeypatch.setattr(memory_pool, "_set_kv_buffer_impl", bounded)
    pool.page_map[0] = STAGING - 1  # token page 0 -> the last staging page, rows past the 80-row token pool
    loc = torch.arange(P)
    k, v = torch.randn(P, H, D), torch.randn(P, H, D)
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, k, v)
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), loc, k, v)  # the dense layer: token rows, the pool's bound
    assert seen == [(STAGING + 1) * P, 64 + P]
    rows = torch.arange((STAGING - 1) * P, STAGING * P)
    assert torch.equal(pool.k_buffer[1][rows], k) and torch.equal(pool.v_buffer[0][loc], v)


def test_the_last_query_is_seeded_in_the_engines_dtype(daemon, monkeypatch):
    """prev_q is kept in the KV cache's dtype (an FP8 cache's, under SGLang): the extend's last query is cast into it,
    where an index put of another dtype would raise."""
    backend, runner = make_backend(daemon)
    eng = backend.engine
    eng.prev_q = eng.prev_q.to(torch.bfloat16)  # stands for a KV cache dtype other than the query's
    monkeypatch.setattr(eng, "fill_slots", lambda *a, **k: None)  # its kernels take the engine's one dtype
    reqs = [Request(runner, 2, 70), Request(runner, 4, 45)]
    prefill(backend, reqs, 32)
    for layer in range(CFG.dense_layers, L):
        for r in reqs:
            assert torch.equal(eng.prev_q[layer, r.slot], r.q[layer][-1].to(torch.bfloat16))
    assert eng.has_prev[CFG.dense_layers:, [2, 4]].all() and not eng.has_prev[:CFG.dense_layers].any()


def test_stale_fp8_weights_are_refreshed_before_a_decode(daemon):
    """--kv-early-weights fp8 after a weight update (weight_update_refresh marks the copies stale): the next decode's
    metadata re-derives them from the model's W_q, once, and an extend forward leaves them be."""
    from freekv_kernels.fp8_rows import FP8_DTYPE, naive_quantize_rows
    from freekv_sglang.early_query import EarlyQuery

    cfg = dataclasses.replace(CFG, selection="means", correct_at="previous_mlp_only")
    early = EarlyQuery()
    backend, runner = make_backend(daemon, cfg=cfg, early=early)
    qkv = torch.nn.Linear(16, 24, bias=False)
    q8, e = torch.zeros(16, 16, dtype=FP8_DTYPE), torch.zeros(16, dtype=torch.int8)
    early.fp8_weights = [(qkv, 16, q8, e)]
    reqs = [Request(runner, 3, 150)]
    early.weights_stale = True
    prefill(backend, reqs, 64)
    assert early.weights_stale and not q8.float().any()  # extends do not read the copies
    backend.init_forward_metadata(decode_batch(reqs))
    want_q, want_e = naive_quantize_rows(qkv.weight[:16].detach())
    assert not early.weights_stale
    assert torch.equal(q8.float(), want_q.float()) and torch.equal(e, want_e.to(e.dtype))


@pytest.mark.parametrize("correct_at", ["previous_mlp", "previous_mlp_only"])
def test_predicted_queries_reach_the_engine_in_decode_forwards(daemon, correct_at):
    """--kv-correct-at previous_mlp(_only): the wrapped layers hand the backend each sparse layer's predicted query
    [T, Hq * D] during a decode forward, and release its input before the layer's input norm; the engine corrects
    with it one layer early. A perfect prediction attends as the paper's correction does (a reference engine with
    correct_at "layer"), with every correction made early. An input lent and never released fails the step."""
    from freekv_sglang.early_query import EarlyQuery

    cfg = dataclasses.replace(CFG, selection="means", correct_at=correct_at)
    with pytest.raises(RuntimeError, match="not wrapped to predict queries"):
        make_backend(daemon, cfg=cfg)
    early = EarlyQuery()
    backend, runner = make_backend(daemon, cfg=cfg, early=early)
    assert early.target == backend._anticipate and early.release == backend.engine.inputs_read
    reqs = [Request(runner, 3, 150), Request(runner, 5, 70)]
    prefill(backend, reqs, 64)
    ref, ref_slots = reference_engine(reqs, dataclasses.replace(cfg, correct_at="layer"))
    torch.manual_seed(4)
    for _ in range(8):
        fb = decode_batch(reqs)
        backend.init_forward_metadata(fb)
        plan = ref.begin_step(ref_slots)
        for layer in layers():
            q, k, v = torch.randn(2, HQ * D), torch.randn(2, H * D), torch.randn(2, H * D)
            early.target(layer.layer_id, lambda x: x, (q,))  # a dense layer's prediction is dropped
            early.release(layer.layer_id)  # the layer's input norm
            out = backend.forward_decode(q, k, v, layer, fb)
            if layer.layer_id >= cfg.dense_layers:
                want = ref.attend(plan, layer.layer_id, q.view(2, HQ, D), k.view(2, H, D), v.view(2, H, D))
                torch.testing.assert_close(out, want.reshape(2, HQ * D), atol=1e-6, rtol=1e-6)
        ref.end_step()
    got, want = backend.engine.stats(), ref.stats()
    assert got["flagged_early"] == want["flagged"] > 0 and got["flagged"] == 0
    fb = decode_batch(reqs)
    backend.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="lent their inputs"):
        for layer in layers():
            q, k, v = torch.randn(2, HQ * D), torch.randn(2, H * D), torch.randn(2, H * D)
            early.target(layer.layer_id, lambda x: x, (q,))
            backend.forward_decode(q, k, v, layer, fb)
