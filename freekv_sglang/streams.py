"""Side streams and the events that order them against the compute stream.

On CPU everything runs in program order and these helpers do nothing.
"""

from __future__ import annotations

import contextlib

import torch


class Streams:
    """compute: the caller's stream. select: selection and correction recall (on the critical path of
    flagged heads). recall: speculative recall, summaries and offload (off the critical path)."""

    def __init__(self, device: torch.device, num_layers: int):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.select = torch.cuda.Stream(device)
            self.recall = torch.cuda.Stream(device)
            # done[l]: the side-stream work of layer l in the latest step; the next step's KV write
            # into layer l (which may reuse a ring page being offloaded) and its recalls wait on it.
            self.done = [torch.cuda.Event() for _ in range(num_layers)]
            self._done_recorded = [False] * num_layers

    def record(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def wait(self, *events: torch.cuda.Event | None) -> None:
        """The current stream waits for the given events."""
        for ev in events:
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)

    def wait_done(self, layer: int) -> None:
        if self.cuda and self._done_recorded[layer]:
            torch.cuda.current_stream().wait_event(self.done[layer])

    def record_done(self, layer: int) -> None:
        if self.cuda:
            self.done[layer].record()
            self._done_recorded[layer] = True

    def join(self) -> None:
        """The compute stream waits for every side stream (needed before a CUDA graph capture ends)."""
        if self.cuda:
            cur = torch.cuda.current_stream()
            cur.wait_stream(self.select)
            cur.wait_stream(self.recall)

    def on(self, name: str):
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(getattr(self, name))

    def hand_over(self, name: str, *tensors: torch.Tensor) -> None:
        """Tensors made on one stream and used on another must not be reused by the allocator early."""
        if self.cuda:
            s = getattr(self, name)
            for t in tensors:
                t.record_stream(s)
