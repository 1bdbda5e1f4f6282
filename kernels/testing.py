"""Test helpers for the kernels: device choice, NaN poisoning, one comparison function, compiling for sm_90 without
a GPU."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import subprocess
import sys

import torch

from . import _alloc


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def poisoned_outputs():
    """Every output a kernel wrapper allocates starts as NaN (ints: a large negative sentinel)."""
    old, _alloc.POISON = _alloc.POISON, True
    try:
        yield
    finally:
        _alloc.POISON = old


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Exact shape/dtype, no NaN anywhere in `out`, and elementwise closeness to `ref`."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    if out.is_floating_point():
        assert not torch.isnan(out).any(), f"{name}: {int(torch.isnan(out).sum())} NaN elements (unwritten output?)"
        torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    else:
        mism = (out.cpu() != ref.cpu()).sum().item()
        assert mism == 0, f"{name}: {mism} of {ref.numel()} elements differ"


def compile_sm90(kernel, constexprs: dict, types: dict, num_warps: int) -> str:
    """PTX of a Triton kernel for sm_90 (an H100), compiled on this machine with no GPU; a parameter named in neither
    constexprs nor types is an i32. The interpreter that runs the CPU tests accepts code the GPU compiler refuses, so
    the tests compile each kernel too, in a process without TRITON_INTERPRET (run_without_interpreter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(kernel.fn).parameters
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    src = ASTSource(kernel, signature, constexprs, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def run_without_interpreter(code: str) -> list[str]:
    """The words `code` prints, run in a child Python without TRITON_INTERPRET (which turns kernels into interpreted
    functions at import); fails with the child's stderr if it does."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def compiled_variants() -> dict[str, set[str]]:
    """Per Triton kernel of these ops (module.name), the keys of the variants this process compiled (each names the
    arguments' specialisation), every device."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    variants = {}
    pkg = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.ispkg:
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}.triton")
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction):  # device_caches: device -> (kernel cache, ...)
                variants[f"{info.name}.{name}"] = {str(key) for entry in fn.device_caches.values() for key in entry[0]}
    return variants


@functools.cache
def _smid_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def smid_kernel(out_ptr):
        zero = tl.zeros([1], tl.int32)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0) + tl.arange(0, 1), sm)

    return smid_kernel


def smid_probe(out: torch.Tensor) -> None:
    """Launch out.numel() programs on the current stream (a graph may capture it), each writing into out the SM it ran
    on, read from %smid: a hardware register, so there is no reference to test against. A green context's stream must
    touch at most its SMs, another stream every SM. GPU only."""
    assert out.is_cuda and out.dtype == torch.int32 and out.is_contiguous()
    _smid_kernel()[(out.numel(),)](out)


def sms_touched(programs: int = 4096) -> set[int]:
    """The SMs that smid_probe's `programs` programs on the current stream ran on (synchronises that stream)."""
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    smid_probe(out)
    torch.cuda.current_stream().synchronize()
    return set(out.tolist())
