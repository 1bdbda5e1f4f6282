"""The SM probe of the green-context tests and benchmarks/side_lanes.py (freekv_kernels.testing.smid_probe: inline
PTX reading %smid) compiles for sm_90 on this machine, so a GPU run does not find a syntax error first. What it
reads is a hardware register: tests/test_green_contexts.py checks it on a GPU."""

from freekv_kernels.testing import run_without_interpreter

CHILD = r'''
from freekv_kernels.testing import _smid_kernel, compile_sm90

ptx = compile_sm90(_smid_kernel(), {}, {"out_ptr": "*i32"}, 4)
assert "%smid" in ptx and ".entry smid_kernel" in ptx, ptx[-2000:]
print("compiled")
'''


def test_smid_probe_compiles_for_sm90():
    assert run_without_interpreter(CHILD) == ["compiled"]
