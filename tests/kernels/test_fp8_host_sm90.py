"""The kernels that read or write FP8 arena layers compile for sm_90 (an H100) with SCALED set, on this machine: the
interpreter that runs the CPU tests accepts code the GPU compiler refuses (a jitted helper reading a plain global did).
Compiled in a child process without TRITON_INTERPRET, which turns kernels into interpreted functions at import."""

from freekv_kernels.testing import run_without_interpreter

CHILD = r'''
from freekv_kernels.offload import triton as offload
from freekv_kernels.page_copy import triton as page_copy
from freekv_kernels.recall import triton as recall
from freekv_kernels.testing import compile_sm90

FP8 = {"host_ptr": "*fp8e4nv", "exp_ptr": "*i8"}
ptx = compile_sm90(offload._offload_pages_kernel,
                   {"H": 8, "PAGE": 32, "D": 128, "CODES": False, "LEVELS": 4, "BITS": 2, "PER_BYTE": 4,
                    "CHANNELS": True, "HALF": 16, "CH_LEVELS": 16, "CH_BITS": 4, "SCALED": True},
                   {**FP8, "k_ptr": "*bf16", "v_ptr": "*bf16", "summ_ptr": "*bf16", "codes_ptr": "*u8",
                    "ch_ptr": "*i32", "lo_ptr": "*fp32", "inv_ptr": "*fp32", "src_ptr": "*i32", "dst_ptr": "*i32",
                    "valid_ptr": "*i1"}, 4)
print("offload", "e4m3x2.f32" in ptx)
ptx = compile_sm90(recall._recall_pages_kernel,
                   {"PHASE": 1, "PAGE": 32, "D": 128, "SB": 1, "VICTIMS": True, "SHIFT": 16, "SCALED": True},
                   {**FP8, "k_ptr": "*bf16", "v_ptr": "*bf16", "pt_ptr": "*i32", "slots_ptr": "*i32",
                    "req_ptr": "*i32", "spages_ptr": "*i32", "recall_ptr": "*i8", "vops_ptr": "*i32"}, 4)
print("recall", "cvt.rn.f16x2.e4m3x2" in ptx or "e4m3x2" in ptx)
for to_host in (True, False):
    ptx = compile_sm90(page_copy._page_copy_kernel, {"TO_HOST": to_host, "PAGE": 16, "BLOCK_D": 128, "SCALED": True},
                       {**FP8, "pages_ptr": "*i32", "k_ptr": "*bf16", "v_ptr": "*bf16", "rows_ptr": "*i64"}, 4)
    print("page_copy", "e4m3x2" in ptx)
'''


def test_fp8_arena_kernels_compile_for_sm90():
    assert run_without_interpreter(CHILD) == ["offload", "True", "recall", "True", "page_copy", "True", "page_copy",
                                              "True"]
