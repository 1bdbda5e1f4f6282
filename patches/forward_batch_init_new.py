"""Seam: AFTER sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new (classmethod). Written against
sglang 0.5.16.

In 0.5.16 there is no ModelWorkerBatch: TpModelWorker builds each ForwardBatch straight from the ScheduleBatch with
ForwardBatch.init_new(batch, model_runner, ...), on the normal and the overlap-scheduler path alike (run_batch calls
forward_batch_generation(batch) synchronously on the forward stream). ScheduleBatch keeps req_pool_indices_cpu, a
CPU int64 mirror of req_pool_indices kept in step by prepare_for_extend, filter_batch and merge_batch. This hook
puts it on the ForwardBatch, so the attention backend reads request slots without a device-to-host copy:
  forward_batch._freekv_req_slots_cpu: CPU int64 tensor [batch_size], same order as req_pool_indices
      (None when the ScheduleBatch had no usable mirror: the backend must refuse);
  forward_batch._freekv_raw_bs: the number of real rows (= batch_size here: no padding);
  forward_batch._freekv_prefill_done_cpu: for an extend batch, per row, whether this chunk completes the
      request's prefill (its extend range reaches the end of its fill ids), else None;
  forward_batch._freekv_prefix_pins: for an extend batch with the radix cache on, per row, the shared prefix the
      radix match pinned for the request (freekv_sglang.radix.PrefixPin, taken off the request), else None.
The tensor is borrowed from the ScheduleBatch, not copied (SGLang replaces it, never writes it in place).
"""

from __future__ import annotations

from ._common import batch_hooks_on

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
HOOK_TYPE = "AFTER"
PARAMS = ("cls", "batch", "model_runner", "capture_hidden_mode", "return_hidden_states_before_norm")
PURPOSE = ("put the batch's CPU request slots and prefill completion on the ForwardBatch (_freekv_req_slots_cpu, "
           "_freekv_raw_bs, _freekv_prefill_done_cpu)")


def hook(result, cls, batch, model_runner, *args, **kwargs):
    if result is None or not batch_hooks_on(getattr(model_runner, "server_args", None)):
        return None
    slots = getattr(batch, "req_pool_indices_cpu", None)
    bs = result.batch_size
    if slots is not None and (getattr(slots, "device", None) is None or slots.device.type != "cpu"
                              or tuple(slots.shape) != (bs,)):
        slots = None  # stale or not a CPU mirror: leave None so the backend refuses loudly
    result._freekv_req_slots_cpu = slots
    result._freekv_raw_bs = bs
    done = None
    if result.forward_mode.is_extend():
        reqs = getattr(batch, "reqs", None) or []
        done = [r.extend_range is not None and r.extend_range.end >= len(r.full_untruncated_fill_ids) for r in reqs]
        if len(done) != bs:
            done = None  # the backend refuses an extend batch without it
    result._freekv_prefill_done_cpu = done
    result._freekv_prefix_pins = None
    if result.forward_mode.is_extend():
        from freekv_sglang.radix import active_sharing

        sharing = active_sharing()
        if sharing is not None:
            result._freekv_prefix_pins = sharing.take_pins(getattr(batch, "reqs", None) or [])
    return None
