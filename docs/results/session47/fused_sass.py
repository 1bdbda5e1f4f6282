"""Static SASS of _select_chain_kernel for sm_90 on a CPU machine (session 47), served as at the Qwen2.5-7B shape
(1,024 lanes, k 64, 64 victim entries, a group of 7, 8 warps, pointers and strides divisible by 16 marked so), with
and without what it may do after its commit: the token lists with query rows (LISTS) and the recall before attention
of FP8 host pages, C_M chunks in flight (RECALL). Registers, stack, instructions and barriers a thread.

    python3 docs/results/session47/fused_sass.py"""
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from freekv_kernels.page_select import triton as page_select  # noqa: E402
from freekv_kernels.select_chain import triton as sc  # noqa: E402
from sass import compile_sass  # noqa: E402

TYPES = {"lse_ptr": "*fp32", "cend_ptr": "*i32", "draws_ptr": "*fp32", "rate_k": "fp32", "returns": "fp32",
         "in_ptr": "*fp32", "slots_ptr": "*i32", "req_ptr": "*i32", "heads_ptr": "*i1", "flags_ptr": "*i1",
         "recall_ptr": "*i8", "stats_ptr": "*fp64", "bonus": "fp32", "vict_ptr": "*i32", "age_ptr": "*i32",
         "vops_ptr": "*i32", "row_ptr": "*fp32", "lrow_ptr": "*i32", "nsink_ptr": "*i32", "nslots_ptr": "*i32",
         "lpages_ptr": "*i32", "tokens_ptr": "*i32", "start_ptr": "*i32", "lout_ptr": "*i32", "q_ptr": "*bf16",
         "qr_ptr": "*bf16", "host_ptr": "*fp8e4nv", "exp_ptr": "*i8", "k_ptr": "*bf16", "v_ptr": "*bf16",
         "pt_ptr": "*i32", "spages_ptr": "*i32"}
BASE = {"KP": 64, "CHUNK": 1024, "PACKED_IN": False, "PHASE": 1, "WANT": 1, "RECALL_ALL": False, "STATS": True,
        "NEG_INF_KEY": page_select._NEG_INF_KEY, "HYST": True, "VICTIMS": True, "VP": 64, "HIT_STATS": True,
        "SHIFT": 16, "SCRATCH": True, "POOL": True, "G": 7, "GP": 8, "POOL_BLOCK": 1024, "REPLAY": True, "R_KP": 64,
        "R_BLOCK": 1024, "PROMOTED": 1.0e4, "TIE": 1.0 / 1024, "LISTS": False, "L_PAGE": 1, "L_SB": 1, "L_PB": 1,
        "L_EMPTY": 0x7FFFFFFF, "L_Q": False, "L_G": 1, "L_GP": 1, "L_D": 1, "L_DP": 1, "RECALL": False, "C_PAGE": 1,
        "C_D": 1, "C_SCALED": False, "C_M": 1}
LISTS = {"LISTS": True, "L_PAGE": 32, "L_SB": 64, "L_PB": 64, "L_Q": True, "L_G": 7, "L_GP": 8, "L_D": 128,
         "L_DP": 128}
RECALL = {"RECALL": True, "C_PAGE": 32, "C_D": 128, "C_SCALED": True}
ONES = dict(s_et=1, spt_m=1, st_k=1, s_req=1, sg_k=1, sr_k=1, so_k=1, si_j=1, sa_e=1, sv_e=1, lr_i=1, lg_k=1,
            lq_d=1)
params = list(inspect.signature(sc._select_chain_kernel.fn).parameters)
variants = [("served (select_chain alone)", {}), ("+ token lists", LISTS)]
variants += [(f"+ token lists + recall, {m} in flight", {**LISTS, **RECALL, "C_M": m}) for m in (1, 2, 4)]
print(f"{'variant':<40} {'regs':>5} {'stack':>5} {'SASS':>6} {'BAR':>4}")
for name, extra in variants:
    cx = {**BASE, **extra, **{k: v for k, v in ONES.items() if k in params}}
    launch = dict(module=sc.__name__, name="_select_chain_kernel", constexprs=cx, options={"num_warps": 8},
                  signature={p: "constexpr" if p in cx else TYPES.get(p, "i32") for p in params},
                  divisible=[i for i, p in enumerate(params) if p.endswith("_ptr") or p.startswith(("s", "l"))
                             and p not in cx and TYPES.get(p, "i32") == "i32"])
    with tempfile.TemporaryDirectory() as tmp:
        res = compile_sass(launch, Path(tmp))
    print(f"{name:<40} {res['registers']:>5} {res['stack']:>5} {res['instructions']:>6} {res['opcodes']['BAR']:>4}")
