"""Static SASS of _channel_lse_kernel for sm_90 on a CPU machine (session 45), specialised as a served launch at
16 x 32K specialises it (pointers and strides divisible by 16, strides equal to 1 as constants; page 32, 32
channels, two blocks of 16 pages, 4 warps): instructions a thread by opcode.

    python3 docs/results/session45/lse_sass.py GROUP [OLD_KERNEL_MODULE.py]

With a second argument, that file (a copy of kernels/channel_sketch/triton.py from another commit, e.g. `git show
d825e69:kernels/channel_sketch/triton.py > /tmp/old.py`) is compiled instead of the installed one."""
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from sass import compile_sass  # noqa: E402

path = sys.argv[2] if len(sys.argv) > 2 else None
module = "freekv_kernels.channel_sketch._alt" if path else "freekv_kernels.channel_sketch.triton"
if path:  # a copy of the kernel module (e.g. the old one) loaded in the package
    spec = importlib.util.spec_from_file_location(module, path)
    cs = importlib.util.module_from_spec(spec)
    sys.modules[module] = cs
    spec.loader.exec_module(cs)
else:
    from freekv_kernels.channel_sketch import triton as cs
TYPES = {"q_ptr": "*bf16", "codes_ptr": "*u8", "ch_ptr": "*i32", "step_ptr": "*fp32", "pt_ptr": "*i32",
         "slots_ptr": "*i32", "cend_ptr": "*i32", "heads_ptr": "*i1", "lse_ptr": "*fp32", "scale": "fp32"}
G = int(sys.argv[1])
gp = 1 << (G - 1).bit_length()
C = dict(G=G, GP=gp, TPR=max(1, 16 // gp), HALF=16, PAGE=32, NP=16, BLOCKS=2, STAGES=2, HEADS=True, WANT=1,
         Q_BY_SLOT=True, BITS=4, STRIDED=False)
ONES = dict(sq_d=1, spt_m=1, s_slot=1, s_cend=1, sh_h=1)  # Triton specialises ints equal to 1
DIV16 = {"sq_b", "sq_h", "sc_p", "sc_h", "sch_h", "sstep_h", "sl_b", "sl_h"}
params = list(inspect.signature(cs._channel_lse_kernel.fn).parameters)
cx = {**C, **ONES}
launch = dict(module=module, name="_channel_lse_kernel", constexprs=cx, options={"num_warps": 4},
              signature={p: "constexpr" if p in cx else TYPES.get(p, "i32") for p in params},
              divisible=[i for i, p in enumerate(params) if p.endswith("_ptr") or p in DIV16])
with tempfile.TemporaryDirectory() as tmp:
    res = compile_sass(launch, Path(tmp))
Path("/tmp/lse.sass").write_text(res["sass"])
print("G", G, "old" if path else "new", f"REG:{res['registers']}", "instr", res["instructions"],
      res["opcodes"].most_common(14))
