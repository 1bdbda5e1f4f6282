"""benchmarks/host_gather.py: its byte views read a kvstore arena as freekv_kvstore.client.arena_views does, and its
gather puts each recalled (page, layer, head) chunk and its exponents in the run's rows, in order."""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from freekv_kvstore import ArenaGeometry
from freekv_kvstore.client import arena_views

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_gather  # noqa: E402


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_gather_takes_each_chunk_and_its_exponents(dtype):
    g = ArenaGeometry(3, 2, 4, 8, dtype)
    pages = 5
    raw = torch.randint(0, 120, (pages * g.page_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    values, exponents = host_gather.byte_views(raw, g, pages)
    ref_values, ref_exponents = arena_views(raw, g, pages)
    page = np.array([4, 0, 4, 2, 1])
    head = np.array([1, 0, 0, 1, 1])
    layer = 2
    with ThreadPoolExecutor(2) as pool:
        for run_on, parts in ((None, 1), (pool, 3)):  # one slice on the caller, three on the pool
            out_values = np.full((5, values.shape[-1]), 255, dtype=np.uint8)
            out_exponents = None if exponents is None else np.full((5, exponents.shape[-1]), 255, dtype=np.uint8)
            host_gather.gather(values, exponents, layer, page, head, out_values, out_exponents, run_on, parts)
            for i, (p, h) in enumerate(zip(page.tolist(), head.tolist())):
                want = ref_values[p, layer, h].contiguous().view(torch.uint8).flatten().numpy()
                assert np.array_equal(out_values[i], want), (parts, i)
                if exponents is not None:
                    want = ref_exponents[p, layer, h].contiguous().view(torch.uint8).flatten().numpy()
                    assert np.array_equal(out_exponents[i], want), (parts, i)
    assert (exponents is None) == (not g.scaled)
