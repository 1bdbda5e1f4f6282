"""Run a Hugging Face Llama/Qwen2-style causal LM with the FreeKV engine doing decode attention.

The adapter owns the forward pass (embedding, RoPE, projections, MLP come from the HF modules) so
the engine sees post-RoPE queries and keys. Prefill is dense (SDPA, causal, GQA) and hands each
layer's K/V to the engine; decode is batched over requests of different lengths, which join and
leave between steps (a small continuous-batching loop, greedy sampling).

With cfg.prefill "tsp" (FastKV's token-selective propagation) the hidden states after layer tsp_layer's MLP are
indexed by the tokens tsp_select picks there, so the later layers prefill only those (each at its own position for
RoPE) and store only their K/V. The later layers then hold a shorter sequence than the earlier ones, and the engine
keeps one length per request slot: they get an engine of their own (`late`), over the same slot ids, whose
sequence is the propagated tokens compacted in position order followed by the decode tokens. FreeKV selects in
each engine as usual. Positions for RoPE always come from the first engine (the true sequence length).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .config import BENCH_SELECTIONS, PREFILLS, SELECTIONS, TSP_WINDOW, FreeKVConfig
from .engine import FreeKVEngine, ModelShape, merged_stats, tsp_engines

SUPPORTED = ("llama", "qwen2")


def model_shape(model) -> ModelShape:
    c = model.config
    if c.model_type not in SUPPORTED:
        raise ValueError(f"model type {c.model_type!r} is not supported; FreeKV's adapter runs {SUPPORTED}")
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", False):
        raise ValueError("sliding-window attention models are not supported")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return ModelShape(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [n, heads, D]; cos/sin [n, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@dataclasses.dataclass
class PrefillCache:
    """A prompt's dense prefill, reusable by several engines (methods/budgets) on the same prompt."""

    ids: list[int]
    k: list[torch.Tensor]  # per layer [n, H, D], post-RoPE
    v: list[torch.Tensor]
    q_last: list[torch.Tensor]  # per layer [Hq, D]
    first_token: int
    prefill: str = "full"  # FreeKVModel.prefill_mode of the model that made it; only such a model loads it
    kept: torch.Tensor | None = None  # TSP: positions of the tokens the layers after tsp_layer hold (k/v [m, H, D])


