"""--kv-side-sms on a GPU: the speculative lanes' streams from a green context run work forked from the compute
stream and joined back, eagerly and inside a captured CUDA graph (whose capture spans the primary context's stream
and the green context's). test_engine's oracle test and test_correct_at's graph replay test run the engine with
them."""

from __future__ import annotations

import pytest
import torch
from freekv_kernels.testing import smid_probe, sms_touched
from freekv_sglang.streams import Streams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _fork_join(st: Streams, name: str, work) -> None:
    """work() on side stream `name`, forked from the current stream and joined back, as the engine's lanes are."""
    e = st.record()
    with st.on(name):
        st.wait(e)
        work()
    st.join()


def test_green_side_streams_run_forked_work_eagerly_and_in_a_graph():
    st = Streams(torch.device("cuda"), side_sms=16)
    assert st.green is not None
    x = torch.randn(1 << 20, device="cuda")
    out = torch.full_like(x, float("nan"))
    _fork_join(st, "speculate", lambda: out.copy_(x * 2 + 1))
    torch.testing.assert_close(out, x * 2 + 1)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fork_join(st, "speculate", lambda: out.copy_(x * 2 + 1))
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2 + 1)


def test_green_side_streams_run_on_their_sms_only_eagerly_and_in_a_graph():
    """The point of --kv-side-sms: work on speculate and recall touches at most its SMs (the primary context's stream
    every SM), also where a graph captured it forked from the compute stream: a kernel node's context could be that
    of its module (the primary context) rather than the capturing stream's."""
    st = Streams(torch.device("cuda"), side_sms=16)
    assert len(sms_touched()) > 64  # 4,096 programs on the compute stream spread over the GPU
    for name in ("speculate", "recall"):
        with torch.cuda.stream(getattr(st, name)):
            assert 0 < len(sms_touched()) <= 16, name
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fork_join(st, "recall", lambda: smid_probe(out))
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    sms = set(out.tolist())
    assert -1 not in sms and len(sms) <= 16


def test_side_sms_the_gpu_cannot_split_off_is_refused():
    props = torch.cuda.get_device_properties(0)
    with pytest.raises(ValueError, match="must be below the GPU's"):
        Streams(torch.device("cuda"), side_sms=props.multi_processor_count)
    if props.major == 9:
        with pytest.raises(ValueError, match="multiple of 8"):
            Streams(torch.device("cuda"), side_sms=12)
