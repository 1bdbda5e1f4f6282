"""Method specs: what is compared, as (engine method, FreeKVConfig) at a given budget.

All methods share one dense prefill and attend to the same number of tokens per step:
- dense: every layer dense (dense_layers = num_layers), the full-KV reference; budget-independent.
- channels(tau): FreeKV with the default selection, scoring pages from 4-bit codes of 32 key channels per KV head
  (channels/cC with --sketch-channels C) chosen and quantised once per model from a calibration text
  (freekv_sglang.calibration), the same steps for every page, speculative with correction below tau (tau 0 = pure
  speculation, tau 1 = reselect every head every step, i.e. no speculation).
- sketch(tau), rerank(tau), means(tau): FreeKV with a one-stage sketch (mid-range keys refined by the 2-bit codes of
  the channels the query weighs most; sketch/cC with --sketch-channels C; the default in sessions 16-23), the
  two-stage rerank (that sketch's best candidates rescored from all their codes; rerank/N(tau) with
  --rerank-factor N, 0 = every page rescored) or the paper's MeanS alone, speculative with correction as above.
- quest: the Quest-style baseline: max over the query group of the min / max bounds, selected with the current
  query every step (the engine has no per-query-head selection).
- oracle: the exact attention mass of the current query per KV-head group, from the host copy of the keys,
  every step (an upper bound for the selection, not servable).
- louiskv(tau): LouisKV (freekv_sglang/louiskv.py): retrieval of k-means clusters and temporal segments only at
  semantic boundaries, where the mean cosine of adjacent queries over all query heads falls below tau (the paper's
  0.7 by default; its long-input setting is 0.85), with the same pages, budget, sink and window.
- streaming: sink + window only; its window is widened by the budget so it attends to as many
  tokens as the retrieval methods (window' = window + budget).
The budget counts selected tokens only, excluding sink and window (FreeKVConfig's convention).
With --kv-prefill tsp every method also runs after FastKV's token-selective propagation (FreeKVConfig.prefill
"tsp"), labelled tsp(keep=K)+method: its layers after the TSP layer hold only the K propagated tokens.
"""

from __future__ import annotations

import dataclasses

from ..config import FreeKVConfig


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sink, window, page size and host pages' dtype shared by every method; dense_layers for the sparse methods."""

    sink: int = 64
    window: int = 128
    page_size: int = 16
    dense_layers: int = 1
    host_dtype: str = FreeKVConfig().host_dtype


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str  # row label, e.g. "rerank(tau=0.9)"
    engine_method: str  # FreeKVEngine method
    tau: float | None = None
    uses_budget: bool = True
    selection: str = FreeKVConfig().selection
    rerank_factor: int | None = None  # FreeKVConfig.rerank_factor (None: its default)
    sketch_channels: int | None = None  # FreeKVConfig.sketch_channels (None: its default)
    hysteresis: float | None = None  # FreeKVConfig.hysteresis (None: its default)
    correct_at: str | None = None  # FreeKVConfig.correct_at (None: its default)
    boundary_tau: float | None = None  # LouisKV's threshold (engine method louiskv)
    tsp: tuple[int, int] | None = None  # (tsp_layer, tsp_keep) with FastKV's prefill, None for the full prefill

    def config(self, budget: int, geo: Geometry, num_layers: int) -> FreeKVConfig:
        cfg = dataclasses.replace(self._config(budget, geo, num_layers), host_dtype=geo.host_dtype)
        return cfg if self.tsp is None else dataclasses.replace(cfg, prefill="tsp", tsp_layer=self.tsp[0],
                                                                tsp_keep=self.tsp[1])

    def _config(self, budget: int, geo: Geometry, num_layers: int) -> FreeKVConfig:
        p = geo.page_size
        if not self.uses_budget:  # dense (also under a tsp+ label)
            # The budget is irrelevant with every layer dense; any valid value does.
            return FreeKVConfig(budget=p, sink=geo.sink, window=geo.window, page_size=p, tau=0.0,
                                dense_layers=num_layers)
        window = geo.window + budget if self.engine_method == "streaming" else geo.window
        if self.engine_method == "louiskv":
            return FreeKVConfig(budget=budget, sink=geo.sink, window=window, page_size=p, retrieval="louiskv",
                                boundary_tau=self.boundary_tau, dense_layers=geo.dense_layers)
        return FreeKVConfig(budget=budget, sink=geo.sink, window=window, page_size=p,
                            tau=self.tau if self.tau is not None else 1.0, dense_layers=geo.dense_layers,
                            selection=self.selection, **({} if self.rerank_factor is None else
                                                         {"rerank_factor": self.rerank_factor}),
                            **({} if self.sketch_channels is None else {"sketch_channels": self.sketch_channels}),
                            **({} if self.hysteresis is None else {"hysteresis": self.hysteresis}),
                            **({} if self.correct_at is None else {"correct_at": self.correct_at}))


