import os

import torch

# Triton kernels run on CPU tensors only in interpreter mode, which must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
