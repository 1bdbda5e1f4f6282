"""FreeKVAttnBackend's glue, on CPU: duck-typed SGLang runner, pools and batches, a real kvstore daemon.

The backend must decode exactly like an engine fed the same prompts directly, ingest a request once per
generation of its slot, release freed slots, take the real rows of a padded replay view, delegate dense
layers to the wrapped backend, and refuse batches that lack the host-side slots the hooks attach.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from freekv_kvstore import start_embedded
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_sglang.server_args import FreeKVServerSettings
from freekv_sglang.sglang_backend import FreeKVAttnBackend, on_request_freed

L, HQ, H, D, P = 3, 6, 2, 16, 16
CFG = FreeKVConfig(budget=32, sink=16, window=16, page_size=P, tau=0.6, dense_layers=1)
SIZE, CTX = 6, 512  # request slots 1..SIZE (0 pads), max context


class Pool:
    """The parts of MHATokenToKVPool the backend uses: per-layer NHD token buffers."""

    def __init__(self, tokens: int):
        self.k = [torch.zeros(tokens, H, D) for _ in range(L)]
        self.v = [torch.zeros(tokens, H, D) for _ in range(L)]
        self.next = P  # page 0 absorbs padding writes

    def alloc(self, n: int) -> torch.Tensor:
        locs = torch.arange(self.next, self.next + n)
        self.next += n
        return locs

    def get_key_buffer(self, layer: int):
        return self.k[layer]

    def get_value_buffer(self, layer: int):
        return self.v[layer]

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[layer.layer_id][loc] = k
        self.v[layer.layer_id][loc] = v


class Inner:
    """The wrapped backend: records what reaches it."""

    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, fb):
        self.calls.append("meta")

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.calls.append("out_graph")

    def init_forward_metadata_in_graph(self, fb):
        self.calls.append("in_graph")

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("decode", layer.layer_id))
        return torch.zeros_like(q)


class Mode:
    def is_decode(self):
        return True


@pytest.fixture(scope="module")
def daemon():
    handle = start_embedded(arena_gb=0.05)
    yield handle
    handle.stop()


def make_backend(daemon):
    model_config = SimpleNamespace(num_hidden_layers=L, num_attention_heads=HQ, head_dim=D,
                                   get_num_kv_heads=lambda tp: H // tp)
    req_pool = SimpleNamespace(size=SIZE, req_to_token=torch.zeros(SIZE + 1, CTX, dtype=torch.int32),
                               req_generation=torch.zeros(SIZE + 1, dtype=torch.int64))
    runner = SimpleNamespace(model_config=model_config, tp_size=1, tp_rank=0, token_to_kv_pool=Pool(8192),
                             req_to_token_pool=req_pool, kv_cache_dtype=torch.float32, page_size=P, device="cpu")
    settings = FreeKVServerSettings(config=CFG, kvstore_endpoint=daemon.endpoint, kvstore_arena_gb=0.01)
    return FreeKVAttnBackend(runner, Inner(), settings), runner


def layers():
    return [SimpleNamespace(layer_id=i, scaling=1 / math.sqrt(D), logit_cap=0.0) for i in range(L)]


class Request:
    """A request as SGLang holds it: token locations in the pool and a length."""

    def __init__(self, runner, slot: int, n: int):
        self.slot, self.n = slot, n
        pool, rp = runner.token_to_kv_pool, runner.req_to_token_pool
        rp.req_generation[slot] += 1
        locs = pool.alloc(n)
        rp.req_to_token[slot, :n] = locs.int()
        self.k = [torch.randn(n, H, D) for _ in range(L)]
        self.v = [torch.randn(n, H, D) for _ in range(L)]
        for layer in range(L):
            pool.k[layer][locs], pool.v[layer][locs] = self.k[layer], self.v[layer]

    def append(self, runner) -> int:
        loc = int(runner.token_to_kv_pool.alloc(1))
        runner.req_to_token_pool.req_to_token[self.slot, self.n] = loc
        self.n += 1
        return loc


def decode_batch(reqs, runner, pad_to=None):
    """The ForwardBatch of one decode step (lengths include the new token)."""
    locs = [r.append(runner) for r in reqs]
    bs = pad_to or len(reqs)
    slots = torch.tensor([r.slot for r in reqs] + [0] * (bs - len(reqs)))
    lens = torch.tensor([r.n for r in reqs] + [1] * (bs - len(reqs)))
    return SimpleNamespace(forward_mode=Mode(), batch_size=bs, seq_lens_cpu=lens,
                           out_cache_loc=torch.tensor(locs + [0] * (bs - len(reqs))),
                           _freekv_req_slots_cpu=slots, _freekv_raw_bs=len(reqs))


def reference_engine(reqs):
    shape = ModelShape(L, HQ, H, D)
    eng = FreeKVEngine(CFG, shape, max_requests=len(reqs), max_context=CTX, dtype=torch.float32, device="cpu")
    slots = []
    for r in reqs:
        s = eng.add_request()
        eng.begin_prefill(s, r.n)
        for layer in range(L):
            eng.prefill_layer(s, layer, r.k[layer], r.v[layer])
        slots.append(s)
    return eng, slots


def test_backend_decodes_like_the_engine_and_tracks_requests(daemon):
    backend, runner = make_backend(daemon)
    reqs = [Request(runner, 3, 150), Request(runner, 5, 70)]
    ref, ref_slots = reference_engine(reqs)
    lay = layers()
    for step in range(20):
        fb = decode_batch(reqs, runner, pad_to=4 if step % 2 else None)  # odd steps: a padded replay view
        backend.init_forward_metadata(fb)
        plan = ref.begin_step(ref_slots)
        for layer in lay:
            q, k, v = torch.randn(fb.batch_size, HQ * D), torch.randn(fb.batch_size, H * D), torch.randn(fb.batch_size, H * D)
            out = backend.forward_decode(q, k, v, layer, fb)
            if layer.layer_id < CFG.dense_layers:
                assert backend.inner.calls[-1] == ("decode", layer.layer_id)
                continue
            want = ref.attend(plan, layer.layer_id, q[:2].view(2, HQ, D), k[:2].view(2, H, D), v[:2].view(2, H, D))
            torch.testing.assert_close(out[:2], want.reshape(2, HQ * D), atol=1e-6, rtol=1e-6)
            # SGLang's pool keeps the full KV beside FreeKV's pages
            torch.testing.assert_close(runner.token_to_kv_pool.k[layer.layer_id][fb.out_cache_loc[:2]],
                                       k[:2].view(2, H, D))
        ref.end_step()
    eng = backend.engine
    assert eng.seq_len(3) == reqs[0].n and eng.seq_len(5) == reqs[1].n

    # Finish request 3: its slot is released at the next step; a new request in slot 3 is ingested afresh.
    on_request_freed(3)
    fb = decode_batch(reqs[1:], runner)
    backend.init_forward_metadata(fb)
    assert not eng.is_active(3)
    for layer in lay:
        backend.forward_decode(torch.randn(1, HQ * D), torch.randn(1, H * D), torch.randn(1, H * D), layer, fb)
    new = Request(runner, 3, 40)
    fb = decode_batch([new, reqs[1]], runner)
    backend.init_forward_metadata(fb)
    assert eng.is_active(3) and eng.seq_len(3) == new.n


def test_a_reused_slot_is_recognised_by_its_generation(daemon):
    backend, runner = make_backend(daemon)
    first = Request(runner, 2, 60)
    backend.init_forward_metadata(decode_batch([first], runner))
    # No free hook fired (e.g. it was lost): a new generation in the same slot still means a new request.
    second = Request(runner, 2, 90)
    backend.init_forward_metadata(decode_batch([second], runner))
    assert backend.engine.seq_len(2) == second.n


def test_batches_without_host_slots_are_refused(daemon):
    backend, runner = make_backend(daemon)
    r = Request(runner, 1, 40)
    fb = decode_batch([r], runner)
    fb._freekv_req_slots_cpu = None
    with pytest.raises(RuntimeError, match="hooks"):
        backend.init_forward_metadata(fb)
