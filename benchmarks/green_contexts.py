"""CUDA green contexts for benchmarks/side_lanes.py: streams whose kernels run on N of the GPU's SMs only.

Session 54 (H200, side_lanes.py): confining the speculative lanes to 16-48 SMs made them cost the model's kernels
more, not less, at every N (16 x 32K, 8 layers: +0.89 ms on every SM, +1.44 on 48, +3.42 on 16), so the served
`--kv-side-sms` that put them there was removed; this helper keeps the experiment reproducible.
"""

from __future__ import annotations

import ctypes

import torch


def green_streams(num_sms: int, device: torch.device | int, count: int) -> tuple[object, list[torch.cuda.Stream]]:
    """(a CUDA green context of num_sms SMs, `count` streams of it): kernels launched on them run on those SMs only
    (the primary context's kernels still run on every SM). Keep the context as long as the streams. A PyTorch without
    GreenContext.Stream gets driver streams created while the green context is current, which binds them there
    (set_context also switches the thread's current stream, which older pop_context does not restore: restored here)."""
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as e:
        raise RuntimeError(f"PyTorch {torch.__version__} has no CUDA green contexts (2.9 or later)") from e
    index = device if isinstance(device, int) else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    if num_sms >= props.multi_processor_count:
        raise ValueError(f"{num_sms} SMs must be below the GPU's {props.multi_processor_count}")
    if props.major == 9 and num_sms % 8:  # the driver would round it up to Hopper's SM groups of 8
        raise ValueError(f"{num_sms} SMs: Hopper splits SMs into green contexts in groups of 8; pass a multiple of 8")
    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=index)
    except (RuntimeError, TypeError) as e:  # a build or driver without them (CUDA 12.8+), or an older signature
        raise RuntimeError(f"PyTorch {torch.__version__} could not create a green context of {num_sms} SMs "
                           f"({e})") from e
    if hasattr(ctx, "Stream"):
        return ctx, [ctx.Stream() for _ in range(count)]
    handles = [ctypes.c_void_p() for _ in range(count)]
    create = ctypes.CDLL("libcuda.so.1").cuStreamCreateWithPriority
    caller = torch.cuda.current_stream(index)
    ctx.set_context()
    try:
        errors = [create(ctypes.byref(h), 1, 0) for h in handles]  # CU_STREAM_NON_BLOCKING, priority 0
    finally:
        ctx.pop_context()
        torch.cuda.set_stream(caller)
    if any(errors):
        raise RuntimeError(f"cuStreamCreateWithPriority in a green context of {num_sms} SMs failed (CUDA errors "
                           f"{errors})")
    return ctx, [torch.cuda.ExternalStream(h.value, device=index) for h in handles]
