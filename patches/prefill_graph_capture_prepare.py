"""Seam: AFTER sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture_prepare.
Written against sglang 0.5.16.

Prefill CUDA-graph capture (and its warmup) runs a dummy extend batch built as ForwardBatch(...) with
req_pool_indices = arange(bs) (slot 0 carries the tokens, the other rows are zero-length sentinels). This hook gives it
_freekv_req_slots_cpu = arange(bs) (CPU int64, mirroring req_pool_indices) and _freekv_raw_bs = 0: no row is a real
request.
"""

from __future__ import annotations

from ._common import settings_of

TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture_prepare"
HOOK_TYPE = "AFTER"
PARAMS = ("self", "num_tokens")
PURPOSE = "mark the prefill-capture ForwardBatch as all dummy (_freekv_req_slots_cpu = arange, _freekv_raw_bs = 0)"


def hook(result, self, *args, **kwargs):
    runner = getattr(self, "model_runner", None)
    if settings_of(getattr(runner, "server_args", None)) is None or not result:
        return None
    import torch

    forward_batch = result[0]
    forward_batch._freekv_req_slots_cpu = torch.arange(forward_batch.batch_size, dtype=torch.int64)
    forward_batch._freekv_raw_bs = 0
    return None
