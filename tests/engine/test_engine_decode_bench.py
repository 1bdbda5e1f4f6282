"""benchmarks/engine_decode.py in its tiny CPU configuration (torch ops, eager steps): every policy gives a row, and
the query-similarity knob drives the retrieval rate both ways (fresh queries every step: every check retrieves;
identical queries: nothing retrieves or recalls once the slots are full)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import engine_decode  # noqa: E402

TINY = ["--device", "cpu", "--contexts", "1024", "--batches", "1", "--steps", "3", "--warmup", "3", "--layers", "2",
        "--budget", "256", "--sink", "64", "--window", "128", "--page-size", "16"]


def run(tmp_path, *extra):
    out = tmp_path / "ed.json"
    assert engine_decode.main([*TINY, "--out", str(out), *extra]) == 0
    return {r["policy"]: r for r in json.loads(out.read_text())["rows"] if r["similarity"] == float(extra[1])}


def test_similarity_drives_retrievals(tmp_path, capsys):
    fresh = run(tmp_path, "--similarity", "0", "--shift", "0", "--policies", "freekv-means,louiskv")
    same = run(tmp_path, "--similarity", "1", "--shift", "0", "--policies", "freekv,louiskv")
    table = capsys.readouterr().out
    assert "| 1024 | 1 | louiskv |" in table and "no model GEMMs" in table
    for r in fresh.values():
        assert r["retrieval_share"] == 1.0 and r["recall_mb_per_step"] > 0 and r["step_ms"] > 0
        assert r["steps"] == 3 and r["sparse_layers"] == 1 and r["graph"] is False
    for r in fresh.values():  # every head selects and recalls before attention: nothing is left for after it
        assert r["recall_mb_per_step_now"] > 0 and r["recall_mb_per_step_after"] == 0
    for r in same.values():
        assert r["retrieval_share"] == 0.0 and r["recall_mb_per_step_now"] == 0
    assert same["louiskv"]["recall_mb_per_step"] == 0
