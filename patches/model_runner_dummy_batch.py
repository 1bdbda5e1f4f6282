"""Seam: AFTER sglang.srt.model_executor.model_runner.ModelRunner.prepare_dummy_forward_batch. Written against
sglang 0.5.16.

BaseRunner._dummy_run (FlashInfer autotune during warmup, the DeepGEMM warmup) builds a ForwardBatch(...) over
reused static buffers, passes it through ModelRunner.prepare_dummy_forward_batch, then calls
attn_backend.init_forward_metadata on it and runs the model. This hook gives it _freekv_req_slots_cpu (a CPU copy of
its req_pool_indices: warmup only, never on the serving path, so the device-to-host copy is harmless) and
_freekv_raw_bs = 0: no row is a real request.
"""

from __future__ import annotations

from ._common import batch_hooks_on

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.prepare_dummy_forward_batch"
HOOK_TYPE = "AFTER"
PARAMS = ("self", "forward_batch")
PURPOSE = "mark warmup/autotune dummy batches as all dummy (_freekv_raw_bs = 0)"


def hook(result, self, forward_batch):
    if result is None or not batch_hooks_on(getattr(self, "server_args", None)):
        return None
    import torch

    indices = getattr(result, "req_pool_indices", None)
    result._freekv_req_slots_cpu = (
        indices.to("cpu", torch.int64) if indices is not None else torch.zeros(result.batch_size, dtype=torch.int64)
    )
    result._freekv_raw_bs = 0
    return None
