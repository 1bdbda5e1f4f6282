"""Seam: BEFORE sglang.srt.distributed.parallel_state.graph_capture. Written against sglang 0.5.16.

SGLang captures its CUDA graphs on a stream graph_capture() creates when the caller passes none, at the default
priority. PyTorch instantiates graphs with per-node priorities (each kernel node keeps its capture stream's), so on a
FreeKV server this hook hands graph_capture a stream of freekv_sglang.streams.CRITICAL_PRIORITY: the model's kernels
and the correction chain then take the SMs ahead of the speculative selection and recall, which run beside them at
priority 0. The registry's patch reaches every runner that imported graph_capture (decode and prefill graphs).
"""

from __future__ import annotations

from ._common import settings_of

TARGET = "sglang.srt.distributed.parallel_state.graph_capture"
HOOK_TYPE = "BEFORE"
PARAMS = ("stream",)
PURPOSE = "capture CUDA graphs on a high-priority stream, ahead of FreeKV's speculative lanes"


def hook(stream=None):
    if stream is not None or settings_of(_process_server_args()) is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from freekv_sglang.streams import critical_stream

    return (), {"stream": critical_stream(torch.cuda.current_device())}


def _process_server_args():
    """The scheduler process's ServerArgs (published before its ModelRunner captures), or None before any."""
    from sglang.srt.runtime_context import get_context

    try:
        return get_context().server_args
    except ValueError:  # "Global server args is not set yet!"
        return None
