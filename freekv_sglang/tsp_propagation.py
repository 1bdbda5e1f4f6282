"""FastKV's token-selective propagation in a served model's forward (--kv-prefill tsp).

The FreeKV backend picks, in the TSP layer's extend attention, which tokens of each prompt propagate
(freekv_kernels.tsp_select) and leaves their indices into the batch's tokens in a `Propagation`. The decoder
layers, wrapped here, then carry only those tokens: the TSP layer's outputs (hidden states and residual) are indexed
by them, each later layer gets their positions (RoPE sees every token at its own position), and the last layer's
outputs are scattered back to the batch's token rows (zero rows for dropped tokens) so the LM head and the logits
processor find each prompt's last token where SGLang put it (the observation window, the prompt's last tokens,
always propagates). Decode batches, and extend batches without a pick, pass through unchanged.

The layers must follow SGLang's decoder-layer call, layer(positions, hidden_states, forward_batch, residual) ->
(hidden_states, residual), as Llama and Qwen2 do; freekv_patches installs the wrappers on the model's layer list.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .config import TSP_WINDOW


@dataclasses.dataclass
class Propagation:
    """The current extend forward's propagated tokens: rows of the batch's tokens (sorted within each prompt, prompts
    in batch order) and the batch's token count; None outside a forward that picked."""

    kept: torch.Tensor | None = None
    tokens: int = 0

    def pick(self, kept: torch.Tensor, tokens: int) -> None:
        self.kept, self.tokens = kept, tokens

    def clear(self) -> None:
        self.kept, self.tokens = None, 0


def install(layers, tsp_layer: int, state: Propagation) -> None:
    """Wrap layers[tsp_layer:] (a model's decoder layers, in call order) so that an extend forward with a pick carries
    only the propagated tokens past layer tsp_layer."""
    last = len(layers) - 1
    if not 0 <= tsp_layer < last:
        raise ValueError(f"the TSP layer {tsp_layer} leaves no later layer among the model's {len(layers)}")
    for i in range(tsp_layer, last + 1):
        layer = layers[i]
        if getattr(layer, "_freekv_tsp", False):
            raise RuntimeError(f"decoder layer {i} is already wrapped for token-selective propagation")
        layer.forward = _wrap(layer.forward, i == tsp_layer, i == last, state)
        layer._freekv_tsp = True


def pick(select, q: torch.Tensor, k: torch.Tensor, rows: list[tuple[int, int]], keep: int, scale: float,
         num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, list[int]]:
    """The TSP layer's pick over an extend batch of whole prompts: rows [(slot, prompt tokens)] in batch order, q / k
    that layer's post-RoPE queries and keys of the batch's tokens. Per prompt the tokens that propagate (FastKV: the
    last TSP_WINDOW queries' attention over the prompt, `select` being freekv_kernels' tsp_select; a prompt of at
    most `keep` tokens propagates whole). Returns their rows in the batch's tokens and each prompt's count."""
    q3, k3 = q.reshape(-1, num_q_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim)
    kept, start = [], 0
    for _, n in rows:
        if n > keep:
            kept.append(start + select(q3[start + n - TSP_WINDOW:start + n].contiguous(), k3[start:start + n], keep,
                                       scale))
        else:
            kept.append(torch.arange(start, start + n, device=q.device))
        start += n
    if start != q3.shape[0]:
        raise RuntimeError(f"--kv-prefill tsp: the extend batch holds {q3.shape[0]} tokens, its prompts {start}")
    return torch.cat(kept), [min(n, keep) for _, n in rows]


def _wrap(forward, first: bool, last: bool, state: Propagation):
    def wrapped(positions, hidden_states, forward_batch, residual, *args, **kwargs):
        if first:  # the pick happens in this layer's attention
            h, r = forward(positions, hidden_states, forward_batch, residual, *args, **kwargs)
            return (h, r) if state.kept is None else (h[state.kept], r[state.kept])
        kept = state.kept
        if kept is None:
            return forward(positions, hidden_states, forward_batch, residual, *args, **kwargs)
        h, r = forward(positions[kept], hidden_states, forward_batch, residual, *args, **kwargs)
        if last:
            h, r = _scatter(h, kept, state.tokens), _scatter(r, kept, state.tokens)
            state.clear()
        return h, r

    return wrapped


def _scatter(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    out = x.new_zeros((n, *x.shape[1:]))
    out[rows] = x
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt's propagated tokens attending causally among themselves (they stay in position order): q [m, Hq, D],
    k / v [m, H, D] -> [m, Hq, D]. The later layers' prefill over at most --kv-tsp-keep tokens per prompt."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
