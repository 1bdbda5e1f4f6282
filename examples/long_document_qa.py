"""Long-document QA against a FreeKV server, with SGLang's frontend language (sgl.function, sgl.gen, sgl.select).

The document is generated: a few thousand tokens of inventory records with one fact (a vault code) hidden at a
chosen depth, far outside FreeKV's sink and window, so the answer has to come from pages FreeKV retrieves. The
program asks for the code with sgl.gen, then picks it among distractors with sgl.select (prefill-only logprob calls).

    bash examples/launch_freekv_server.sh      # MODEL=... ; in another shell:
    python examples/long_document_qa.py --url http://127.0.0.1:30000 --records 400 --depth 0.3
"""

from __future__ import annotations

import argparse
import random

import sglang as sgl

ITEMS = ("copper wire", "valves", "ball bearings", "fuses", "gaskets", "rivets", "hinges", "springs", "washers")
ROOMS = ("north hall", "loading dock", "basement", "annex", "workshop", "cold store", "east wing")


def make_document(records: int, depth: float, code: str, seed: int = 0) -> str:
    """records inventory lines with the vault code stated once, at fraction depth of the document."""
    rng = random.Random(seed)
    lines = [
        f"Record {i}: {rng.randint(2, 900)} boxes of {rng.choice(ITEMS)} were moved to the {rng.choice(ROOMS)} "
        f"on day {rng.randint(1, 365)} and counted by clerk {rng.randint(10, 99)}."
        for i in range(records)
    ]
    lines.insert(int(depth * records), f"Note: the code that opens the vault in the basement is {code}.")
    return "\n".join(lines)


def make_choices(code: str, n: int = 4, seed: int = 0) -> list[str]:
    rng = random.Random(seed + 1)
    choices = {code}
    while len(choices) < n:
        choices.add(str(rng.randint(1000, 9999)))
    return sorted(choices)


@sgl.function
def document_qa(s, document, question, choices):
    s += sgl.system("You answer questions about the document you are given. Answer briefly.")
    s += sgl.user(document + "\n\nQuestion: " + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=32, temperature=0.0))
    s += sgl.user("Which of these is the code? " + ", ".join(choices))
    s += sgl.assistant(sgl.select("choice", choices=choices))


QUESTION = "What is the code that opens the vault in the basement?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the SGLang server (default %(default)s)")
    p.add_argument("--records", type=int, default=400, help="document length in records (~25 tokens each)")
    p.add_argument("--depth", type=float, default=0.3, help="where the fact sits, 0 = start, 1 = end")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    code = str(random.Random(args.seed).randint(1000, 9999))
    document = make_document(args.records, args.depth, code, args.seed)
    choices = make_choices(code, seed=args.seed)
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    state = document_qa.run(document=document, question=QUESTION, choices=choices)
    print(f"document: {len(document)} characters, fact at depth {args.depth}")
    print(f"answer: {state['answer'].strip()!r}")
    print(f"choice: {state['choice']} (expected {code})")
    return 0 if state["choice"] == code else 1


if __name__ == "__main__":
    raise SystemExit(main())
