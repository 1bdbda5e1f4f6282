"""Summaries of the records: score table, correction rate per tau, adjacent-query cosine per layer,
JSON, and a score-vs-budget plot (matplotlib is optional: without it the plot is skipped)."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path


def _order(methods: list[str]) -> list[str]:
    # dense first, then the order the methods were run in
    return sorted(dict.fromkeys(methods), key=lambda m: (m != "dense",))


def summarize(records: list[dict]) -> dict:
    samples = [r for r in records if r["kind"] == "sample"]
    acc = collections.defaultdict(list)
    for r in samples:
        acc[(r["task"], r["length"], r["method"], r["budget"])].append(r["score"])
    scores = [dict(task=t, length=n, method=m, budget=b, score=sum(v) / len(v), samples=len(v),
                   ci95=wilson(sum(v) / len(v), len(v)))
              for (t, n, m, b), v in acc.items()]
    # Selection diagnostics, merged over engine runs weighted by their (layer, KV head, step) cases.
    diag = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in records:
        if r["kind"] == "stats" and r.get("diag_cases"):
            d = diag[(r["task"], r["length"], r["method"], r["budget"])]
            d[0] += r["diag_cases"]
            d[1] += r["hit_rate"] * r["diag_cases"]
            d[2] += r["mass_covered"] * r["diag_cases"]
    diagnostics = [dict(task=t, length=n, method=m, budget=b, cases=c, hit_rate=h / c, mass_covered=x / c)
                   for (t, n, m, b), (c, h, x) in diag.items()]

    # Engine statistics, merged over engine runs weighted by decoded rows.
    by_run = collections.defaultdict(list)
    for r in records:
        if r["kind"] == "stats" and r["layers"]:
            by_run[(r["method"], r["length"], r["budget"])].append(r)
    stats = []
    for (m, n, b), runs in by_run.items():
        w = [max(r["decode_rows"], 0) for r in runs]
        tot = sum(w) or 1
        layers = runs[0]["layers"]
        corr = [sum(wi * r["correction_rate"][j] for wi, r in zip(w, runs)) / tot for j in range(len(layers))]
        # Records before session 50 have no early corrections (correct_at "previous_mlp"), which they never made.
        early = [sum(wi * r.get("early_correction_rate", [0.0] * len(layers))[j] for wi, r in zip(w, runs)) / tot
                 for j in range(len(layers))]
        cos = [sum(wi * r["mean_cosine"][j] for wi, r in zip(w, runs)) / tot for j in range(len(layers))]
        stats.append(dict(method=m, length=n, budget=b, layers=layers, decode_rows=sum(w),
                          correction_rate=corr, mean_correction_rate=sum(corr) / len(corr),
                          mean_early_correction_rate=sum(early) / len(early),
                          mean_cosine=cos, recall_bytes_now=sum(r["recall_bytes_now"] for r in runs),
                          recall_bytes_speculative=sum(r["recall_bytes_speculative"] for r in runs)))
    # Score by needle depth (fifths of the context): where in the context retrieval fails.
    by_depth = collections.defaultdict(list)
    for r in samples:
        if r.get("depth") is not None:
            by_depth[(r["task"], r["length"], r["method"], r["budget"], min(int(r["depth"] * 5), 4))].append(r["score"])
    depth = [dict(task=t, length=n, method=m, budget=b, depth_bin=d, score=sum(v) / len(v), samples=len(v))
             for (t, n, m, b, d), v in by_depth.items()]
    timing = collections.defaultdict(float)
    for r in records:
        if r["kind"] == "stats":
            timing[r["method"]] += r["decode_s"]
    return dict(scores=scores, scores_by_depth=depth, engine_stats=stats, selection=diagnostics,
                decode_seconds=dict(timing))


def wilson(p: float, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a success rate p over n samples (scores in [0, 1])."""
    if n == 0:
        return [0.0, 1.0]
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0)) / den
    return [max(0.0, mid - half), min(1.0, mid + half)]


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cell(c: dict | None) -> str:
    if not c:
        return "-"
    lo, hi = c.get("ci95", (None, None))
    return _fmt(c["score"]) + ("" if lo is None else f" ({lo:.2f}-{hi:.2f})")


