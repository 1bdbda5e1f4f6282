"""Launch a plain SGLang server and a FreeKV server on one GPU and compare their greedy outputs.

    python3 scripts/serve_check.py --model /tmp/smollm2 --out results [--attention-backend triton]

Both servers use the same page size and no radix cache, so the only difference is FreeKV decode
attention. With --radix both keep SGLang's radix cache (FreeKV: prefixes shared through the kvstore arena) and the
prompts share prefixes of several lengths, page-aligned and ending mid-page: each base prompt is sent first, then its
sharers concurrently, and each request's cached_tokens is recorded, so the comparison covers hits. With the budget above every context FreeKV attends to exactly the tokens full attention
does, and over FlashInfer it runs FlashInfer's own decode kernel on them in the same order, so
greedy outputs must agree token for token. The default adds --enable-deterministic-inference to both
servers: without it SGLang's GEMMs and norms round differently with the batch's composition, which
differs between two runs of concurrent requests, so even two plain servers disagree at exact
logprob ties (the "plain concurrent vs one at a time" line measures that). Also reports the FreeKV
log lines (correction rate, recall bytes) and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from server_process import ServerProcess

COMMON = ["--disable-radix-cache", "--page-size", "32", "--sampling-backend", "pytorch", "--grammar-backend", "none",
          "--max-running-requests", "32", "--mem-fraction-static", "0.25", "--log-level", "info"]


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server(ServerProcess):
    def generate(self, ids: list[int], max_new: int, margins: list | None = None, cached: list | None = None
                 ) -> list[int]:
        """Greedy token ids; with `margins`, also appends the top-1 minus top-2 logprob per position; with `cached`,
        the prompt tokens the radix cache held."""
        out = post(self.url + "/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                            "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                                "ignore_eos": True}})
        if margins is not None:
            margins.append([t[0][0] - t[1][0] for t in out["meta_info"]["output_top_logprobs"]])
        if cached is not None:
            cached.append(out["meta_info"].get("cached_tokens"))
        return [t[1] for t in out["meta_info"]["output_token_logprobs"]]


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[list[bool], list[int | None]]:
    """Per prompt: whether two servers' greedy outputs are identical, and the first position where they differ."""
    same = [x == y for x, y in zip(a, b)]
    return same, [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]


def prompts(model: str, n: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    words = ("river mountain garden window silver yellow quiet morning thunder paper candle forest "
             "ocean market bridge engine pencil shadow winter summer").split()
    out = []
    for i in range(n):
        key = rng.randint(10000, 99999)
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(100, 2500)))
        text = f"The pass key is {key}. Remember it. {filler} What is the pass key? The pass key is"
        out.append(tok(text)["input_ids"])
    return out


