"""Static footprint of the side lanes' kernels for sm_90 on a CPU machine (session 54), specialised as served at
16 x 32K (Llama shape): per CTA the warps, registers a thread, spills, shared memory, and what of an SM (65,536
registers, 228 KB of shared memory) it holds, at the served warps and thinner. benchmarks/side_lanes.py --warps times
the same launches beside the model's kernels on a GPU.

    python3 docs/results/session54/side_sass.py"""
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from sass import compile_sass  # noqa: E402

from freekv_kernels.channel_sketch import triton as cs  # noqa: E402
from freekv_kernels.page_select import triton as page_select  # noqa: E402
from freekv_kernels.recall import triton as recall  # noqa: E402
from freekv_kernels.select_chain import triton as sc  # noqa: E402


def launch(module, name, types, cx, ones, div16, warps):
    params = list(inspect.signature(getattr(module, name).fn).parameters)
    cx = {**cx, **ones}
    return dict(module=module.__name__, name=name, constexprs=cx, options={"num_warps": warps},
                signature={p: "constexpr" if p in cx else types.get(p, "i32") for p in params},
                divisible=[i for i, p in enumerate(params) if p.endswith("_ptr") or p in div16])


SCORE = (cs, "_channel_lse_kernel",
         {"q_ptr": "*bf16", "codes_ptr": "*u8", "ch_ptr": "*i32", "step_ptr": "*fp32", "pt_ptr": "*i32",
          "slots_ptr": "*i32", "cend_ptr": "*i32", "heads_ptr": "*i1", "lse_ptr": "*fp32", "scale": "fp32"},
         dict(G=4, GP=4, TPR=4, HALF=16, PAGE=32, NP=16, BLOCKS=2, STAGES=2, HEADS=True, WANT=0, Q_BY_SLOT=True,
              BITS=4, STRIDED=False),
         dict(sq_d=1, spt_m=1, s_slot=1, s_cend=1, sh_h=1),
         {"sq_b", "sq_h", "sc_p", "sc_h", "sch_h", "sstep_h", "sl_b", "sl_h"})
CHAIN = (sc, "_select_chain_kernel",
         {"lse_ptr": "*fp32", "cend_ptr": "*i32", "draws_ptr": "*fp32", "rate_k": "fp32", "returns": "fp32",
          "in_ptr": "*fp32", "slots_ptr": "*i32", "req_ptr": "*i32", "heads_ptr": "*i1", "flags_ptr": "*i1",
          "recall_ptr": "*i8", "stats_ptr": "*fp64", "bonus": "fp32", "vict_ptr": "*i32", "age_ptr": "*i32",
          "vops_ptr": "*i32", "row_ptr": "*fp32", "keep_ptr": "*u8"},
         {"KP": 64, "CHUNK": 1024, "PACKED_IN": False, "PHASE": 2, "WANT": 0, "RECALL_ALL": False, "STATS": True,
          "NEG_INF_KEY": page_select._NEG_INF_KEY, "HYST": True, "VICTIMS": True, "VP": 64, "HIT_STATS": True,
          "SHIFT": 16, "SCRATCH": True, "POOL": True, "G": 4, "GP": 4, "POOL_BLOCK": 1024, "REPLAY": True,
          "R_KP": 64, "R_BLOCK": 1024, "PROMOTED": 1.0e4, "TIE": 1.0 / 1024, "KEEP": True},
         {}, set())
RECALL = (recall, "_recall_pages_kernel",
          {"host_ptr": "*fp8e4nv", "exp_ptr": "*i8", "k_ptr": "*bf16", "v_ptr": "*bf16", "pt_ptr": "*i32",
           "slots_ptr": "*i32", "req_ptr": "*i32", "spages_ptr": "*i32", "recall_ptr": "*i8", "vops_ptr": "*i32"},
          dict(PHASE=2, PAGE=32, D=128, SB=64, VICTIMS=True, SHIFT=16, SCALED=True),
          dict(s_et=1, spt_m=1, st_k=1, s_req=1, sg_k=1, sr_k=1, so_k=1),
          {"K", "s_hp", "s_hh", "s_hkv", "s_ht", "s_ep", "s_eh", "s_ekv", "s_kt", "s_kh", "s_vt", "s_vh", "st_r",
           "st_h", "sg_b", "sr_b", "sr_h", "so_b", "so_h"})

print(f"{'kernel':<22} {'warps':>5} {'regs':>5} {'stack':>5} {'smem KB':>7} {'SASS':>6} {'K regs a CTA':>12} "
      f"{'CTAs an SM':>10}")
with tempfile.TemporaryDirectory() as tmp:
    for (module, name, types, cx, ones, div16), served, warps_list in ((SCORE, cs.CHANNEL_WARPS, (2, 4, 8)),
                                                                       (CHAIN, page_select.TOPK_SINGLE_WARPS,
                                                                        (2, 4, 8)),
                                                                       (RECALL, recall.RECALL_WARPS, (2, 4))):
        for warps in warps_list:
            try:
                r = compile_sass(launch(module, name, types, cx, ones, div16, warps), Path(tmp))
            except Exception as e:  # noqa: BLE001 (a constexpr set that no longer matches the kernel)
                print(f"{name:<22} {warps:>5} failed: {str(e).splitlines()[0][:80]}")
                continue
            regs = r["registers"] * 32 * warps
            fit = min(65536 // regs, (228 * 1024) // max(r["shared"] + 1024, 1), 64 // warps)
            mark = " (served)" if warps == served else ""
            print(f"{name:<22} {warps:>5} {r['registers']:>5} {r['stack']:>5} {r['shared'] / 1024:>7.1f} "
                  f"{r['instructions']:>6} {regs / 1024:>12.1f} {fit:>10}{mark}")
