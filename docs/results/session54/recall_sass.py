"""Static SASS of _recall_pages_kernel for sm_90 on a CPU machine (session 54), specialised as the served launches
specialise it (FP8 host pages, victim cache, page 32, head dim 128; pointers and strides divisible by 16, strides
equal to 1 as constants), for 1, 2 and 4 chunks in flight a program: registers, stack (spills) and instructions a
thread, and the programs an SM holds by its 65,536 registers. Session 47's script without CHUNKS is its baseline.

    python3 docs/results/session54/recall_sass.py"""
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from sass import compile_sass  # noqa: E402

from freekv_kernels.recall import triton as recall  # noqa: E402

TYPES = {"host_ptr": "*fp8e4nv", "exp_ptr": "*i8", "k_ptr": "*bf16", "v_ptr": "*bf16", "pt_ptr": "*i32",
         "slots_ptr": "*i32", "req_ptr": "*i32", "spages_ptr": "*i32", "recall_ptr": "*i8", "vops_ptr": "*i32"}
ONES = dict(s_et=1, spt_m=1, st_k=1, s_req=1, sg_k=1, sr_k=1, so_k=1)  # Triton specialises ints equal to 1
DIV16 = {"K", "s_hp", "s_hh", "s_hkv", "s_ht", "s_ep", "s_eh", "s_ekv", "s_kt", "s_kh", "s_vt", "s_vh", "st_r", "st_h",
         "sg_b", "sr_b", "sr_h", "so_b", "so_h"}
params = list(inspect.signature(recall._recall_pages_kernel.fn).parameters)
print(f"{'launch':<34} {'chunks':>6} {'warps':>5} {'regs':>5} {'stack':>5} {'SASS':>6} {'programs an SM':>15}")
for name, sb, chunks in (("before attention, one slot", 1, 1), ("before attention, block 4", 4, 1),
                         ("before attention, block 4", 4, 2), ("before attention, block 4", 4, 4),
                         ("speculative, a row a program", 64, 1), ("speculative, a row a program", 64, 2),
                         ("speculative, a row a program", 64, 4)):
    warps = 4 * chunks  # as recall_pages launches it
    cx = dict(PHASE=1, PAGE=32, D=128, SB=sb, VICTIMS=True, SHIFT=16, SCALED=True, CHUNKS=chunks, **ONES)
    launch = dict(module=recall.__name__, name="_recall_pages_kernel", constexprs=cx, options={"num_warps": warps},
                  signature={p: "constexpr" if p in cx else TYPES.get(p, "i32") for p in params},
                  divisible=[i for i, p in enumerate(params) if p.endswith("_ptr") or p in DIV16])
    with tempfile.TemporaryDirectory() as tmp:
        res = compile_sass(launch, Path(tmp))
    per_sm = min(65536 // (res["registers"] * 32 * warps), 64 // warps, 32)
    print(f"{name:<34} {chunks:>6} {warps:>5} {res['registers']:>5} {res['stack']:>5} {res['instructions']:>6} "
          f"{per_sm:>15}")
