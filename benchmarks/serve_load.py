"""Concurrent load on an SGLang server: random token-id prompts, streamed greedy decoding.

    python3 benchmarks/serve_load.py --url http://127.0.0.1:30001 --input-len 32000 --output-len 256 \
        --num-prompts 8 --concurrency 4 --out results/serve-load.json

Equivalent to `sglang.bench_serving --dataset-name random-ids` (which needs the `datasets` package the
offline GPU host lacks): per request TTFT (first streamed token) and TPOT (mean gap after it), plus
completion count, errors and output throughput. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path


def one_request(url: str, ids: list[int], output_len: int, timeout: float) -> dict:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps, tokens, cached = [], 0, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[5:])
                cached = msg.get("meta_info", {}).get("cached_tokens", cached)  # the prompt's radix-cache hit
                n = msg.get("meta_info", {}).get("completion_tokens", tokens)
                if n > tokens:
                    stamps.append(time.perf_counter())
                    tokens = n
    except Exception as e:  # reported per request, the run goes on
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "tokens": tokens}
    if tokens != output_len or not stamps:
        return {"ok": False, "error": f"{tokens} of {output_len} tokens", "tokens": tokens}
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(tokens - 1, 1)
    return {"ok": True, "ttft_s": ttft, "tpot_s": tpot, "latency_s": stamps[-1] - t0, "tokens": tokens,
            "cached_tokens": cached, "stamps_s": [s - t0 for s in stamps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--input-len", type=int, default=32000)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn from [100, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="results/serve-load.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as ex:
        results = list(ex.map(lambda p: one_request(args.url, p, args.output_len, args.timeout), prompts))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    summary = {
        "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
        "concurrency": args.concurrency, "completed": len(ok), "errors": [r["error"] for r in results if not r["ok"]],
        "wall_s": round(wall, 2), "output_tok_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
    }
    if ok:
        for key in ("ttft_s", "tpot_s", "latency_s"):
            vals = sorted(r[key] for r in ok)
            summary[f"{key}_p50"] = round(statistics.median(vals), 4)
            summary[f"{key}_max"] = round(vals[-1], 4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "requests": results}, indent=1))
    print(f"{'completed':>10} {'errors':>7} {'TTFT p50 s':>11} {'TPOT p50 ms':>12} {'out tok/s':>10} {'wall s':>8}")
    print(f"{len(ok):>10} {len(summary['errors']):>7} {summary.get('ttft_s_p50', float('nan')):>11.3f} "
          f"{1000 * summary.get('tpot_s_p50', float('nan')):>12.2f} {summary['output_tok_per_s']:>10.1f} {wall:>8.1f}")
    for e in summary["errors"][:5]:
        print("error:", e)


if __name__ == "__main__":
    main()