def shared_prompts(model: str, n: int, seed: int, page: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    """Base prompts, and for each its sharers: the base cut at a page boundary, mid-page (13 tokens past one) and 5
    tokens before its end, each followed by a question of its own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    bases, sharers = prompts(model, n, seed), []
    for i, base in enumerate(bases):
        half = len(base) // 2 // page * page
        for j, cut in enumerate((half, half + 13, len(base) - 5)):
            tail = tok(f" Question {i}.{j}: what is the pass key? The pass key is", add_special_tokens=False)
            sharers.append(base[:cut] + tail["input_ids"])
    return bases, sharers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="results")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    # --kv-attention backend: FlashInfer's own decode kernel, the only attention allowed with deterministic inference
    ap.add_argument("--freekv-args", default="--kv-budget 8192 --kv-sink 64 --kv-window 128 --kv-page-size 32 "
                    "--kvstore-arena-gb 4 --kv-attention backend")
    ap.add_argument("--also", default="",
                    help="a second FreeKV server with --freekv-args plus these, compared with plain and with the first "
                         "(e.g. '--kv-correct-at previous_mlp' at a budget below the prompts)")
    ap.add_argument("--radix", action="store_true", help="both servers with the radix cache, prompts sharing prefixes")
    ap.add_argument("--extra-args", default="--enable-deterministic-inference",
                    help="passed to both servers, e.g. '--enable-deterministic-inference --disable-cuda-graph'")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FREEKV_STATS_EVERY", "16")
    common = ["--attention-backend", args.attention_backend, *args.extra_args.split()]
    base_args = [a for a in COMMON if not (args.radix and a == "--disable-radix-cache")]
    result: dict = {"attention_backend": args.attention_backend, "freekv_args": args.freekv_args,
                    "also": args.also, "extra_args": args.extra_args, "radix": args.radix}
    freekv = common + ["--kv-retrieval", "freekv", *args.freekv_args.split()]
    runs = [("plain", 30000, common), ("freekv", 30001, freekv)]
    if args.also:
        runs.append(("freekv-also", 30002, freekv + args.also.split()))
    servers: list[Server] = []
    try:
        # One after the other: servers that profile GPU memory at the same time see each other's buffers.
        for name, port, extra in runs:
            s = Server(name, port, ["--model-path", args.model, *base_args, *extra], out / f"server-{name}.log")
            servers.append(s)
            result[f"{s.name}_healthy_s"] = round(s.wait(600), 1)
            print(f"[{s.name}] healthy after {result[f'{s.name}_healthy_s']} s", flush=True)
        if args.radix:
            bases, sharers = shared_prompts(args.model, max(args.prompts // 4, 1), seed=0)
            ps = bases + sharers
        else:
            bases, ps = [], prompts(args.model, args.prompts, seed=0)
        result["prompt_tokens"] = [len(p) for p in ps]
        outs = {}
        for s in servers:
            t0 = time.time()
            first = [s.generate(p, args.max_new_tokens) for p in bases]  # in the radix cache before their sharers
            rest, hits = ps[len(bases):], [[] for _ in ps[len(bases):]]
            with cf.ThreadPoolExecutor(len(rest)) as ex:  # the rest at once: continuous batching
                outs[s.name] = first + list(ex.map(lambda i: s.generate(rest[i], args.max_new_tokens, cached=hits[i]),
                                                   range(len(rest))))
            result[f"{s.name}_seconds"] = round(time.time() - t0, 2)
            if args.radix:  # what each sharer's admission found cached (its base, or more where a sharer came first)
                result[f"{s.name}_sharer_cached_tokens"] = [h[0] for h in hits]
                print(f"[{s.name}] sharers' cached tokens: {result[f'{s.name}_sharer_cached_tokens']}")
        same, first_diff = compare(outs["plain"], outs["freekv"])
        result.update(identical=sum(same), total=len(same), first_divergence=first_diff, outputs=outs)
        print(f"greedy outputs identical: {sum(same)}/{len(same)}; first divergence per prompt: {first_diff}",
              flush=True)
        if args.also:
            for ref in ("plain", "freekv"):
                also_same, also_diff = compare(outs[ref], outs["freekv-also"])
                result[f"also_vs_{ref}_identical"] = sum(also_same)
                result[f"also_vs_{ref}_first_divergence"] = also_diff
                print(f"with {args.also!r} against {ref}: identical {sum(also_same)}/{len(also_same)}; "
                      f"first divergence per prompt: {also_diff}", flush=True)
        # SGLang's own spread: the plain server again, one request at a time (other batch shapes, other
        # kernel splits). bf16 near-ties flip there too; FreeKV should agree with plain about as often.
        # The comparison above stands if this second pass fails.
        margins: list[list[float]] = []
        try:
            outs["plain_sequential"] = [servers[0].generate(p, args.max_new_tokens, margins) for p in ps]
        except OSError as e:
            result["plain_sequential_error"] = f"{type(e).__name__}: {e}"
            print(f"plain server, one at a time: failed ({result['plain_sequential_error']})")
        else:
            plain_same = [a == b for a, b in zip(outs["plain"], outs["plain_sequential"])]
            result["plain_concurrent_vs_sequential_identical"] = sum(plain_same)
            print(f"plain server, concurrent vs one at a time: identical {sum(plain_same)}/{len(plain_same)}")
            # How close to a tie the plain server's own top-2 logprobs were where FreeKV took the other token.
            diverged = {"": first_diff}
            if args.also:
                diverged["also_"] = result["also_vs_plain_first_divergence"]
            for key, firsts in diverged.items():
                div_margin = [None if i is None else round(margins[j][i], 4) for j, i in enumerate(firsts)]
                result[f"{key}plain_top2_margin_at_divergence"] = div_margin
                print(f"plain server's top-2 logprob margin where {'the second ' if key else ''}FreeKV diverged: "
                      f"{div_margin}")
        for s in servers[1:]:
            fk_log = s.log.read_text(errors="replace").splitlines()
            result[f"{s.name}_log"] = [ln for ln in fk_log if "FreeKV" in ln][-10:]
            for ln in result[f"{s.name}_log"]:
                print(f"[{s.name}] {ln}")
    finally:
        for s in servers:
            s.stop()
        (out / f"serve-check-{args.attention_backend}.json").write_text(json.dumps(result, indent=1))
        for s in servers:
            print(f"--- tail of {s.name} log ---\n{s.tail(15)}")


if __name__ == "__main__":
    main()
