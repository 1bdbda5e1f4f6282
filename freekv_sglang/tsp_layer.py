"""FastKV's TSP layer selection (the paper's section 3.5): which --kv-tsp-layer to serve a model with.

For each candidate layer L up to half the model's layers (the paper's L_max), calibration prompts are prefilled with
token-selective propagation at L, and the final hidden states of the propagated tokens (after the last norm, what
the LM head reads) are compared with the full-context prefill's at the same positions: the mean over those tokens of
the squared L2 distance (equation 4). The paper serves the argmin. Calibrate on ordinary text of the lengths you
serve, not on the evaluation tasks:

    python -m freekv_sglang.tsp_layer --text a.txt --text b.txt --length 4096 --keep 1024 [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .config import FreeKVConfig
from .hf_adapter import FreeKVModel


def discrepancy(fm: FreeKVModel, ids: list[int], layers: list[int], keep: int) -> dict[int, float]:
    """Per candidate TSP layer, the mean squared L2 distance between the final hidden states of the propagated
    tokens with TSP at that layer and those of the full prefill (0 when the prompt propagates whole)."""
    full = fm.prompt_pass(ids, None)[4].float()
    out = {}
    for layer in layers:
        _, _, _, kept, h = fm.prompt_pass(ids, (layer, keep))
        ref = full if kept is None else full[kept]
        out[layer] = float(((h.float() - ref) ** 2).sum(-1).mean())
    return out


def candidates(num_layers: int) -> list[int]:
    """Layers 0..L_max, L_max half the model's layers (the paper's bound: TSP deeper than that saves too little)."""
    return list(range(num_layers // 2 + 1))


def select(scores: dict[int, float]) -> int:
    """The paper's choice: the candidate with the least discrepancy (the shallower one on a tie)."""
    return min(scores, key=lambda layer: (scores[layer], layer))


def windows(token_ids: list[int], length: int, count: int) -> list[list[int]]:
    """Up to `count` prompts of `length` tokens, spread evenly over token_ids."""
    if len(token_ids) < length:
        raise ValueError(f"the calibration text holds {len(token_ids)} tokens, fewer than --length {length}")
    starts = torch.linspace(0, len(token_ids) - length, count).long().unique().tolist()
    return [token_ids[s:s + length] for s in starts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", action="append", required=True, help="a calibration text file (repeatable)")
    ap.add_argument("--length", type=int, default=4096, help="tokens per calibration prompt")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per text")
    ap.add_argument("--keep", type=int, default=2048, help="--kv-tsp-keep to calibrate for")
    ap.add_argument("--model", default=None, help="a local HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    if args.model is None:
        from .hf_models import load_smollm2

        model, tok = load_smollm2(torch.float32, args.device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).to(args.device).eval()
    try:
        prompts = [w for f in args.text for w in windows(tok(Path(f).read_text())["input_ids"], args.length,
                                                         args.prompts)]
        cfg = FreeKVConfig(page_size=16, budget=256, sink=64, window=128)  # the engines are built, never decoded
        fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=args.length + 1)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    layers = candidates(fm.shape.num_layers)
    per_prompt = [discrepancy(fm, ids, layers, args.keep) for ids in prompts]
    mean = {layer: sum(d[layer] for d in per_prompt) / len(per_prompt) for layer in layers}
    best = select(mean)
    print(f"{len(prompts)} prompts of {args.length} tokens, keep {args.keep}; mean squared L2 distance of the "
          "propagated tokens' final hidden states to the full prefill's:")
    for layer in layers:
        print(f"  layer {layer:>3}: {mean[layer]:.4f}{'  <- --kv-tsp-layer ' + str(best) if layer == best else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps({"length": args.length, "keep": args.keep, "prompts": len(prompts),
                                              "discrepancy": mean, "tsp_layer": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
