"""CLI of the accuracy harness: python -m freekv_sglang.accuracy --help"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..calibration import CALIBRATION_TOKENS
from ..config import HOST_DTYPES
from . import report
from .methods import Geometry, parse_methods, with_prefill
from .runner import RunConfig, run
from .tasks import TASKS

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

# Small enough for the test suite on 2 CPU cores: 2 passkey prompts of ~1K tokens, every method.
SMOKE = dict(tasks="passkey", lengths="1024", budgets="256", samples=2, batch=2, calibration_tokens=1024)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m freekv_sglang.accuracy", description=(
        "FreeKV's selections (rerank, MeanS) against dense attention, oracle selection, Quest-style selection "
        "and sink+window dropping on seeded long-context tasks, scored by exact match, with selection diagnostics."))
    ap.add_argument("--tasks", default="passkey,multikey", help=f"comma-separated, from {','.join(TASKS)}")
    ap.add_argument("--lengths", default="4096,8192", help="context lengths in tokens (prompt + answer)")
    ap.add_argument("--budgets", default="512,1024", help="selected tokens, excluding sink and window")
    ap.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ap.add_argument("--methods", default="dense,oracle,channels,sketch,rerank,means,quest,streaming",
                    help="from dense, oracle, channels, rerank, sketch, means, quest, louiskv, streaming (channels, "
                         "rerank, sketch and means once per tau)")
    ap.add_argument("--taus", default="0.9", help="FreeKV correction thresholds of rerank and means")
    ap.add_argument("--louiskv-tau", type=float, default=0.7,
                    help="LouisKV's boundary threshold (the paper's default 0.7; 0.85 in its long-input runs)")
    ap.add_argument("--rerank-factor", type=int, default=None,
                    help="rerank candidates per selected page (0: every page; default: FreeKVConfig's)")
    ap.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                    help="tokens of the calibration text (freekv_sglang.calibration) that calibrate the channel "
                         f"sketch before each of its runs (default {CALIBRATION_TOKENS}, the server's)")
    ap.add_argument("--sketch-channels", type=int, default=None,
                    help="key channels the sketch of rerank and sketch reads (default: FreeKVConfig's)")
    ap.add_argument("--hysteresis", default=None,
                    help="comma-separated hysteresis values: rerank, sketch and means once per value, labelled /hH "
                         "(default: FreeKVConfig's, unlabelled)")
    ap.add_argument("--correct-at", default=None,
                    help="comma-separated FreeKVConfig.correct_at values (layer, previous_mlp, previous_mlp_only): "
                         "channels and means once per value, previous_mlp labelled /early, previous_mlp_only "
                         "/predicted (default: FreeKVConfig's, unlabelled)")
    ap.add_argument("--kv-prefill", default="full",
                    help="comma-separated from full, tsp: tsp runs every method after FastKV's token-selective "
                         "propagation too, once per --kv-tsp-keep")
    ap.add_argument("--kv-tsp-layer", type=int, default=14,
                    help="TSP layer (default 14: the middle of SmolLM2's 30 layers, as the paper's 15 of 32)")
    ap.add_argument("--kv-tsp-keep", default="512", help="comma-separated tokens propagated past the TSP layer")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dense-layers", type=int, default=1, help="leading dense layers of the sparse methods")
    ap.add_argument("--kv-host-dtype", choices=HOST_DTYPES, default="auto",
                    help="how host pages hold K and V (FreeKVConfig.host_dtype): fp8_e4m3 rounds every recalled page")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--template", choices=("chat", "plain"), default="chat")
    ap.add_argument("--batch", type=int, default=4, help="prompts prefilled and decoded together")
    ap.add_argument("--out", default="results/accuracy", help="output directory (records.jsonl is resumed)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--model", default=None, help="a packaged model (freekv_sglang.hf_models: smollm2, "
                    "qwen2.5-coder-0.5b) or a local HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--backend", choices=("engine", "sglang"), default="engine")
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="SGLang server (--backend sglang)")
    ap.add_argument("--server-method", default="sglang", help="row label of the server's answers")
    ap.add_argument("--server-budget", type=int, default=None, help="budget the server runs with (label only)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"quick end-to-end check: {SMOKE} with every method (overrides those options)")
    return ap


def load(args):
    """(model or None, tokenizer): a packaged model (SmolLM2 by default) unless --model names an HF directory."""
    from .. import hf_models

    if args.model is None or args.model in hf_models.MODELS:
        name = args.model or "smollm2"
        if args.backend == "sglang":
            from transformers import AutoTokenizer

            return None, AutoTokenizer.from_pretrained(str(hf_models.hf_dir(name)), local_files_only=True)
        return hf_models.load_model(name, _DTYPES[args.dtype], args.device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    if args.backend == "sglang":
        return None, tok
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=_DTYPES[args.dtype], local_files_only=True)
    return model.to(args.device).eval(), tok


def _git_commit() -> str | None:
    """HEAD of the checkout the harness runs from (with '+dirty' when files differ), for the record."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        if args.out == parser().get_default("out"):
            args.out = "results/accuracy-smoke"
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
        geo = Geometry(args.sink, args.window, args.page_size, args.dense_layers, args.kv_host_dtype)
        cfg = RunConfig(tasks=tasks, lengths=_ints(args.lengths), budgets=_ints(args.budgets), samples=args.samples,
                        methods=with_prefill(parse_methods(args.methods, _floats(args.taus), args.rerank_factor,
                                                           args.louiskv_tau, args.sketch_channels,
                                                           None if args.hysteresis is None else
                                                           _floats(args.hysteresis),
                                                           None if args.correct_at is None else
                                                           [a.strip() for a in args.correct_at.split(",")
                                                            if a.strip()]),
                                             [p.strip() for p in args.kv_prefill.split(",") if p.strip()],
                                             args.kv_tsp_layer, _ints(args.kv_tsp_keep)), geometry=geo,
                        seed=args.seed,
                        template=args.template, batch=args.batch, backend=args.backend, url=args.url,
                        server_method=args.server_method, server_budget=args.server_budget,
                        calibration_tokens=args.calibration_tokens)
        for spec in cfg.methods:  # refuse bad geometry before any prefill
            for b in cfg.budgets if spec.uses_budget else [0]:
                spec.config(b, geo, max(args.dense_layers, 1))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    t0 = time.perf_counter()
    model, tok = load(args)
    print(f"model loaded in {time.perf_counter() - t0:.1f} s; writing {out}/", flush=True)
    rec = run(cfg, tok, out, model=model, log=lambda m: print(m, flush=True))
    meta = dict(argv=sys.argv[1:] if argv is None else argv, args=vars(args), commit=_git_commit(),
                machine=platform.node(), processor=platform.processor() or platform.machine(), torch=torch.__version__,
                threads=torch.get_num_threads(), budget_excludes_sink_and_window=True,
                streaming_window="window + budget", wall_s=time.perf_counter() - t0)
    summary, md, msgs = report.write(rec.records, out, meta)
    print(md)
    for m in msgs:
        print(m)
    print(f"records: {out / 'records.jsonl'}; summary: {out / 'summary.json'}; table: {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
