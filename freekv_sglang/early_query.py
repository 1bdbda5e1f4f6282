"""FreeKV's correction one layer early in a served model (correct_at "previous_mlp", FreeKVEngine.anticipate).

In a decode forward, once decoder layer i has added its attention's output to the residual (its post-attention
norm, called as norm(hidden_states, residual) -> (normed, residual) in SGLang's fused add-and-norm, returns that mid
residual), layer i + 1's query is predicted from it and handed to the FreeKV backend, which selects and recalls the
heads whose predicted query turned while layer i's MLP runs. Extend forwards pass through unchanged.

The layers must follow SGLang's decoder-layer call, layer(positions, hidden_states, forward_batch, residual), as
Llama and Qwen2 do; freekv_patches builds each layer's prediction from its own modules and installs the wrappers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# predict(mid residual [T, hidden], positions [T]) -> the layer's query [T, Hq * D], rotated
Predictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class EarlyQuery:
    """The wrappers' shared state: the decode forward in flight (its positions), and where predictions go, set by the
    FreeKV backend: target(layer, predict, (mid,)) with predict(mid) -> [T, Hq * D], and release(layer), called before
    that layer's input norm (a fused add-and-norm) overwrites `mid` in place, so the target may read `mid` where it
    is instead of copying it. predict reads the forward's positions as they are, which nothing overwrites or frees
    before the step's join (a CUDA graph's static buffer, or the forward batch's)."""

    def __init__(self) -> None:
        self.target: Callable[[int, Callable[[torch.Tensor], torch.Tensor], tuple[torch.Tensor]], None] | None = None
        self.release: Callable[[int], None] | None = None
        self.positions: torch.Tensor | None = None
        # early_weights "fp8": (qkv_proj, q_size, e4m3 rows, exponents) a predicted layer; weights_stale is set when
        # the model's weights were updated, and the backend's next decode refreshes them (one refresh however many
        # updates came between two forwards).
        self.fp8_weights: list[tuple[torch.nn.Module, int, torch.Tensor, torch.Tensor]] = []
        self.weights_stale = False

    def refresh_weights(self) -> int:
        """Re-derive every e4m3 W_q copy from the model's present W_q, in place (captured CUDA graphs keep reading the
        same tensors; SGLang updates weights in place, so the model's own W_q needs nothing). Returns how many."""
        with torch.no_grad():
            for qkv, q_size, q, e in self.fp8_weights:
                quantize_rows_into(qkv.weight[:q_size], q, e)
        self.weights_stale = False
        return len(self.fp8_weights)


def quantize_rows_into(w: torch.Tensor, q: torch.Tensor, e: torch.Tensor) -> None:
    """freekv_kernels.fp8_rows' codec of w [N, K] into q (e4m3) and e (a row's exponent), 1,024 rows at a time (the
    codec's fp32 temporaries stay small)."""
    from freekv_kernels.fp8_rows import naive_quantize_rows

    for i in range(0, w.shape[0], 1024):
        q[i:i + 1024], e[i:i + 1024] = naive_quantize_rows(w[i:i + 1024].detach())


def predicted_layers(num_layers: int, dense_layers: int) -> range:
    """The layers whose query is predicted: the sparse ones, from 1 on (layer 0 has no layer before it)."""
    return range(max(dense_layers, 1), num_layers)


def install(layers, state: EarlyQuery, predictors: dict[int, Predictor]) -> None:
    """Wrap layers (a model's decoder layers, in call order) so that in a decode forward layer i's mid residual
    predicts layer i + 1's query with predictors[i + 1] (the layers to predict, from 1 on). The first layer records
    the forward's positions, which every layer of it shares."""
    for j in predictors:
        if not 1 <= j < len(layers):
            raise ValueError(f"layer {j} has no layer before it among the model's {len(layers)} to predict it from")
    first = layers[0]
    if getattr(first, "_freekv_early", False):
        raise RuntimeError("the decoder layers are already wrapped for the early correction")
    first.forward = _wrap_layer(first.forward, state)
    for j, predict in predictors.items():
        norm = layers[j - 1].post_attention_layernorm
        norm.forward = _wrap_norm(norm.forward, state, j, predict)
        norm = layers[j].input_layernorm
        norm.forward = _wrap_input_norm(norm.forward, state, j)
    first._freekv_early = True


def _wrap_layer(forward, state: EarlyQuery):
    def wrapped(positions, hidden_states, forward_batch, residual, *args, **kwargs):
        state.positions = positions if forward_batch.forward_mode.is_decode() else None
        return forward(positions, hidden_states, forward_batch, residual, *args, **kwargs)
    return wrapped


def _wrap_norm(forward, state: EarlyQuery, layer: int, predict: Predictor):
    def wrapped(hidden_states, residual=None, *args, **kwargs):
        out = forward(hidden_states, residual, *args, **kwargs)
        positions = state.positions
        if positions is not None and state.target is not None:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise RuntimeError(f"decoder layer {layer - 1}'s post-attention norm returned no (normed, residual) "
                                   "pair: this model's layers do not follow SGLang's fused add-and-norm, which "
                                   "--kv-correct-at previous_mlp(_only) reads the mid residual from")
            # out[1]: the residual with the attention's output
            state.target(layer, lambda mid: predict(mid, positions), (out[1],))
        return out
    return wrapped


def _wrap_input_norm(forward, state: EarlyQuery, layer: int):
    def wrapped(*args, **kwargs):
        if state.positions is not None and state.release is not None:
            state.release(layer)  # its fused add-and-norm overwrites the mid residual the prediction reads
        return forward(*args, **kwargs)
    return wrapped
