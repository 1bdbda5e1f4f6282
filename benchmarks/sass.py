"""SASS of the selection kernels for sm_90, on a machine without a GPU: registers and instructions per kernel.

    python3 benchmarks/sass.py                       # every kernel of one channels, sketch, rerank/2 and MeanS selection
    python3 benchmarks/sass.py --kernel _rerank_lse_kernel --dump   # and its SASS, with an opcode histogram

An issue-bound kernel's time follows its instruction count, which needs no GPU to count: a selection at the
Llama-3.1-8B attention shape (32 query / 8 KV heads, head dim 128, bf16, page 32, budget 2048) runs once under
TRITON_INTERPRET=1 in a child process that records each launch's argument types, constexprs and launch options; each
distinct kernel is then compiled for sm_90 with those (pointers and ints divisible by 16 marked so, as Triton's
launcher specialises them) and its cubin read with the cuobjdump that ships with Triton. Loads in flight and
latency are not modelled: a latency-bound kernel (the sketch) is not predicted by its count.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _arg_type(value) -> tuple[str, bool]:
    """Triton's signature type of one runtime argument, and whether the launcher marks it divisible by 16."""
    import torch

    if isinstance(value, torch.Tensor):
        names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64", torch.int8: "i8",
                 torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
        return "*" + names[value.dtype], True
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"no Triton type for {type(value).__name__}")


def capture() -> None:
    """Child process (TRITON_INTERPRET=1): run one selection per method, print each launch as a JSON line."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    seen = set()
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = list(self.arg_names)
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
        params = inspect.signature(fn).parameters
        signature, constexprs, divisible = {}, {}, []
        for i, name in enumerate(names):
            v = values.get(name, params[name].default)
            if "constexpr" in str(params[name].annotation):
                signature[name], constexprs[name] = "constexpr", v
            elif v is None:
                signature[name], constexprs[name] = "constexpr", None
            elif isinstance(v, int) and not isinstance(v, bool) and v == 1:
                signature[name], constexprs[name] = "constexpr", 1  # the launcher specialises 1 to a constant
            else:
                signature[name], div = _arg_type(v)
                if div:
                    divisible.append(i)
        key = (fn.__module__, fn.__name__, json.dumps(signature), json.dumps(constexprs, default=str))
        if key not in seen:
            seen.add(key)
            options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
            print(json.dumps({"module": fn.__module__, "name": fn.__name__, "signature": signature,
                              "constexprs": constexprs, "divisible": divisible, "options": options}), flush=True)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = record
    from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
    from freekv_sglang.config import FreeKVConfig
    from freekv_sglang.engine import FreeKVEngine, ModelShape

    torch.manual_seed(0)
    L, HQ, H, D, B, ctx = 3, 32, 8, 128, 2, 4096
    for selection in ("channels", "sketch", "rerank", "means"):
        cfg = FreeKVConfig(budget=2048, sink=128, window=512, page_size=32, selection=selection)
        eng = FreeKVEngine(cfg, ModelShape(L, HQ, H, D), max_requests=B, max_context=ctx + 64,
                           dtype=torch.bfloat16, device="cpu", backend="triton")
        if eng.needs_calibration:
            calibrate_synthetic(eng, gaussian_sample(eng, seed=0))
        slots = [eng.add_request() for _ in range(B)]
        for s in slots:
            eng.begin_prefill(s, ctx)
            for layer in range(L):
                eng.prefill_layer(s, layer, torch.randn(ctx, H, D, dtype=torch.bfloat16),
                                  torch.randn(ctx, H, D, dtype=torch.bfloat16))
        for _ in range(2):
            plan = eng.begin_step(slots)
            for layer in range(L):
                eng.attend(plan, layer, torch.randn(B, HQ, D, dtype=torch.bfloat16),
                           torch.randn(B, H, D, dtype=torch.bfloat16), torch.randn(B, H, D, dtype=torch.bfloat16))
            eng.end_step()


def opcodes(sass: str) -> list[str]:
    """The opcode of each instruction of cuobjdump's SASS text but NOPs. An instruction's byte offset is written in
    4 hex digits below 0x10000 and in more past it: a kernel of over 4,096 instructions must count those too."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?", sass)
    return [op for op in ops if op != "NOP"]


def compile_sass(launch: dict, workdir: Path) -> dict:
    """Compile one recorded launch for sm_90; registers, spills, shared memory (bytes a CTA), SASS text."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch["divisible"]}
    src = ASTSource(fn, launch["signature"], launch["constexprs"], attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    cubin = workdir / f"{launch['name']}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    ops = opcodes(sass)
    return {"kernel": launch["name"], "warps": launch["options"].get("num_warps", 4),
            "registers": int(regs.group(1)) if regs else None, "stack": int(spill.group(1)) if spill else None,
            "shared": kernel.metadata.shared, "instructions": len(ops), "opcodes": collections.Counter(ops),
            "sass": sass}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default=None, help="only kernels whose name contains this")
    ap.add_argument("--dump", action="store_true", help="print the SASS and the opcode histogram too")
    ap.add_argument("--capture", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.capture:
        capture()
        return
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                       os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, __file__, "--capture"], env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"capture failed:\n{out.stderr[-3000:]}")
    launches = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if args.kernel:
        launches = [x for x in launches if args.kernel in x["name"]]
    print(f"{'kernel':<32} {'warps':>5} {'regs':>5} {'stack':>5} {'smem KB':>7} {'SASS':>6}  constexprs")
    with tempfile.TemporaryDirectory() as tmp:
        for launch in launches:
            r = compile_sass(launch, Path(tmp))
            const = {k: v for k, v in launch["constexprs"].items() if v is not None and k.isupper()}
            print(f"{r['kernel']:<32} {r['warps']:>5} {r['registers']!s:>5} {r['stack']!s:>5} "
                  f"{r['shared'] / 1024:>7.1f} {r['instructions']:>6}  {const}")
            if args.dump:
                print(r["sass"])
                print(", ".join(f"{op} {n}" for op, n in r["opcodes"].most_common(40)))


if __name__ == "__main__":
    main()
