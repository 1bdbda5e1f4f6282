"""The selection kernels compile for sm_90 (an H100) on this machine, with and without hysteresis: the interpreter
that runs the CPU tests accepts code the GPU compiler refuses (a global read inside a kernel that is not a
tl.constexpr object, once). Compiled in a child process without TRITON_INTERPRET, which turns kernels into
interpreted functions at import."""

import os
import subprocess
import sys

CHILD = r'''
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freekv_kernels.page_select import triton as page_select

TYPES = {"in_ptr": "*fp32", "slots_ptr": "*i32", "req_ptr": "*i32", "heads_ptr": "*i1", "flags_ptr": "*i1",
         "recall_ptr": "*i8", "stats_ptr": "*fp64", "out_ptr": "*i64", "bonus": "fp32", "vict_ptr": "*i32",
         "age_ptr": "*i32", "vops_ptr": "*i32"}

def compile_sm90(kernel, constexprs, num_warps):
    params = inspect.signature(kernel.fn).parameters
    signature = {p: "constexpr" if p in constexprs else TYPES.get(p, "i32") for p in params}
    src = ASTSource(kernel, signature, constexprs, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

for hyst in (False, True):  # with hysteresis: also with the victim cache and its hit statistics
    common = {"KP": 64, "PACKED_IN": False, "WANT": 1, "NEG_INF_KEY": page_select._NEG_INF_KEY, "HYST": hyst}
    victims = {"VICTIMS": hyst, "VP": 64, "HIT_STATS": hyst, "SHIFT": 16}
    single = compile_sm90(page_select._select_slots_kernel, {**common, "CHUNK": 1024, "PHASE": 2,
                                                             "RECALL_ALL": False, "STATS": True, **victims}, 8)
    staged = compile_sm90(page_select._topk_kernel, {**common, "CHUNK": 512}, 4)
    assert ".entry _select_slots_kernel" in single and ".entry _topk_kernel" in staged
    print("compiled", hyst)
'''


def test_select_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["compiled", "False", "compiled", "True"]
