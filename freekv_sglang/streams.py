"""Side streams and the events that order them against the compute stream.

On CPU everything runs in program order and these helpers do nothing.
"""

from __future__ import annotations

import contextlib

import torch


class Streams:
    """compute: the caller's stream. select: selection and correction recall (on the critical path of
    flagged heads). recall: speculative recall, summaries and offload (off the critical path)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.select = torch.cuda.Stream(device)
            self.recall = torch.cuda.Stream(device)

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

    def join(self) -> None:
        """The compute stream waits for every side stream: once per step, which orders a step's recall,
        offload and summaries before the next step's KV writes, and ends a CUDA graph capture joined."""
        if self.cuda:
            cur = torch.cuda.current_stream()
            cur.wait_stream(self.select)
            cur.wait_stream(self.recall)

    def on(self, name: str):
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(getattr(self, name))
