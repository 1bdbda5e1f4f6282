"""FreeKV's abort path on the scheduler side: a request whose host pages the kvstore cannot give ends through SGLang's
own abort machinery, the server goes on.

- A decode request is taken out of the batch before it runs, as ScheduleBatch.retract_decode aborts the last request
  it cannot fit: to_finish = FINISH_ABORT, release_req (its GPU slots; is_retracted, so an overlapped result of its
  previous step is not streamed), filter_batch, and an AbortReq carrying the finish reason to the tokenizer.
- A new request in the waiting queue while no kvstore can give pages is popped and answered the same way, as
  Scheduler.abort_request does for queued requests.

With --kv-prefill tsp, a waiting request whose answer needs the hidden states of every prompt token (input-token
logprobs, or the prompt's hidden states) while its prompt is longer than --kv-tsp-keep is answered at once with
FINISH_ABORT(message, 400): the tokens that do not propagate have no hidden state after the TSP layer.

The finish reason is FINISH_ABORT(message, 503): a non-streaming /generate answers HTTP 503 with the message, a
stream ends with finish_reason {"type": "abort", "message": ..., "status_code": 503}. Every tensor-parallel rank must
take the same requests out, so the ranks' findings are merged over the TP CPU group first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

logger = logging.getLogger("freekv_patches")

MESSAGE_PREFIX = "FreeKV: "


def _backends() -> list:
    from freekv_sglang.sglang_backend import _ACTIVE

    return list(_ACTIVE)


def merge_ranks(per_rank: list[Mapping[Any, tuple[str, str]]]) -> dict[Any, tuple[str, str]]:
    """The union of every rank's {key: (reason, message)}; for a key several ranks name, the lowest rank's."""
    merged: dict[Any, tuple[str, str]] = {}
    for found in per_rank:
        for k, v in found.items():
            merged.setdefault(k, v)
    return merged


def agree(scheduler: Any, found: dict[Any, tuple[str, str]]) -> dict[Any, tuple[str, str]]:
    """found merged over the scheduler's TP ranks (each rank calls this at the same point of the same step)."""
    tp_size = getattr(scheduler, "tp_size", 1) or 1
    if tp_size == 1:
        return found
    import torch.distributed as dist

    gathered: list = [None] * tp_size
    dist.all_gather_object(gathered, found, group=scheduler.tp_cpu_group)
    return merge_ranks(gathered)


def finish_reason(reason: str, message: str, status: HTTPStatus = HTTPStatus.SERVICE_UNAVAILABLE):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(MESSAGE_PREFIX + message, status)


def _tell_tokenizer(scheduler: Any, req: Any) -> None:
    from sglang.srt.managers.io_struct import AbortReq

    finished = req.to_finish or req.finished_reason
    scheduler.ipc_channels.send_to_tokenizer.send_output(AbortReq(finished_reason=finished.to_json(), rid=req.rid),
                                                         req)


def _count(reasons: list[str]) -> None:
    from freekv_sglang.metrics import count_aborted_requests

    for reason in set(reasons):
        count_aborted_requests(reason, reasons.count(reason))


def abort_lost_decode_requests(scheduler: Any, batch: Any) -> int:
    """Before SGLang prepares a decode batch: reserve each request's host pages for the step; abort, and take out of
    the batch, every request that cannot get them. Returns how many were aborted."""
    slot_of = {i: req.req_pool_idx for i, req in enumerate(batch.reqs)
               if not req.finished() and req.req_pool_idx is not None}
    found: dict[int, tuple[str, str]] = {}
    slots = list(slot_of.values())
    for backend in _backends():
        lost = backend.reserve_decode(slots)
        for i, slot in slot_of.items():
            if slot in lost and i not in found:
                found[i] = (lost[slot].reason, str(lost[slot]))
    found = agree(scheduler, found)
    if not found:
        return 0
    keep = [i for i in range(len(batch.reqs)) if i not in found]
    for i in sorted(found):
        req = batch.reqs[i]
        req.to_finish = finish_reason(*found[i])
        batch.release_req(i, len(keep), scheduler.server_args)
        _tell_tokenizer(scheduler, req)
    batch.filter_batch(keep_indices=keep)
    batch.batch_is_full = False
    _count([reason for reason, _ in found.values()])
    logger.warning("FreeKV: aborted %d decoding request(s): %s", len(found),
                   "; ".join(sorted({message for _, message in found.values()})))
    return len(found)


def reject_waiting_requests(scheduler: Any) -> int:
    """While no kvstore can give host pages, answer every request in the waiting queue with the abort. Returns how
    many were rejected."""
    found: dict[str, tuple[str, str]] = {}
    for backend in _backends():
        problem = backend.kvstore_problem()
        if problem is not None:
            found["kvstore"] = (problem.reason, str(problem))
            break
    found = agree(scheduler, found)
    if not found:
        return 0
    reason, message = found["kvstore"]
    queue = scheduler.waiting_queue
    rejected = list(queue)
    queue.clear()
    for req in rejected:
        req.finished_reason = finish_reason(reason, message)
        _tell_tokenizer(scheduler, req)
    _count([reason] * len(rejected))
    logger.warning("FreeKV: rejected %d new request(s): %s", len(rejected), message)
    return len(rejected)


def tsp_refusal(req: Any, keep: int) -> str | None:
    """Why --kv-prefill tsp cannot answer this waiting request (None: it can). SGLang has set logprob_start_len by
    now: below the prompt's length it asks for input-token logprobs."""
    n = len(req.origin_input_ids)
    if n <= keep:
        return None  # propagates whole
    wants = []
    if getattr(req, "return_logprob", False) and 0 <= req.logprob_start_len < n:
        wants.append(f"input-token logprobs (logprob_start_len {req.logprob_start_len})")
    if getattr(req, "return_hidden_states", False):
        wants.append("the prompt's hidden states (return_hidden_states)")
    if not wants:
        return None
    return (f"--kv-prefill tsp propagates {keep} of this prompt's {n} tokens past the TSP layer, so it cannot return "
            f"{' or '.join(wants)}; ask without them or use a server without --kv-prefill tsp")


def reject_tsp_unservable(scheduler: Any, keep: int) -> int:
    """With --kv-prefill tsp, answer each waiting request tsp_refusal names with an abort (400). Returns how many."""
    queue = scheduler.waiting_queue
    refused = [(req, why) for req in queue if (why := tsp_refusal(req, keep)) is not None]
    if not refused:
        return 0
    gone = {id(req) for req, _ in refused}
    queue[:] = [req for req in queue if id(req) not in gone]
    for req, why in refused:
        req.finished_reason = finish_reason("tsp_unservable", why, HTTPStatus.BAD_REQUEST)
        _tell_tokenizer(scheduler, req)
    _count(["tsp_unservable"] * len(refused))
    logger.warning("FreeKV: refused %d request(s) --kv-prefill tsp cannot answer: %s", len(refused), refused[0][1])
    return len(refused)
