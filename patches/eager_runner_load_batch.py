"""Seam: AFTER sglang.srt.model_executor.runner.eager_runner.EagerRunner.load_batch. Written against sglang 0.5.16.

Without a CUDA graph (extend batches past the prefill graph, decode batches past the captured sizes, or graphs
off), EagerRunner.load_batch replaces the ForwardBatch by a copy over its static buffers
(CudaGraphBufferRegistry.extract_buffer -> dataclasses.replace, or dataclasses.replace alone under
SGLANG_EAGER_INPUT_NO_COPY). dataclasses.replace keeps only dataclass fields, so this hook carries
_freekv_req_slots_cpu and _freekv_raw_bs over to the batch the model (and the attention backend) then sees.
"""

from __future__ import annotations

from ._common import copy_batch_attrs

TARGET = "sglang.srt.model_executor.runner.eager_runner.EagerRunner.load_batch"
HOOK_TYPE = "AFTER"
PARAMS = ("self", "forward_batch", "pp_proxy_tensors", "kwargs")
PURPOSE = "carry the FreeKV batch attributes onto the eager runner's dataclasses.replace copy"


def hook(result, self, forward_batch, *args, **kwargs):
    copy_batch_attrs(forward_batch, result)
    return None
