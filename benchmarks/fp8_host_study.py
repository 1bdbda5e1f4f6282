"""Would FP8 host pages cost accuracy? The accuracy harness with every page the engine writes to the host rounded to
FP8 e4m3 as it lands there (CPU, the torch ops; SmolLM2-135M unless the harness's --model says otherwise).

At 16 x 32K the step's recall before attention is at the link (3.0 MB of host pages a layer, session 39) and the
speculative recall shares it, so host bytes are the lever left there (benchmarks/NOTES.md); FP8 host pages would halve
them. This emulates them before any kernel is built: the engine's offload and export copies (offload_pages,
pages_to_host) write bf16 as today, then the pages they wrote are rounded in place, per (page, KV head, K or V):
  e4m3        scaled by that block's absolute maximum / 448 (a scale per block, which a build would store beside the
              page)
  e4m3-unscaled  scale 1 (vLLM's default for an uncalibrated FP8 KV cache)
What is computed from a page before it is written (its summaries and channel codes, on the GPU's bf16 keys) and the
pages a prefill leaves resident or fills from staging are not rounded, as a build would not round them either.

    python3 benchmarks/fp8_host_study.py --fp8 e4m3 -- --tasks passkey,multikey --lengths 4096 --budgets 512 \\
        --samples 8 --methods oracle,channels --out results/fp8-e4m3

runs `python -m freekv_sglang.accuracy` with the arguments after `--`. Then

    python3 benchmarks/fp8_host_study.py --compare results/fp8-off results/fp8-e4m3

prints, per (task, length), both runs' scores and how many prompts got the same output in both (runs of one
method and budget each; the other may be another method, e.g. dense as a reference).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import freekv_sglang.engine as engine_module
from freekv_sglang.accuracy.__main__ import main as accuracy_main
from freekv_sglang.accuracy.runner import RecordLog

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def round_blocks(blocks: torch.Tensor, scaled: bool) -> torch.Tensor:
    """blocks [..., p, D] rounded to e4m3 and back, one scale per [p, D] block (its absolute maximum / 448) or none."""
    x = blocks.float()
    scale = (x.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
             if scaled else torch.ones(()))
    # Saturating, as Hopper's conversion (cvt.rn.satfinite) is: the unscaled mode clips what passes 448.
    fp8 = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (fp8.float() * scale).to(blocks.dtype)


def round_pages(host_layer: torch.Tensor, pages: torch.Tensor, scaled: bool) -> None:
    """Round host pages in place: host_layer [N, H, 2, p, D], pages the indices written."""
    idx = pages.long().cpu().unique()
    if idx.numel():
        host_layer[idx] = round_blocks(host_layer[idx], scaled)


def fp8_ops(ops, scaled: bool):
    """The engine's ops with its host writes followed by the rounding of the pages they wrote."""
    offload, to_host = ops.offload_pages, ops.pages_to_host

    def offload_pages(k_cache, v_cache, host_layer, summaries, src, dst, valid, *args, **kwargs):
        offload(k_cache, v_cache, host_layer, summaries, src, dst, valid, *args, **kwargs)
        round_pages(host_layer, dst[valid.bool()], scaled)

    def pages_to_host(k, v, rows, host_layer, host_pages):
        to_host(k, v, rows, host_layer, host_pages)
        round_pages(host_layer, host_pages, scaled)

    ops.offload_pages, ops.pages_to_host = offload_pages, pages_to_host
    return ops


def compare(base: Path, other: Path) -> list[dict]:
    """Per (task, length) of two harness runs of one method and budget each over the same prompts (the other run may
    use another method, e.g. dense as a reference): both scores and how many prompts got the same output."""
    def samples(run: Path) -> tuple[dict, str]:
        recs = [r for r in RecordLog(run / "records.jsonl").records if r["kind"] == "sample"]
        cells = {(r["method"], r["budget"]) for r in recs}
        if len(cells) != 1:
            raise ValueError(f"{run} holds {len(cells)} (method, budget) cells; compare runs of one each")
        (method, budget), = cells
        return {(r["task"], r["length"], r["index"]): r for r in recs}, f"{method}/{budget}"
    (a, label_a), (b, label_b) = samples(base), samples(other)
    if a.keys() != b.keys():
        raise ValueError(f"{base} and {other} hold different prompts")
    cells: dict[tuple, dict] = {}
    for key in sorted(a):
        c = cells.setdefault(key[:2], {"task": key[0], "length": key[1], "base": label_a, "other": label_b, "n": 0,
                                       "score_base": 0.0, "score_other": 0.0, "same_output": 0})
        c["n"] += 1
        c["score_base"] += a[key]["score"]
        c["score_other"] += b[key]["score"]
        c["same_output"] += a[key]["output"] == b[key]["output"]
    return list(cells.values())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, harness = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fp8", choices=("off", "e4m3", "e4m3-unscaled"))
    mode.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "OTHER"))
    args = ap.parse_args(ours)
    if args.compare:
        rows = compare(*args.compare)
        print(f"base {rows[0]['base']} ({args.compare[0]}), other {rows[0]['other']} ({args.compare[1]})")
        print(f"{'task':<10} {'length':>6} {'n':>3} {'base':>5} {'other':>5} same output")
        for c in rows:
            print(f"{c['task']:<10} {c['length']:>6} {c['n']:>3} {c['score_base']:>5.1f} {c['score_other']:>5.1f} "
                  f"{c['same_output']}")
        return 0
    if args.fp8 != "off":
        load_ops = engine_module.load_ops

        def load_fp8_ops(backend):
            if backend != "torch":
                raise ValueError("the FP8 emulation wraps the torch ops (CPU); run without a GPU")
            return fp8_ops(load_ops(backend), scaled=args.fp8 == "e4m3")

        engine_module.load_ops = load_fp8_ops
    return accuracy_main(harness)


if __name__ == "__main__":
    sys.exit(main())
