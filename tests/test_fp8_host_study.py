"""benchmarks/fp8_host_study.py: the emulated FP8 host pages round what the engine's host writes wrote, per
(page, KV head, K or V) block, and nothing else."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp8_host_study as study  # noqa: E402


def test_scaled_rounding_keeps_each_block_within_e4m3s_relative_step():
    torch.manual_seed(0)
    blocks = torch.randn(5, 3, 2, 16, 64) * torch.logspace(-4, 2, 5).view(5, 1, 1, 1, 1)  # 1e-4 .. 1e2 blocks
    out = study.round_blocks(blocks, scaled=True)
    amax = blocks.abs().amax(dim=(-2, -1), keepdim=True)
    # e4m3 keeps 3 mantissa bits: within 1/16 of a value, or of the block's scale below its normal range (2^-6).
    err = (out - blocks).abs()
    assert bool((err <= blocks.abs() / 16 + amax / 448 * 2.0 ** -6).all())
    assert out.abs().amax(dim=(-2, -1), keepdim=True).allclose(amax)  # each block's maximum is exact
    assert not torch.equal(out, blocks)


def test_unscaled_rounding_flushes_and_saturates_what_e4m3_cannot_hold():
    x = torch.tensor([[[1e-4, 0.3, 500.0]]])
    out = study.round_blocks(x, scaled=False)
    assert out[0, 0, 0] == 0 and abs(float(out[0, 0, 1]) - 0.3) <= 0.3 / 16
    assert out[0, 0, 2] == 448  # saturated, as the GPU's conversion does


def test_the_wrapped_ops_round_only_the_pages_they_wrote():
    host = torch.randn(6, 2, 2, 4, 8)
    calls = []

    def offload_pages(k, v, host_layer, summaries, src, dst, valid, page_size, programs=0):
        calls.append((src, page_size, programs))
        host_layer[dst.long()] = torch.full_like(host_layer[dst.long()], 0.1234567)

    def pages_to_host(k, v, rows, host_layer, host_pages):
        host_layer[host_pages.long()] = torch.full_like(host_layer[host_pages.long()], -3.3333333)

    ops = study.fp8_ops(SimpleNamespace(offload_pages=offload_pages, pages_to_host=pages_to_host), scaled=False)
    before = host.clone()
    ops.offload_pages(None, None, host, None, torch.tensor([7]), torch.tensor([1, 4]), torch.tensor([True, False]),
                      4, programs=3)
    assert calls == [(torch.tensor([7]), 4, 3)]
    assert torch.equal(host[1], study.round_blocks(torch.full_like(host[1], 0.1234567), scaled=False))
    assert float(host[4, 0, 0, 0, 0]) == pytest.approx(0.1234567)  # written, but not valid: not a host page now
    assert torch.equal(host[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    ops.pages_to_host(None, None, None, host, torch.tensor([5]))
    assert float(host[5, 1, 1, 3, 7]) == float(torch.tensor(-3.3333333).to(torch.float8_e4m3fn).float())


def _run(path: Path, method: str, outputs: dict) -> Path:
    path.mkdir()
    rows = [{"kind": "sample", "task": t, "length": 4096, "index": i, "method": method, "budget": 512,
             "output": out, "score": float(out == "ok")} for (t, i), out in outputs.items()]
    rows.append({"kind": "stats", "task": "passkey"})
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_counts_scores_and_same_outputs_per_task(tmp_path):
    a = _run(tmp_path / "a", "channels", {("passkey", 0): "ok", ("passkey", 1): "ok", ("multikey", 0): "x"})
    b = _run(tmp_path / "b", "dense", {("passkey", 0): "ok", ("passkey", 1): "no", ("multikey", 0): "y"})
    rows = {r["task"]: r for r in study.compare(a, b)}
    assert rows["passkey"] == {"task": "passkey", "length": 4096, "base": "channels/512", "other": "dense/512",
                               "n": 2, "score_base": 2.0, "score_other": 1.0, "same_output": 1}
    assert rows["multikey"]["same_output"] == 0 and rows["multikey"]["n"] == 1
    c = _run(tmp_path / "c", "channels", {("passkey", 0): "ok"})
    with pytest.raises(ValueError, match="different prompts"):
        study.compare(a, c)
