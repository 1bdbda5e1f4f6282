"""Method specs: what is compared, as (engine method, FreeKVConfig) at a given budget.

All methods share one dense prefill and attend to the same number of tokens per step:
- dense: every layer dense (dense_layers = num_layers), the full-KV reference; budget-independent.
- freekv(tau): group-consistent selection, speculative with correction below tau
  (tau 0 = pure speculation, tau 1 = reselect every head every step, i.e. no speculation).
- quest: the engine's Quest-style baseline: max over the query group of raw page scores, selected
  with the current query every step (the engine has no per-query-head selection).
- streaming: sink + window only; its window is widened by the budget so it attends to as many
  tokens as the retrieval methods (window' = window + budget).
The budget counts selected tokens only, excluding sink and window (FreeKVConfig's convention).
"""

from __future__ import annotations

import dataclasses

from ..config import FreeKVConfig


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sink, window and page size shared by every method; dense_layers for the sparse methods."""

    sink: int = 64
    window: int = 128
    page_size: int = 16
    dense_layers: int = 1


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str  # row label, e.g. "freekv(tau=0.9)"
    engine_method: str  # FreeKVEngine method
    tau: float | None = None
    uses_budget: bool = True

    def config(self, budget: int, geo: Geometry, num_layers: int) -> FreeKVConfig:
        p = geo.page_size
        if self.name == "dense":
            # The budget is irrelevant with every layer dense; any valid value does.
            return FreeKVConfig(budget=p, sink=geo.sink, window=geo.window, page_size=p, tau=0.0,
                                dense_layers=num_layers)
        window = geo.window + budget if self.engine_method == "streaming" else geo.window
        return FreeKVConfig(budget=budget, sink=geo.sink, window=window, page_size=p,
                            tau=self.tau if self.tau is not None else 1.0, dense_layers=geo.dense_layers)


def parse_methods(spec: str, taus: list[float]) -> list[MethodSpec]:
    """'dense,freekv,quest,streaming' -> specs; freekv expands to one spec per tau."""
    out: list[MethodSpec] = []
    for name in [s.strip() for s in spec.split(",") if s.strip()]:
        if name == "dense":
            out.append(MethodSpec("dense", "freekv", uses_budget=False))
        elif name == "freekv":
            out.extend(MethodSpec(f"freekv(tau={t:g})", "freekv", tau=t) for t in taus)
        elif name == "quest":
            out.append(MethodSpec("quest", "quest", tau=1.0))
        elif name == "streaming":
            out.append(MethodSpec("streaming", "streaming", tau=0.0))
        else:
            raise ValueError(f"unknown method {name!r}; choose from dense, freekv, quest, streaming")
    if not out:
        raise ValueError("no methods given")
    return out
