"""benchmarks/fp8_host_study.py: the harness run with both host dtypes into their own directories (nothing else of
the harness's arguments changed), and the comparison of two runs."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp8_host_study as study  # noqa: E402


def _run(path: Path, method: str, outputs: dict) -> Path:
    path.mkdir(parents=True)
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


def test_the_study_runs_the_harness_once_per_host_dtype(tmp_path, monkeypatch, capsys):
    runs = []

    def harness(argv):
        out = Path(argv[argv.index("--out") + 1])
        runs.append(argv)
        _run(out, "channels", {("passkey", 0): "ok", ("passkey", 1): "ok" if "auto" in out.name else "no"})
        return 0

    monkeypatch.setattr(study, "accuracy_main", harness)
    assert study.main(["--out", str(tmp_path / "s"), "--", "--tasks", "passkey", "--samples", "2"]) == 0
    assert runs == [["--tasks", "passkey", "--samples", "2", "--out", str(tmp_path / "s" / d), "--kv-host-dtype", d]
                    for d in ("auto", "fp8_e4m3")]
    assert "passkey      4096   2   2.0   1.0 1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path / "t"), "--", "--kv-host-dtype", "auto"])
