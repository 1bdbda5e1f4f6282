"""Do FP8 host pages cost accuracy? The accuracy harness twice over the same prompts, with host pages in the model's
dtype and in FP8 e4m3 (--kv-host-dtype fp8_e4m3: every row of a recalled page rounded to e4m3 times its power-of-two
scale, freekv_kernels.fp8_rows), then each (task, length)'s scores and how many prompts got the same output.

    python3 benchmarks/fp8_host_study.py --out results/fp8 -- --tasks passkey,multikey --lengths 4096 \
        --budgets 512 --samples 8 --methods channels

runs `python -m freekv_sglang.accuracy` with the arguments after `--` into results/fp8/auto and results/fp8/fp8_e4m3
(one method and budget: the comparison is per run), on the harness's --device (the kernels on a GPU, their torch
references on the CPU). Either run is resumed from its records. Any two runs of one method and budget each (e.g.
against dense as a reference):

    python3 benchmarks/fp8_host_study.py --compare results/fp8/auto results/dense
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freekv_sglang.accuracy.__main__ import main as accuracy_main
from freekv_sglang.accuracy.runner import RecordLog

HOST_DTYPES = ("auto", "fp8_e4m3")


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


def print_comparison(base: Path, other: Path) -> None:
    rows = compare(base, other)
    print(f"base {rows[0]['base']} ({base}), other {rows[0]['other']} ({other})")
    print(f"{'task':<10} {'length':>6} {'n':>3} {'base':>5} {'other':>5} same output")
    for c in rows:
        print(f"{c['task']:<10} {c['length']:>6} {c['n']:>3} {c['score_base']:>5.1f} {c['score_other']:>5.1f} "
              f"{c['same_output']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, harness = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="runs go to OUT/auto and OUT/fp8_e4m3")
    mode.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "OTHER"))
    args = ap.parse_args(ours)
    if args.compare:
        print_comparison(*args.compare)
        return 0
    taken = [a for a in harness if a.split("=")[0] in ("--out", "--kv-host-dtype")]
    if taken:
        ap.error(f"the study sets {', '.join(taken)} of each run itself")
    for dtype in HOST_DTYPES:
        rc = accuracy_main([*harness, "--out", str(args.out / dtype), "--kv-host-dtype", dtype])
        if rc:
            return rc
    print_comparison(args.out / HOST_DTYPES[0], args.out / HOST_DTYPES[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
