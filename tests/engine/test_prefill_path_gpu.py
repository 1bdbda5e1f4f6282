"""A prompt's path through the engine as the server takes it, on the GPU (the CPU interprets the kernels and has no
stream to wait for):
- it compiles nothing new once the server has warmed up: Triton compiles a kernel again for each new pattern of its
  integer arguments (1, divisible by 16), so a count that varies with the request or the batch must not be
  specialised (freekv_kernels docstring);
- the SGLang path's per-layer work (offload, resident copies, last queries) and the fill queue device work without
  waiting for the device: a wait in an extend's layer lets the GPU idle while the host prepares the next layer, and
  makes SGLang's overlap scheduler answer the previous prompt only after this one's prefill."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_kernels.testing import compiled_variants

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled variants exist on a GPU only")

D, L, H, G, P = 64, 3, 2, 4, 16
CFG = FreeKVConfig(budget=256, sink=32, window=64, page_size=P, dense_layers=1)
STAGING = 512  # staging pages: SGLang's buffer has one size for the server's life


def engine(cfg):
    e = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=4, max_context=4096, dtype=torch.bfloat16,
                     device="cuda", dense_outside=True)
    calibrate_synthetic(e, gaussian_sample(e))
    return e


def kv(n):
    return torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)


def staged_batch(e, lens, sync_checked=False):
    """The SGLang path (FreeKVAttnBackend's extend): prompts staged in a paged buffer, each sparse layer's pages
    offloaded from there (store_staged, or store_staged_prompt for a whole-prompt policy), the last queries seeded,
    the slots filled from staging."""
    cfg, slots, rows = e.cfg, [], []
    buf = [(kv(STAGING * P), kv(STAGING * P)) for _ in range(L)]
    free = torch.randperm(STAGING).tolist()
    for n in lens:
        s = e.add_request()
        e.stage_prefill(s, n)
        slots.append(s)
        rows.append([free.pop() for _ in range(-(-n // P))])
    off_src, off_dst, res_src, res_dst = [], [], [], []
    for s, n, staged in zip(slots, lens, rows):
        off_src += staged[cfg.sink_pages:n // P]
        off_dst += [e.host_page(s, j) for j in range(cfg.sink_pages, n // P)]
        c = (n - 1) // P
        keep = [j for j in range(c + 1) if j < cfg.sink_pages or j >= c - cfg.window_pages]
        res_src += [staged[j] for j in keep]
        res_dst += [e.layout.resident_page(s, j) for j in keep]
    t = {k: torch.tensor(v, dtype=torch.int32, device="cuda") for k, v in
         dict(off_src=off_src, off_dst=off_dst, res_src=res_src, res_dst=res_dst).items()}
    t["slots"] = torch.tensor(slots, dtype=torch.int64, device="cuda")
    t["rows"] = [torch.tensor(r, dtype=torch.int32, device="cuda") for r in rows]  # as _prepare_extend uploads them
    width = max(map(len, rows))
    t["pages"] = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    with no_device_waits() if sync_checked else contextlib.nullcontext():
        staged_layers(e, slots, buf, t)
    return slots


@contextlib.contextmanager
def no_device_waits():
    """torch raises at any operation that waits for the device (sync debug mode "error")."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def staged_layers(e, slots, buf, t):
    for layer in range(L):
        if e.dense[layer]:
            continue
        k, v = buf[layer]
        if e.selector.needs_whole_prompt:
            for s, staged in zip(slots, t["rows"]):
                e.store_staged_prompt(layer, s, k, v, staged)
        else:
            e.store_staged(layer, k, v, t["off_src"], t["off_dst"], torch.ones_like(t["off_src"], dtype=torch.bool),
                           t["res_src"].long(), t["res_dst"].long())
        e.seed_last_queries(layer, t["slots"], torch.randn(len(slots), H * G, D, device="cuda"))
    e.end_step()
    e.fill_slots(slots, staged=(lambda layer: buf[layer], t["pages"]))


def harness_batch(e, lens, sync_checked=False):
    """The HF harness's path (and --kv-prefill tsp's later layers): each prompt's layers through prefill_layer, the
    slots filled from the host."""
    slots = []
    for n in lens:
        s = e.add_request()
        e.begin_prefill(s, n)
        data = [(kv(n), kv(n), torch.randn(H * G, D, device="cuda", dtype=torch.bfloat16)) for _ in range(L)]
        torch.cuda.synchronize()
        with no_device_waits() if sync_checked else contextlib.nullcontext():
            for layer in range(L):
                if not e.dense[layer]:
                    e.prefill_layer(s, layer, *data[layer])
        slots.append(s)
    e.end_step()
    e.fill_slots(slots)
    return slots


def serve(e, lens):
    for path in (staged_batch, harness_batch):
        for s in path(e, lens):
            e.remove_request(s)
    torch.cuda.synchronize()


POLICIES = {"channels": dict(selection="channels"), "means": dict(selection="means"), "sketch": dict(selection="sketch"),
            "rerank": dict(selection="rerank"), "louiskv": dict(retrieval="louiskv", selection="means")}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_new_prompt_sizes_and_batches_compile_nothing(policy):
    """Warm up as a server does: one prompt whose counts are all multiples of 16 (SGLang's warm-up request) and the
    step plan of each batch size a decode graph captures (plan_step's rows per program follow the batch: 1, 2, 4);
    then serve a batch of three prompts of other sizes (page counts 62, 49, 94: none a multiple of 16, none 1)."""
    e = engine(dataclasses.replace(CFG, **policy))
    serve(e, [1024])
    for b in (1, 2, 4):  # SGLang's decode CUDA-graph capture plans every captured batch size at start-up
        e.plan(b)
    torch.cuda.synchronize()
    warm = compiled_variants()
    serve(e, [1000, 777, 1500])
    new = {k: sorted(keys - warm[k]) for k, keys in compiled_variants().items() if keys - warm[k]}
    assert not new, f"compiled again for the new sizes: {sorted(new)}; their new keys: {str(new)[:4000]}"


@pytest.mark.parametrize("selection", ["channels", "means", "sketch", "rerank"])
def test_the_staged_path_never_waits_for_the_device(selection):
    """Under torch's sync debug mode "error": every layer's store, the last queries' seeding, the join and the fill of
    a batch of prompts (compiled first, so no launch compiles); and every prompt layer through prefill_layer.
    Speculative retrieval; LouisKV's whole-prompt clustering is not checked here."""
    e = engine(dataclasses.replace(CFG, selection=selection))
    serve(e, [1000, 777, 1500])
    for path in (staged_batch, harness_batch):
        for s in path(e, [1000, 777, 1500], sync_checked=True):
            e.remove_request(s)


def test_a_decode_steps_host_preparation_never_waits_for_the_device():
    """prepare_step (the request's next host page included, every page_size steps) and the step plan run on the host
    while SGLang's overlap scheduler has the previous step in flight: under sync debug mode "error"."""
    e = engine(CFG)
    slots = harness_batch(e, [1000, 777])
    for _ in range(P + 1):  # crosses a page boundary of each request: its page table grows
        e.prepare_step(slots, pad_to=4)
        e.plan(4)
    torch.cuda.synchronize()
    with no_device_waits():
        for _ in range(P + 1):
            e.prepare_step(slots, pad_to=4)
            e.plan(4)