# Labels of the correction one layer early (correct_at), after the method's.
EARLY_LABELS = {"previous_mlp": "/early", "previous_mlp_only": "/predicted"}
METHOD_NAMES = ("dense", "oracle", "rerank", "sketch", "means", "channels", "quest", "louiskv", "streaming")


def parse_methods(spec: str, taus: list[float], rerank_factor: int | None = None,
                  louiskv_tau: float = FreeKVConfig().boundary_tau,
                  sketch_channels: int | None = None, hysteresis: list[float] | None = None,
                  correct_at: list[str] | None = None) -> list[MethodSpec]:
    """'dense,oracle,rerank,sketch,means,channels,quest,louiskv,streaming' -> specs; rerank, sketch, means and
    channels expand to one spec per tau and, when given, per hysteresis (labelled /hH) and per correct_at (labelled
    as EARLY_LABELS says)."""
    out: list[MethodSpec] = []
    for name in [s.strip() for s in spec.split(",") if s.strip()]:
        if name == "dense":
            out.append(MethodSpec("dense", "freekv", uses_budget=False))
        elif name in ("rerank", "sketch", "means", "channels"):
            factor = rerank_factor if name == "rerank" else None
            channels = sketch_channels if name in ("rerank", "sketch", "channels") else None
            label = name if factor is None else f"{name}/{factor}"  # rerank/N: N x budget candidates, 0 every page
            label += "" if channels is None else f"/c{channels}"  # the sketch's channels
            out.extend(MethodSpec(f"{label}{'' if h is None else f'/h{h:g}'}{EARLY_LABELS.get(at, '')}"
                                  f"(tau={t:g})", "freekv", tau=t, selection=name, rerank_factor=factor,
                                  sketch_channels=channels, hysteresis=h, correct_at=at)
                       for h in (hysteresis or [None]) for at in (correct_at or [None]) for t in taus)
        elif name in ("quest", "oracle"):
            out.append(MethodSpec(name, "freekv", tau=1.0, selection=name))
        elif name == "louiskv":
            out.append(MethodSpec(f"louiskv(tau={louiskv_tau:g})", "louiskv", boundary_tau=louiskv_tau))
        elif name == "streaming":
            out.append(MethodSpec("streaming", "streaming", tau=0.0))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHOD_NAMES)}")
    if not out:
        raise ValueError("no methods given")
    return out


def with_prefill(specs: list[MethodSpec], prefills: list[str], tsp_layer: int,
                 tsp_keeps: list[int]) -> list[MethodSpec]:
    """Every spec once per prefill: "full" as it is, "tsp" once per keep (labelled tsp(keep=K)+name)."""
    unknown = [p for p in prefills if p not in ("full", "tsp")]
    if unknown or not prefills:
        raise ValueError(f"unknown prefill(s) {unknown}; choose from full, tsp")
    out = list(specs) if "full" in prefills else []
    if "tsp" in prefills:
        out.extend(dataclasses.replace(s, name=f"tsp(keep={k})+{s.name}", tsp=(tsp_layer, k))
                   for k in tsp_keeps for s in specs)
    return out