def selection_table(summary: dict) -> str:
    """Markdown: hit rate of the highest-attention page and attention mass covered, per method and budget."""
    rows = summary.get("selection", [])
    if not rows:
        return "(no selection diagnostics)"
    budgets = sorted({r["budget"] for r in rows})
    cell = {(r["task"], r["length"], r["method"], r["budget"]): r for r in rows}
    keys = sorted({(r["task"], r["length"]) for r in rows})
    methods = _order([r["method"] for r in rows])
    lines = ["| task | length | method | " + " | ".join(f"budget {b}: hit / mass" for b in budgets) + " |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in budgets) + " |"]
    for task, length in keys:
        for m in methods:
            got = [cell.get((task, length, m, b)) for b in budgets]
            if any(got):
                lines.append(f"| {task} | {length} | {m} | " + " | ".join(
                    "-" if c is None else f"{c['hit_rate']:.3f} / {c['mass_covered']:.3f}" for c in got) + " |")
    return "\n".join(lines)


def score_table(summary: dict) -> str:
    """Markdown: one row per (task, length, method), one column per budget (score and its 95% Wilson interval);
    dense spans all budgets."""
    scores = summary["scores"]
    budgets = sorted({s["budget"] for s in scores if s["budget"] is not None})
    cell = {(s["task"], s["length"], s["method"], s["budget"]): s for s in scores}
    keys = sorted({(s["task"], s["length"]) for s in scores}, key=lambda k: (k[0], k[1]))
    methods = _order([s["method"] for s in scores])
    lines = ["| task | length | method | " + " | ".join(f"budget {b}" for b in budgets) + " | n |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in budgets) + " | ---: |"]
    for task, length in keys:
        for m in methods:
            row = [cell.get((task, length, m, b)) for b in budgets]
            full = cell.get((task, length, m, None))
            if full is not None:
                row = [full] * max(len(budgets), 1)
            if not any(row):
                continue
            n = min(c["samples"] for c in row if c)
            lines.append(f"| {task} | {length} | {m} | " + " | ".join(_cell(c) for c in row) + f" | {n} |")
    return "\n".join(lines)


def depth_table(summary: dict) -> str:
    """Markdown: score per needle-depth fifth, one row per (task, length, method, budget)."""
    rows = summary.get("scores_by_depth", [])
    if not rows:
        return "(no needle tasks)"
    cell = {(r["task"], r["length"], r["method"], r["budget"], r["depth_bin"]): r for r in rows}
    keys = sorted({(r["task"], r["length"]) for r in rows})
    methods = _order([r["method"] for r in rows])
    budgets = sorted({r["budget"] for r in rows}, key=lambda b: -1 if b is None else b)
    head = " | ".join(f"{d / 5:.1f}-{(d + 1) / 5:.1f}" for d in range(5))
    lines = [f"| task | length | method | budget | {head} |", "| --- | ---: | --- | ---: |" + " ---: |" * 5]
    for task, length in keys:
        for m in methods:
            for b in budgets:
                got = [cell.get((task, length, m, b, d)) for d in range(5)]
                if any(got):
                    vals = " | ".join(_fmt(c and c["score"]) + (f" ({c['samples']})" if c else "") for c in got)
                    lines.append(f"| {task} | {length} | {m} | {'full' if b is None else b} | {vals} |")
    return "\n".join(lines)


def correction_table(summary: dict) -> str:
    """Markdown: mean correction rate over sparse layers per method (rows) and (length, budget); with early
    corrections (correct_at "previous_mlp"(_only)) the late ones, on the critical path, then the early ones."""
    st = [s for s in summary["engine_stats"] if s["method"] != "streaming"]
    if not st:
        return "(no engine statistics)"
    cols = sorted({(s["length"], s["budget"]) for s in st})
    cell = {(s["method"], s["length"], s["budget"]): (s["mean_correction_rate"], s.get("mean_early_correction_rate"))
            for s in st}

    def fmt(c) -> str:
        if c is None:
            return _fmt(None, 3)
        late, early = c
        return _fmt(late, 3) if not early else f"{_fmt(late, 3)} (early {_fmt(early, 3)})"
    methods = _order([s["method"] for s in st])
    lines = ["| method | " + " | ".join(f"{n}/{b}" for n, b in cols) + " |",
             "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(fmt(cell.get((m, n, b))) for n, b in cols) + " |")
    return "\n".join(lines)


def cosine_table(summary: dict) -> str:
    """Markdown: mean group-mean cosine similarity of adjacent queries per layer (rows) and length,
    over every engine run with sparse layers (the queries hardly depend on the method)."""
    st = [s for s in summary["engine_stats"]]
    if not st:
        return "(no engine statistics)"
    lengths = sorted({s["length"] for s in st})
    per = {}
    for n in lengths:
        runs = [s for s in st if s["length"] == n]
        tot = sum(s["decode_rows"] for s in runs) or 1
        layers = runs[0]["layers"]
        per[n] = {layer: sum(s["decode_rows"] * s["mean_cosine"][j] for s in runs) / tot
                  for j, layer in enumerate(layers)}
    layers = sorted({layer for d in per.values() for layer in d})
    lines = ["| layer | " + " | ".join(f"length {n}" for n in lengths) + " |",
             "| ---: | " + " | ".join("---:" for _ in lengths) + " |"]
    for layer in layers:
        lines.append(f"| {layer} | " + " | ".join(_fmt(per[n].get(layer), 3) for n in lengths) + " |")
    return "\n".join(lines)


def markdown(summary: dict, header: str = "") -> str:
    parts = [header] if header else []
    parts += ["### Score (exact match; 95% Wilson interval)", score_table(summary),
              "### Selection: hit rate of the highest-attention candidate page / attention mass covered (per layer, "
              "KV head and step; exact group-mean attention over the offloaded candidate pages)", selection_table(summary),
              "### Score by needle depth (fraction of the context before the needle; samples in parentheses)",
              depth_table(summary),
              "### Correction rate (flagged KV-head checks / all checks, mean over sparse layers; length/budget)",
              correction_table(summary),
              "### Mean adjacent-query cosine similarity per layer", cosine_table(summary)]
    return "\n\n".join(parts) + "\n"


def plot(summary: dict, path: Path) -> str:
    """Score against budget, one panel per (task, length), one line per method; dense dashed.
    Returns a message saying what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed (pip install matplotlib); {path.name} not written"
    scores = summary["scores"]
    panels = sorted({(s["task"], s["length"]) for s in scores})
    if not panels:
        return "plot skipped: no scores"
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols + 1.6, 3.2 * rows), squeeze=False, layout="constrained")
    budgets = sorted({s["budget"] for s in scores if s["budget"] is not None})
    for ax, (task, length) in zip(axes.flat, panels):
        mine = [s for s in scores if s["task"] == task and s["length"] == length]
        for m in _order([s["method"] for s in mine]):
            pts = sorted((s["budget"], s["score"]) for s in mine if s["method"] == m and s["budget"] is not None)
            full = [s["score"] for s in mine if s["method"] == m and s["budget"] is None]
            if full and budgets:
                ax.plot([budgets[0], budgets[-1]], [full[0]] * 2, "k--", label=m)
            elif pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set_title(f"{task} @ {length}")
        ax.set_xlabel("budget (selected tokens)")
        ax.set_ylabel("score")
        ax.set_ylim(-0.05, 1.05)
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def write(records: list[dict], out_dir: Path, meta: dict) -> tuple[dict, str, list[str]]:
    """summary.json, table.md and score_vs_budget.png in out_dir; returns (summary, markdown, messages)."""
    summary = summarize(records)
    summary["meta"] = meta
    md = markdown(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "table.md").write_text(md)
    return summary, md, [plot(summary, out_dir / "score_vs_budget.png")]
