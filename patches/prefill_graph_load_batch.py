"""Seam: AFTER sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.load_batch.
Written against sglang 0.5.16.

The prefill CUDA graph (breakable by default on CUDA, tc_piecewise elsewhere) runs extend batches on a new
static_forward_batch = ForwardBatch(...) it builds from the live one; the attention backend's forward_extend then
sees that object. This hook carries _freekv_req_slots_cpu / _freekv_raw_bs over (rows are not padded there; the
full-graph backend's padded planning view is a copy.copy of the live batch, which keeps them).
"""

from __future__ import annotations

from ._common import copy_batch_attrs

TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.load_batch"
HOOK_TYPE = "AFTER"
PARAMS = ("self", "forward_batch", "kwargs")
PURPOSE = "carry the FreeKV batch attributes onto the prefill graph's static ForwardBatch"


def hook(result, self, forward_batch, *args, **kwargs):
    copy_batch_attrs(forward_batch, result)
    return None
