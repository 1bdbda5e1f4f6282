"""Calibration of selection "channels" (the default): its text, Python's own argparse source (code and English prose,
on every machine that runs Python, and nothing a benchmark task generates), its first CALIBRATION_TOKENS tokens;
seeded random ids for random weights; the server pass's stand-in attention (CalibrationAttention, used by
freekv_patches.model_runner_calibrate); and calibrate_synthetic for engines fed synthetic queries and keys.

On SmolLM2-135M, channels calibrated from it, from uniformly random token ids or from a task's own prompt scored
alike (docs/results/session23): the calibration picks the channels a model's queries weigh and its keys spread on,
which are properties of the model more than of the text.
"""

from __future__ import annotations

import argparse
import inspect

import torch

from .tsp_propagation import causal_attention

CALIBRATION_TOKENS = 4096


def calibration_ids(tokenizer, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration text's first num_tokens token ids (the text repeats if a tokenizer packs it shorter)."""
    text = inspect.getsource(argparse)[: num_tokens * 8]  # a token is rarely longer: no tokenizer length warning
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (num_tokens // max(len(ids), 1) + 1))[:num_tokens]


def random_calibration_ids(vocab_size: int, num_tokens: int = CALIBRATION_TOKENS, seed: int = 0) -> list[int]:
    """Seeded uniform token ids: the calibration of a model with random weights (--load-format dummy), which has no
    text to read. On SmolLM2 random ids calibrated as the text did (docs/results/session23)."""
    return torch.randint(vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def calibrate_synthetic(engine, sample, num_tokens: int = 1024) -> bool:
    """Calibrate an engine that waits for it (engine.needs_calibration, selection "channels") for a synthetic workload,
    whose keys have no model to calibrate from: sample(layer, n) -> (q [n, Hq, D], k [n, H, D]) draws n queries and
    keys as the workload does (past the sink's tokens, which calibrate() skips). Returns whether it calibrated."""
    if not engine.needs_calibration:
        return False
    n = engine.cfg.sink + num_tokens
    for layer, dense in enumerate(engine.dense):
        if not dense:
            engine.selector.calibrate(layer, *sample(layer, n))
    return True


def gaussian_sample(engine, seed: int = 0):
    """A calibration sample of standard-normal queries and keys (seeded per layer), as random-key workloads draw."""
    s = engine.shape

    def sample(layer: int, n: int):
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        q = torch.randn(n, s.num_q_heads, s.head_dim, generator=g)
        return q.to(engine.device), torch.randn(n, s.num_kv_heads, s.head_dim, generator=g).to(engine.device)

    return sample


class CalibrationAttention:
    """The attention of a server's calibration pass (freekv_patches.model_runner_calibrate): it stands in for the
    served backend through one dense causal forward over the calibration ids, hands each layer's post-RoPE queries
    [T, Hq, D] and keys [T, H, D] to on_layer(layer_id, q, k) and returns the layer's causal attention. It writes
    no KV cache: the pass belongs to no request."""

    def __init__(self, on_layer):
        self.on_layer = on_layer

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if getattr(layer, "logit_cap", 0) or getattr(layer, "sliding_window_size", -1) not in (-1, None):
            raise ValueError(f"the calibration pass computes plain causal attention; layer {layer.layer_id} caps its "
                             "logits or slides a window")
        T, H, D = q.shape[0], layer.tp_k_head_num, layer.qk_head_dim
        q3, k3 = q.reshape(T, -1, D), k.reshape(T, H, D)
        self.on_layer(layer.layer_id, q3, k3)
        return causal_attention(q3, k3, v.reshape(T, H, -1), layer.scaling).reshape(T, -1)
