"""Seam: AFTER sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_prepare.
Written against sglang 0.5.16.

Decode CUDA-graph capture builds a dummy ForwardBatch over the static buffers (every req_pool_indices row is 0,
ReqToTokenPool's padding row) and passes it to init_forward_metadata_out_graph(fb, in_capture=True). This hook gives
it _freekv_req_slots_cpu = zeros(bs) (CPU int64) and _freekv_raw_bs = 0: every row is padding.
"""

from __future__ import annotations

from ._common import batch_hooks_on

TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_prepare"
HOOK_TYPE = "AFTER"
PARAMS = ("self", "size", "stream_idx", "num_tokens")
PURPOSE = "give the capture ForwardBatch all-padding slots (_freekv_req_slots_cpu = zeros, _freekv_raw_bs = 0)"


def hook(result, self, *args, **kwargs):
    runner = getattr(self, "model_runner", None)
    if not batch_hooks_on(getattr(runner, "server_args", None)) or not result:
        return None
    import torch

    forward_batch = result[0]
    forward_batch._freekv_req_slots_cpu = torch.zeros(forward_batch.batch_size, dtype=torch.int64)
    forward_batch._freekv_raw_bs = 0
    return None
