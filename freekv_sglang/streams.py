"""Side streams, the events that order them against the compute stream, and the step timer.

On CPU everything runs in program order and these helpers do nothing.
"""

from __future__ import annotations

import contextlib

import torch

# CUDA stream priority (lower is higher) of the critical chain: the decode graph's capture stream
# (freekv_patches.graph_capture_stream) and the select stream. PyTorch instantiates graphs with per-node priorities,
# so the block scheduler dispatches the critical chain's waiting CTAs before those of the speculative lanes (priority
# 0). Priorities do not preempt resident CTAs (session 30: no gain when the scoring started right after attention);
# with --kv-speculate-at next_recall the scoring is released at the next layer's commit, and its ~4,000 programs
# were dispatched ahead of that layer's recall and token lists (session 42: the chain 88 -> 124 us at 16 x 32K; at
# -1, session 43: 93 us, the median step -3.1%).
CRITICAL_PRIORITY = -1
# The correction one layer early (--kv-correct-at previous_mlp(_only)) runs beside the previous layer's MLP, which
# is on the critical stream: at the same priority its first kernels were dispatched only behind gate-up's CTAs, and
# the lane took 230 us against the MLP's ~110 (session 51's trace), so attention waited for its recall. One level
# above, its few small kernels take SMs as the MLP's CTAs retire. PyTorch has priorities 0 to -3.
EARLY_PRIORITY = CRITICAL_PRIORITY - 1


def critical_stream(device: torch.device | int) -> torch.cuda.Stream:
    """A stream whose kernels the GPU schedules ahead of the speculative lanes'."""
    return torch.cuda.Stream(device, priority=CRITICAL_PRIORITY)


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, queued without waiting: torch.tensor(values, device=...) copies and then
    waits for the stream, i.e. for every kernel queued before it (in a server, the forward in flight)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class Streams:
    """compute: the caller's stream. select: selection and correction recall (on the critical path of
    flagged heads), and the last sparse layer's speculative selection. early: the correction one layer early
    (engine.anticipate), beside the previous layer's MLP. speculate: the other layers' speculative selection.
    recall: speculative recall, summaries and offload (off the critical path). The speculative selection has its own
    stream so that layer l+1's runs while layer l's recall holds the link: on one stream the link idled during every
    layer's selection."""

    NAMES = ("select", "early", "speculate", "recall")
    PRIORITIES = {"select": CRITICAL_PRIORITY, "early": EARLY_PRIORITY}  # the others at the default, 0

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._used: set[str] = set()  # the side streams given work since the last join
        if self.cuda:
            for name in self.NAMES:  # select and early carry the correction chains, which attention waits for
                setattr(self, name, torch.cuda.Stream(device, priority=self.PRIORITIES.get(name, 0)))

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
        """The compute stream waits for the side streams given work since the last join: once per step, which
        orders a step's recall, offload and summaries before the next step's KV writes, and ends a CUDA graph capture
        joined. Waiting on a stream that the capture never forked (e.g. speculate under a policy that selects nothing
        after attention) would invalidate the capture."""
        if self.cuda:
            cur = torch.cuda.current_stream()
            for name in self.NAMES:
                if name in self._used:
                    cur.wait_stream(getattr(self, name))
            self._used.clear()

    def on(self, name: str):
        if not self.cuda:
            return contextlib.nullcontext()
        self._used.add(name)
        return torch.cuda.stream(getattr(self, name))


class StepTimer:
    """Times sparse layers' selection and recall in both phases of a decode step with timing events recorded on the
    stream that runs them. They are external events, so a CUDA graph capture turns them into event record nodes that
    every replay records again (an ordinary event would become a cross-stream dependency instead); read() gives the
    last step's totals. Each timed layer costs 4 event nodes per phase (~2 us each on an H200: timing all 31 sparse
    layers of a Llama-3.1-8B step with 3 nodes each added 0.43 ms to a 4.5 ms engine step), so a server times a few
    layers spread over the depth and scales their sum to every sparse layer."""

    MARKS = 4  # before scoring, after the slot commit, before and after the recall (after attention, on another stream)

    def __init__(self, sparse_layers: list[int], sample: int | None = None):
        n = len(sparse_layers)
        if sample is not None and 0 < sample < n:  # evenly spread: the layers' correction rates differ with depth
            sparse_layers = [sparse_layers[int((i + 0.5) * n / sample)] for i in range(sample)]
        self.layers = set(sparse_layers)
        self.scale = n / max(len(self.layers), 1)
        self._events: dict[tuple[int, int], list[torch.cuda.Event]] = {}

    def mark(self, layer: int, phase: int, i: int) -> None:
        if layer not in self.layers:
            return
        evs = self._events.get((layer, phase))
        if evs is None:
            evs = self._events[(layer, phase)] = [torch.cuda.Event(enable_timing=True, external=True)
                                                  for _ in range(self.MARKS)]
        evs[i].record()

    def read(self) -> dict[int, tuple[float, float]] | None:
        """{phase: (selection seconds, recall seconds)} of the last step that ran (eager or replayed), summed over the
        timed layers and scaled to all sparse layers; None before any. Synchronises the device."""
        if not self._events:
            return None
        torch.cuda.synchronize()
        out: dict[int, tuple[float, float]] = {}
        for (_, phase), (start, selected, recalling, recalled) in self._events.items():
            sel, rec = out.get(phase, (0.0, 0.0))
            out[phase] = (sel + start.elapsed_time(selected) / 1e3, rec + recalling.elapsed_time(recalled) / 1e3)
        return {phase: (sel * self.scale, rec * self.scale) for phase, (sel, rec) in out.items()}
