import os

import torch

# Triton kernels run on CPU tensors only in interpreter mode, which must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist (scripts/test.sh runs a worker per core) each worker's torch gets its share of the cores, so the
# workers do not oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(items):
    """The longest tests (marked slow) run first: pytest-xdist hands tests out in collection order, so a long test
    collected late keeps one worker busy after the others ran out of work."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
