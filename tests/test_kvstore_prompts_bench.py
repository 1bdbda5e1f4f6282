"""benchmarks/kvstore_prompts.py runs against a real daemon and reports every call it times."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kvstore_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_the_prompts_calls_are_timed_and_their_keys_retained():
    res = kvstore_prompts.run(prompts=3, pages=20, seed=0)
    assert res["retained_keys_at_end"] == 3 * 20  # a key a page of every prompt
    counts = {name: m["n"] for name, m in res["calls"].items()}
    assert counts == {"lookup": 3, "alloc": 3, "alloc_sink": 3, "retain_chain": 3, "free": 2}
    assert all(0 < m["p50_ms"] <= m["max_ms"] for m in res["calls"].values())
