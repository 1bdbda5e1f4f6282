"""Static SASS of _select_chain_kernel for sm_90 on a CPU machine (session 45), 1,024 lanes, k 64, 64 victim entries, a
group of 4, 8 warps: instructions, barriers, shared-memory and shuffle ops a thread with its stages removed one by one.

    python3 docs/results/session45/select_chain_sass.py
"""
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
         "vops_ptr": "*i32", "row_ptr": "*fp32"}
C = {"KP": 64, "CHUNK": 1024, "PACKED_IN": False, "PHASE": 1, "WANT": 1, "RECALL_ALL": False, "STATS": True,
     "NEG_INF_KEY": page_select._NEG_INF_KEY, "HYST": True, "VICTIMS": True, "VP": 64, "HIT_STATS": True,
     "SHIFT": 16, "SCRATCH": True, "POOL": True, "G": 4, "GP": 4, "POOL_BLOCK": 1024, "REPLAY": True, "R_KP": 64,
     "R_BLOCK": 1024, "PROMOTED": 1.0e4, "TIE": 1.0 / 1024}
params = list(inspect.signature(sc._select_chain_kernel.fn).parameters)
variants = [("served", {}), ("no replay", {"REPLAY": False}),
            ("no replay, victims", {"REPLAY": False, "VICTIMS": False, "HIT_STATS": False}),
            ("no replay, victims, pool", {"REPLAY": False, "VICTIMS": False, "HIT_STATS": False, "POOL": False}),
            ("top-k + commit only", {"REPLAY": False, "VICTIMS": False, "HIT_STATS": False, "POOL": False,
                                     "HYST": False, "STATS": False})]
with tempfile.TemporaryDirectory() as tmp:
    for name, over in variants:
        cx = {**C, **over}
        launch = dict(module=sc.__name__, name="_select_chain_kernel", constexprs=cx, options={"num_warps": 8},
                      signature={p: "constexpr" if p in cx else TYPES.get(p, "i32") for p in params},
                      divisible=[i for i, p in enumerate(params) if p.endswith("_ptr")])
        res = compile_sass(launch, Path(tmp))
        counts = " ".join(f"{op} {res['opcodes'][op]:4d}" for op in ("BAR", "LDS", "STS", "SHFL", "LDG"))
        print(f"{name:28s} instr {res['instructions']:5d} {counts} REG:{res['registers']}")
