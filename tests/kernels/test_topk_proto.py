"""benchmarks/topk_proto.py: each top-k prototype equals torch.topk on packed keys with ties and -inf (the
interpreter on a CPU, the kernels on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from freekv_kernels.testing import device

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import topk_proto  # noqa: E402


def test_topk_prototypes_equal_torch_topk():
    topk_proto.check(device())