class FreeKVModel:
    def __init__(self, model, engine: FreeKVEngine, late: FreeKVEngine | None = None,
                 tsp: tuple[int, int] | None = None):
        """engine: every layer, or with tsp = (tsp_layer, tsp_keep) layers 0..tsp_layer and late the rest."""
        self.model, self.engine, self.late, self.tsp = model, engine, late, tsp
        self.engines = [engine] if late is None else [engine, late]
        self.shape = model_shape(model)
        self.device = engine.device
        self.prefill_mode = "full" if tsp is None else f"tsp(layer={tsp[0]},keep={tsp[1]})"
        inner = model.model
        self.layers, self.embed, self.norm, self.rotary = inner.layers, inner.embed_tokens, inner.norm, inner.rotary_emb

    @classmethod
    def build(cls, model, cfg: FreeKVConfig, *, max_requests: int, max_context: int, method: str = "freekv",
              backend: str | None = None, host_pool=None) -> "FreeKVModel":
        p = next(model.parameters())
        shape = model_shape(model)
        kw = dict(max_requests=max_requests, max_context=max_context, dtype=p.dtype, device=p.device, backend=backend,
                  method=method)
        if cfg.prefill == "full":
            return cls(model, FreeKVEngine(cfg, shape, host_pool=host_pool, **kw))
        early, late = tsp_engines(cfg, shape, host_pool, **kw)
        return cls(model, early, late, (cfg.tsp_layer, cfg.tsp_keep))

    def _layer(self, i: int) -> tuple[FreeKVEngine, int]:
        """The engine holding model layer i, and the layer's index there."""
        if self.late is not None and i > self.tsp[0]:
            return self.late, i - self.tsp[0] - 1
        return self.engine, i

    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn, s = layer.self_attn, self.shape
        n = x.shape[0]
        q = attn.q_proj(x).view(n, s.num_q_heads, s.head_dim)
        k = attn.k_proj(x).view(n, s.num_kv_heads, s.head_dim)
        v = attn.v_proj(x).view(n, s.num_kv_heads, s.head_dim)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _rotary(self, h: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary(h[None], positions[None])
        return cos[0].to(h.dtype), sin[0].to(h.dtype)

    def _finish_layer(self, layer, residual: torch.Tensor, attn_out: torch.Tensor,
                      on_mid: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        h = residual + layer.self_attn.o_proj(attn_out.flatten(1))
        if on_mid is not None:  # the mid residual, before the MLP
            on_mid(h)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _anticipate(self, i: int, plans: dict, cos: torch.Tensor, sin: torch.Tensor):
        """cfg.correct_at "previous_mlp"(_only): the call that predicts model layer i's query from the previous
        layer's mid residual and hands it to its engine's anticipate (None where layer i corrects only after its
        projection)."""
        if i >= len(self.layers):
            return None
        eng, local = self._layer(i)
        if not eng.cfg.anticipates or eng.dense[local]:
            return None
        layer, s = self.layers[i], self.shape

        def predict(mid: torch.Tensor) -> torch.Tensor:
            q = layer.self_attn.q_proj(layer.input_layernorm(mid)).view(mid.shape[0], s.num_q_heads, s.head_dim)
            return _rope(q, cos, sin)
        return lambda mid: eng.anticipate(plans[id(eng)], local, predict, (mid,))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.norm(h)).float()

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> PrefillCache:
        """Dense causal prefill of one prompt; returns its per-layer K/V and the greedy first token."""
        ks, vs, qs, kept, h = self.prompt_pass(ids, self.tsp)
        return PrefillCache(list(ids), ks, vs, qs, int(self.model.lm_head(h[-1:]).float().argmax(-1)),
                            self.prefill_mode, kept)

    @property
    def needs_calibration(self) -> bool:
        """Whether a selector waits for calibrate() before the first prompt (selection "channels")."""
        return any(eng.needs_calibration for eng in self.engines)

    @torch.no_grad()
    def calibrate(self, ids: list[int]) -> None:
        """Calibrate every sparse layer's selector from a dense pass over ids: the queries and keys of every token
        (freekv_sglang.calibration's text)."""

        def on_layer(i: int, q: torch.Tensor, k: torch.Tensor) -> None:
            eng, layer = self._layer(i)
            if not eng.dense[layer] and hasattr(eng.selector, "calibrate"):
                eng.selector.calibrate(layer, q, k)

        self.prompt_pass(ids, None, on_layer)

    @torch.no_grad()
    def prompt_pass(self, ids: list[int], tsp: tuple[int, int] | None, on_layer=None):
        """Dense causal prefill of one prompt, with token-selective propagation at tsp = (layer, keep) when given:
        per-layer K/V [n or m, H, D] and last query [Hq, D], the propagated positions (None: every token) and the
        final hidden states [n or m, hidden] (after the model's last norm, what the LM head reads). on_layer(i, q,
        k) sees each layer's post-RoPE queries [n, Hq, D] and keys [n, H, D]."""
        t = torch.tensor(ids, device=self.device)
        h = self.embed(t)
        cos, sin = self._rotary(h, torch.arange(len(ids), device=self.device))
        ks, vs, qs = [], [], []
        kept = None
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(layer, x, cos, sin)
            # Causal over the propagated tokens too: they stay in position order.
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            h = self._finish_layer(layer, h, o[0].transpose(0, 1))
            if on_layer is not None:
                on_layer(i, q, k)
            ks.append(k)
            vs.append(v)
            qs.append(q[-1])
            if tsp is not None and i == tsp[0] and len(ids) > tsp[1]:
                kept = self.engine.ops.tsp_select(q[-TSP_WINDOW:].contiguous(), k, tsp[1], self.engine.scale)
                h, cos, sin = h[kept], cos[kept], sin[kept]
        return ks, vs, qs, kept, self.norm(h)

    def load_prefill(self, cache: PrefillCache) -> int:
        """Put a prefilled prompt into a fresh engine slot; returns the slot."""
        if cache.prefill != self.prefill_mode:
            raise ValueError(f"a {cache.prefill} prefill cannot load into a model with prefill {self.prefill_mode}")
        slot = self.engine.add_request()
        for eng in self.engines:
            if eng is self.late:
                eng.add_request(slot)  # the same slot id in both engines
            first = 0 if eng is self.engine else self.tsp[0] + 1
            eng.begin_prefill(slot, cache.k[first].shape[0])
            for layer in range(eng.shape.num_layers):
                eng.prefill_layer(slot, layer, cache.k[first + layer], cache.v[first + layer],
                                  cache.q_last[first + layer])
            eng.fill_slots([slot])  # as the server does at the end of a prefill (from its staging pages there)
        return slot

    def remove_request(self, slot: int) -> None:
        for eng in self.engines:
            eng.remove_request(slot)

    def stats(self) -> dict:
        """The engines' stats() merged: per-layer entries under model layer numbers, totals summed."""
        return merged_stats([(eng.stats_snapshot(), 0 if eng is self.engine else self.tsp[0] + 1)
                             for eng in self.engines])

    @torch.no_grad()
    def decode_step(self, slots: list[int], tokens: list[int]) -> list[int]:
        """One batched greedy step: feed each slot its last token, return the next tokens."""
        positions = torch.tensor([self.engine.seq_len(s) for s in slots], device=self.device)
        plans = {id(eng): eng.begin_step(slots) for eng in self.engines}
        h = self.embed(torch.tensor(tokens, device=self.device))
        cos, sin = self._rotary(h, positions)
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(layer, x, cos, sin)
            eng, local = self._layer(i)
            h = self._finish_layer(layer, h, eng.attend(plans[id(eng)], local, q, k, v),
                                   self._anticipate(i + 1, plans, cos, sin))
        for eng in self.engines:
            eng.end_step()
        return self._logits(h).argmax(-1).tolist()

    def generate(self, prompts: list[list[int]] | list[PrefillCache], max_new_tokens: int,
                 eos_token_id: int | None = None, max_batch: int | None = None) -> list[list[int]]:
        """Greedy generation. At most max_batch requests decode together; a finished request leaves at
        once and the next waiting prompt joins the running batch."""
        max_batch = max_batch or self.engine.max_requests
        waiting = deque(enumerate(prompts))
        outs: list[list[int]] = [[] for _ in prompts]
        running: dict[int, int] = {}  # slot -> prompt index

        def done(i: int) -> bool:
            return len(outs[i]) >= max_new_tokens or (eos_token_id is not None and outs[i][-1] == eos_token_id)

        while waiting or running:
            while waiting and len(running) < max_batch:
                i, prompt = waiting.popleft()
                cache = prompt if isinstance(prompt, PrefillCache) else self.prefill(prompt)
                outs[i].append(cache.first_token)
                if done(i):
                    continue
                running[self.load_prefill(cache)] = i
            if not running:
                continue
            slots = list(running)
            for s, tok in zip(slots, self.decode_step(slots, [outs[running[s]][-1] for s in slots])):
                i = running[s]
                outs[i].append(tok)
                if done(i):
                    self.remove_request(s)
                    del running[s]
        return outs


def main() -> None:
    ap = argparse.ArgumentParser(description="Greedy generation with SmolLM2-135M through the FreeKV engine.")
    ap.add_argument("--prompt", default="The pass key is 71432. Remember it. " + "The grass is green. " * 200
                    + "What is the pass key? The pass key is")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--sink", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--method", default="freekv", choices=("freekv", "streaming"))
    ap.add_argument("--selection", default=FreeKVConfig().selection,
                    choices=[s for s in SELECTIONS if s not in BENCH_SELECTIONS])
    ap.add_argument("--kv-prefill", default="full", choices=PREFILLS)
    ap.add_argument("--kv-tsp-layer", type=int, default=14, help="--kv-prefill tsp: SmolLM2's middle layer")
    ap.add_argument("--kv-tsp-keep", type=int, default=256, help="--kv-prefill tsp: tokens propagated")
    args = ap.parse_args()
    from .hf_models import load_smollm2

    model, tok = load_smollm2()
    cfg = FreeKVConfig(budget=args.budget, sink=args.sink, window=args.window, page_size=args.page_size,
                       tau=args.tau, dense_layers=args.dense_layers, selection=args.selection,
                       prefill=args.kv_prefill, tsp_layer=args.kv_tsp_layer, tsp_keep=args.kv_tsp_keep)
    ids = tok(args.prompt)["input_ids"]
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=len(ids) + args.max_new_tokens + 1,
                           method=args.method)
    if fm.needs_calibration:
        from .calibration import calibration_ids

        fm.calibrate(calibration_ids(tok))
    out = fm.generate([ids], args.max_new_tokens, eos_token_id=tok.eos_token_id)[0]
    print(f"prompt: {len(ids)} tokens; output: {tok.decode(out)!r}")
    print(fm.stats())


if __name__ == "__main__":
    main()
