"""--kv-side-sms on a GPU: the speculative lanes' streams from a green context run work forked from the compute
stream and joined back, eagerly and inside a captured CUDA graph (whose capture spans the primary context's stream
and the green context's). test_engine's oracle test and test_correct_at's graph replay test run the engine with
them."""

from __future__ import annotations

import pytest
import torch
from freekv_sglang.streams import Streams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _fork_join(st: Streams, x: torch.Tensor, out: torch.Tensor) -> None:
    e = st.record()
    with st.on("speculate"):
        st.wait(e)
        out.copy_(x * 2 + 1)
    st.join()


def test_green_side_streams_run_forked_work_eagerly_and_in_a_graph():
    st = Streams(torch.device("cuda"), side_sms=16)
    assert st.green is not None
    x = torch.randn(1 << 20, device="cuda")
    out = torch.full_like(x, float("nan"))
    _fork_join(st, x, out)
    torch.testing.assert_close(out, x * 2 + 1)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fork_join(st, x, out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2 + 1)


def test_side_sms_the_gpu_cannot_split_off_is_refused():
    props = torch.cuda.get_device_properties(0)
    with pytest.raises(ValueError, match="must be below the GPU's"):
        Streams(torch.device("cuda"), side_sms=props.multi_processor_count)
    if props.major == 9:
        with pytest.raises(ValueError, match="multiple of 8"):
            Streams(torch.device("cuda"), side_sms=12)

