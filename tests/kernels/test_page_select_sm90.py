"""The selection kernels compile for sm_90 (an H100) on this machine, with and without hysteresis: the interpreter
that runs the CPU tests accepts code the GPU compiler refuses (a global read inside a kernel that is not a
tl.constexpr object, once). Compiled in a child process without TRITON_INTERPRET, which turns kernels into
interpreted functions at import."""

from freekv_kernels.testing import run_without_interpreter

CHILD = r'''
from freekv_kernels.page_select import triton as page_select
from freekv_kernels.testing import compile_sm90

TYPES = {"in_ptr": "*fp32", "slots_ptr": "*i32", "req_ptr": "*i32", "heads_ptr": "*i1", "flags_ptr": "*i1",
         "recall_ptr": "*i8", "stats_ptr": "*fp64", "out_ptr": "*i64", "bonus": "fp32", "vict_ptr": "*i32",
         "age_ptr": "*i32", "vops_ptr": "*i32", "row_ptr": "*fp32"}

for hyst in (False, True):  # with hysteresis: also with the victim cache and its hit statistics
    common = {"KP": 64, "PACKED_IN": False, "WANT": 1, "NEG_INF_KEY": page_select._NEG_INF_KEY, "HYST": hyst}
    victims = {"VICTIMS": hyst, "VP": 64, "HIT_STATS": hyst, "SHIFT": 16}
    single = compile_sm90(page_select._select_slots_kernel, {**common, "CHUNK": 1024, "PHASE": 2, "RECALL_ALL": False,
                                                             "STATS": True, "SCRATCH": False, **victims}, TYPES, 8)
    staged = compile_sm90(page_select._topk_kernel, {**common, "CHUNK": 512}, TYPES, 4)
    assert ".entry _select_slots_kernel" in single and ".entry _topk_kernel" in staged
    print("compiled", hyst)
'''


def test_select_kernels_compile_for_sm90():
    assert run_without_interpreter(CHILD) == ["compiled", "False", "compiled", "True"]
