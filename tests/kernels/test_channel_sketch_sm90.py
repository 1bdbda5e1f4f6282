"""The channel sketch's scoring kernel compiles for sm_90 (an H100) on this machine, with a program per item and with
programs striding over the items (its pipelined block loop inside a runtime loop and a guard): the interpreter that
runs the CPU tests accepts code the GPU compiler refuses. Compiled in a child process without TRITON_INTERPRET, which
turns kernels into interpreted functions at import."""

from freekv_kernels.testing import run_without_interpreter

CHILD = r'''
from freekv_kernels.channel_sketch import triton as channel
from freekv_kernels.testing import compile_sm90

TYPES = {"q_ptr": "*bf16", "codes_ptr": "*u8", "ch_ptr": "*i32", "step_ptr": "*fp32", "pt_ptr": "*i32",
         "slots_ptr": "*i32", "cend_ptr": "*i32", "heads_ptr": "*i1", "lse_ptr": "*fp32", "scale": "fp32"}
for strided in (False, True):
    constexprs = {"G": 4, "GP": 4, "TPR": 4, "HALF": 16, "PAGE": 32, "NP": 16, "BLOCKS": channel.CHANNEL_BLOCKS,
                  "STAGES": channel.CHANNEL_STAGES, "HEADS": True, "WANT": 1, "Q_BY_SLOT": True, "BITS": 4,
                  "STRIDED": strided}
    ptx = compile_sm90(channel._channel_lse_kernel, constexprs, TYPES, channel.CHANNEL_WARPS)
    assert ".entry _channel_lse_kernel" in ptx and "mma" in ptx
    print("compiled", strided)
'''


def test_channel_lse_kernel_compiles_for_sm90():
    assert run_without_interpreter(CHILD) == ["compiled", "False", "compiled", "True"]
