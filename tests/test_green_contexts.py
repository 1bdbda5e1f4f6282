"""benchmarks/green_contexts.py on a GPU (benchmarks/side_lanes.py's --sms): a green context's streams run work forked
from the current stream and joined back, eagerly and inside a captured CUDA graph (whose capture spans the primary
context's stream and the green context's), on its SMs only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from freekv_kernels.testing import smid_probe, sms_touched

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from green_contexts import green_streams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _fork_join(side: torch.cuda.Stream, work) -> None:
    """work() on `side`, forked from the current stream and joined back, as side_lanes.py's lanes are."""
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        work()
    cur.wait_stream(side)


def test_green_streams_run_forked_work_eagerly_and_in_a_graph():
    ctx, (side,) = green_streams(16, 0, 1)
    x = torch.randn(1 << 20, device="cuda")
    out = torch.full_like(x, float("nan"))
    _fork_join(side, lambda: out.copy_(x * 2 + 1))
    torch.testing.assert_close(out, x * 2 + 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fork_join(side, lambda: out.copy_(x * 2 + 1))
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2 + 1)
    del ctx


def test_green_streams_run_on_their_sms_only_eagerly_and_in_a_graph():
    """Work on the green streams touches at most their SMs (the primary context's stream every SM), also where a graph
    captured it forked from the current stream: a kernel node's context could be that of its module (the primary
    context) rather than the capturing stream's."""
    ctx, streams = green_streams(16, 0, 2)
    assert len(sms_touched()) > 64  # 4,096 programs on the current stream spread over the GPU
    for side in streams:
        with torch.cuda.stream(side):
            assert 0 < len(sms_touched()) <= 16
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fork_join(streams[1], lambda: smid_probe(out))
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    sms = set(out.tolist())
    assert -1 not in sms and len(sms) <= 16
    del ctx


def test_sms_the_gpu_cannot_split_off_are_refused():
    props = torch.cuda.get_device_properties(0)
    with pytest.raises(ValueError, match="must be below the GPU's"):
        green_streams(props.multi_processor_count, 0, 1)
    if props.major == 9:
        with pytest.raises(ValueError, match="multiple of 8"):
            green_streams(12, 0, 1)
