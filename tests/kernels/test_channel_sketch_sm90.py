"""The channel sketch's scoring kernel compiles for sm_90 (an H100) on this machine, with a program per item and with
programs striding over the items (its pipelined block loop inside a runtime loop and a guard): the interpreter that
runs the CPU tests accepts code the GPU compiler refuses. Compiled in a child process without TRITON_INTERPRET, which
turns kernels into interpreted functions at import."""

import os
import subprocess
import sys

CHILD = r'''
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freekv_kernels.channel_sketch import triton as channel

TYPES = {"q_ptr": "*bf16", "codes_ptr": "*u8", "ch_ptr": "*i32", "step_ptr": "*fp32", "pt_ptr": "*i32",
         "slots_ptr": "*i32", "cend_ptr": "*i32", "heads_ptr": "*i1", "lse_ptr": "*fp32", "scale": "fp32"}
kernel = channel._channel_lse_kernel
for strided in (False, True):
    constexprs = {"G": 4, "GP": 4, "TPR": 4, "HALF": 16, "PAGE": 32, "NP": 16, "BLOCKS": channel.CHANNEL_BLOCKS,
                  "STAGES": channel.CHANNEL_STAGES, "HEADS": True, "WANT": 1, "Q_BY_SLOT": True, "BITS": 4,
                  "STRIDED": strided}
    params = inspect.signature(kernel.fn).parameters
    signature = {p: "constexpr" if p in constexprs else TYPES.get(p, "i32") for p in params}
    ptx = triton.compile(ASTSource(kernel, signature, constexprs, {}), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": channel.CHANNEL_WARPS}).asm["ptx"]
    assert ".entry _channel_lse_kernel" in ptx and "mma" in ptx
    print("compiled", strided)
'''


def test_channel_lse_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["compiled", "False", "compiled", "True"]
