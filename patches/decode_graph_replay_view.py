"""Seam: AFTER sglang.srt.model_executor.runner.decode_cuda_graph_runner.build_replay_fb_view. Written against
sglang 0.5.16.

Before each decode graph replay, DecodeCudaGraphRunner.load_batch pads the batch to a captured size bs (padded rows:
req_pool_indices 0 = ReqToTokenPool's padding row, seq_lens = the backend's fill value, out_cache_loc 0) and calls
attn_backend.init_forward_metadata_out_graph(view) with view = build_replay_fb_view(...), a SimpleNamespace of fixed
fields that does not keep unknown attributes. This hook adds to the view:
  view._freekv_req_slots_cpu: CPU int64 [bs], the live batch's slots in rows [0, raw_bs), 0 in the padded rows;
  view._freekv_raw_bs: raw_bs, the number of real rows (SGLang's own view.num_padding == bs - raw_bs).
Only when the live ForwardBatch carries the attributes (FreeKV on); otherwise nothing changes.
"""

from __future__ import annotations

TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.build_replay_fb_view"
HOOK_TYPE = "AFTER"
PARAMS = ("forward_batch", "buffers", "bs", "raw_bs", "num_tokens", "seq_len_fill_value", "capture_forward_mode",
          "is_encoder_decoder")
PURPOSE = "give the replay view padded CPU slots and the real batch size (_freekv_req_slots_cpu, _freekv_raw_bs)"


def hook(result, forward_batch, buffers, bs, raw_bs, *args, **kwargs):
    if result is None or "_freekv_req_slots_cpu" not in getattr(forward_batch, "__dict__", {}):
        return None
    slots = forward_batch._freekv_req_slots_cpu
    if slots is not None:
        import torch

        padded = torch.zeros(bs, dtype=torch.int64)
        padded[:raw_bs].copy_(slots[:raw_bs])
        slots = padded
    result._freekv_req_slots_cpu = slots
    result._freekv_raw_bs = raw_bs
    return None
