"""The server's calibration pass (freekv_patches.model_runner_calibrate), on CPU: after the attention backends are
built, --kv-selection channels runs one dense causal forward of the decoder through SGLang's RadixAttention with the
calibration attention published, and every sparse layer's selector holds calibrate_channels of that layer's queries and
keys (past the sink), the queries of later layers depending on the attention of earlier ones. A model it cannot
calibrate, a pass that misses a layer, and a tokenizer that does not load are refused by name."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freekv_kernels.channel_sketch import calibrate_channels
from freekv_sglang.server_args import FreeKVArgsError, FreeKVServerSettings
from freekv_sglang.tsp_propagation import Propagation

from test_freekv_backend import CFG, H, HQ, L, daemon, make_backend  # noqa: F401 (daemon: the module's fixture)

D, HIDDEN, VOCAB, CONTEXT = 32, 48, 97, 200  # channels need a head dim of at least 32
CHANNELS = dataclasses.replace(CFG, selection="channels")


class Rope(nn.Module):
    """Rotate-half RoPE, as SGLang's rotary embeddings with is_neox_style."""

    def __init__(self, neox: bool = True):
        super().__init__()
        self.is_neox_style = neox

    def forward(self, positions, q, k):
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
        ang = positions.float()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

        def rot(x):
            x = x.view(x.shape[0], -1, D)
            return (x * cos + torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1) * sin).flatten(1)

        return rot(q), rot(k)


class Layer(nn.Module):
    def __init__(self, i: int, g: torch.Generator, neox: bool):
        from sglang.srt.layers.radix_attention import RadixAttention

        super().__init__()
        self.qkv = nn.Parameter(torch.randn(HIDDEN, (HQ + 2 * H) * D, generator=g) / math.sqrt(HIDDEN))
        self.o = nn.Parameter(torch.randn(HQ * D, HIDDEN, generator=g) / math.sqrt(HQ * D))
        self.rope = Rope(neox)
        self.attn = RadixAttention(HQ, D, 1 / math.sqrt(D), H, layer_id=i)

    def qk_v(self, positions, h):
        q, k, v = (h @ self.qkv).split([HQ * D, H * D, H * D], -1)
        return *self.rope(positions, q, k), v

    def forward(self, positions, h, fb):
        q, k, v = self.qk_v(positions, h)
        return h + self.attn(q, k, v, fb) @ self.o


class Decoder(nn.Module):
    """A decoder as SGLang's model.model is called: forward(input_ids, positions, forward_batch)."""

    def __init__(self, neox: bool = True, skip: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.layers = nn.ModuleList(Layer(i, g, neox) for i in range(L))
        self.skip = skip

    def forward(self, input_ids, positions, fb):
        h = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                h = layer(positions, h, fb)
        return h

    @torch.no_grad()
    def reference(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's post-RoPE queries [T, HQ, D] and keys [T, H, D], with plain causal attention."""
        positions = torch.arange(len(ids))
        h, out = self.embed[torch.tensor(ids)], []
        for layer in self.layers:
            q, k, v = (x.view(len(ids), -1, D) for x in layer.qk_v(positions, h))
            out.append((q, k))
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            h = h + o[0].transpose(0, 1).reshape(len(ids), -1) @ layer.o
        return out


def runner_for(daemon, cfg=CHANNELS, model=None, tsp=None, **server_args):  # noqa: F811 (daemon)
    backend, runner = make_backend(daemon, cfg=cfg, tsp=tsp, head_dim=D)
    runner.model_config.context_len, runner.model_config.vocab_size = CONTEXT, VOCAB
    runner.model = nn.Module()
    runner.model.model = model or Decoder()  # SGLang's XForCausalLM holds its decoder as .model
    runner.server_args = SimpleNamespace(_freekv=FreeKVServerSettings(config=cfg), load_format="dummy",
                                         **server_args)
    runner.attn_backend = backend
    return runner, backend


def selectors(backend):
    """(model layer, selector, local layer) of every sparse layer."""
    out = []
    for layer in range(L):
        eng, local = (backend.late, layer - backend.split) if layer >= backend.split else (backend.engine, layer)
        if not eng.dense[local]:
            out.append((layer, eng.selector, local))
    return out


@pytest.mark.parametrize("prefill", ["full", "tsp"])
def test_the_pass_calibrates_every_sparse_layer_from_its_queries_and_keys(daemon, prefill):  # noqa: F811
    from freekv_patches.model_runner_calibrate import hook
    from freekv_sglang.calibration import random_calibration_ids

    cfg = CHANNELS if prefill == "full" else dataclasses.replace(CHANNELS, prefill="tsp", tsp_layer=1, tsp_keep=40)
    runner, backend = runner_for(daemon, cfg, tsp=Propagation() if prefill == "tsp" else None)
    assert backend.needs_calibration and backend.uncalibrated_layers() == [1, 2]
    hook(None, runner)
    assert backend.uncalibrated_layers() == []
    want = runner.model.model.reference(random_calibration_ids(VOCAB, CONTEXT))
    sink, R = cfg.sink, cfg.channel_count
    for layer, selector, local in selectors(backend):
        q, k = want[layer]
        ref = calibrate_channels(q[sink:].reshape(-1, H, HQ // H, D), k[sink:], R)
        got = selector._cal[local]
        torch.testing.assert_close(got.channels, ref.channels, rtol=0, atol=0)
        for name in ("lo", "inv_step", "step"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-4, atol=1e-5)


def test_a_selection_without_calibration_runs_no_pass(daemon):  # noqa: F811
    from freekv_patches.model_runner_calibrate import hook

    runner, backend = runner_for(daemon, cfg=CFG)
    runner.model.model.forward = None  # any call would fail
    assert not backend.needs_calibration
    hook(None, runner)


def test_interleaved_rope_is_refused(daemon):  # noqa: F811
    from freekv_patches.model_runner_calibrate import hook

    runner, backend = runner_for(daemon, model=Decoder(neox=False))
    with pytest.raises(FreeKVArgsError, match="rotates interleaved pairs: pick another --kv-selection"):
        hook(None, runner)


def test_a_layer_the_pass_misses_is_refused(daemon):  # noqa: F811
    from freekv_patches.model_runner_calibrate import hook

    runner, backend = runner_for(daemon, model=Decoder(skip=2))
    with pytest.raises(RuntimeError, match=r"reached no attention of layers \[2\]"):
        hook(None, runner)


def test_a_tokenizer_that_does_not_load_is_refused(daemon, tmp_path):  # noqa: F811
    from freekv_patches.model_runner_calibrate import hook

    runner, backend = runner_for(daemon, tokenizer_path=str(tmp_path / "none"), tokenizer_mode="auto",
                                 trust_remote_code=False, revision=None, tokenizer_backend=None)
    runner.server_args.load_format = "auto"
    with pytest.raises(FreeKVArgsError, match="did not load .* pass --tokenizer-path, or pick another --kv-selection"):
        hook(None, runner)
