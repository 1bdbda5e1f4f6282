"""CUDA-event timing shared by the kernel benchmarks (kernels.py, split_attention.py): medians of eager calls and of
CUDA-graph replays. Named apart from PyPI's `kernels`, an SGLang dependency that `import kernels` would find."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[int], object], repeats: int, warmup: int, hide_launch: bool = False) -> float:
    """Median of `repeats` CUDA-event timings of fn(i) (i: the iteration, to vary inputs), after `warmup` calls.

    hide_launch: the GPU spins (~100 us) while the host launches fn, so the start event fires just before fn's
    kernels run: GPU time without the host's launch latency."""
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_launch:
            torch.cuda._sleep(200_000)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay_ms(run: Callable[[], object], repeats: int) -> float:
    """Capture one call of `run` in a CUDA graph (after three warm-up calls on a side stream) and time its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return time_ms(lambda i: graph.replay(), repeats, warmup=3)
