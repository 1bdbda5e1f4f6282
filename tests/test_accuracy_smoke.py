"""The accuracy harness end to end on the real SmolLM2-135M (CPU): `--smoke` mode, task generators,
scorers and the report. The smoke run is 4 passkey prompts of ~1K tokens with every method."""

from __future__ import annotations

import contextlib
import json
import random
import re
import time

import pytest
import torch

from freekv_sglang.accuracy import report, tasks
from freekv_sglang.accuracy.__main__ import main
from freekv_sglang.accuracy.methods import Geometry, parse_methods


@pytest.fixture(scope="module")
def smollm2():
    from freekv_sglang.hf_models import load_smollm2

    return load_smollm2(dtype=torch.float32)


@pytest.mark.slow
def test_smoke_mode_end_to_end(tmp_path, capsys):
    t0 = time.perf_counter()
    # tau 1 (every head reselected every step) makes the harness's correction rate exactly 1. Pure speculation
    # (tau 0) is checked against the engine's oracle in test_engine.py (test_replayed_correction_rate_overrides_tau);
    # here it would double the run.
    assert main(["--smoke", "--taus", "1", "--out", str(tmp_path)]) == 0
    dt = time.perf_counter() - t0
    print(capsys.readouterr().out)
    print(f"smoke run: {dt:.1f} s")
    summary = json.loads((tmp_path / "summary.json").read_text())
    cells = {(s["method"], s["budget"]): s for s in summary["scores"]}
    methods = parse_methods("oracle,channels,sketch,rerank,means,quest,streaming", [1])
    expected = {("dense", None)} | {(m.name, 256) for m in methods}
    assert set(cells) == expected  # every method produced a scored row
    assert all(c["samples"] == 2 and c["task"] == "passkey" and c["length"] == 1024 for c in cells.values())
    assert cells[("dense", None)]["score"] >= 0.9
    stats = {s["method"]: s for s in summary["engine_stats"]}
    for name in ("channels", "sketch", "rerank"):
        assert stats[f"{name}(tau=1)"]["mean_correction_rate"] == pytest.approx(1)
    assert all(0 < c <= 1 for c in stats["means(tau=1)"]["mean_cosine"])  # measured whether or not it flags
    # The oracle selects by the very mass the diagnostics measure: it always holds the top page and covers the
    # most mass; every selecting method is diagnosed, streaming is not.
    diag = {d["method"]: d for d in summary["selection"]}
    assert set(diag) == {m for m, _ in expected} - {"dense", "streaming"}
    assert diag["oracle"]["hit_rate"] == 1.0 and diag["oracle"]["cases"] > 500
    assert all(d["mass_covered"] <= diag["oracle"]["mass_covered"] + 1e-9 for d in diag.values())
    assert diag["quest"]["hit_rate"] < 1.0
    table = (tmp_path / "table.md").read_text()
    assert "### Score (exact match; 95% Wilson interval)" in table and "hit / mass" in table
    # A rerun resumes: nothing left to run, the same records.
    n = len((tmp_path / "records.jsonl").read_text().splitlines())
    assert main(["--smoke", "--taus", "1", "--out", str(tmp_path)]) == 0
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == n



@pytest.mark.slow
def test_smoke_with_fp8_host_pages(tmp_path, capsys):
    """--kv-host-dtype fp8_e4m3 reaches every engine of the run through its shared FP8 host arena: the selecting
    methods run and are diagnosed (the oracle's exact keys read back from the FP8 arena still hold its top page)."""
    assert main(["--smoke", "--taus", "1", "--methods", "oracle,channels", "--kv-host-dtype", "fp8_e4m3",
                 "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {s["method"] for s in summary["scores"]} == {"oracle", "channels(tau=1)"}
    diag = {d["method"]: d for d in summary["selection"]}
    assert diag["oracle"]["hit_rate"] == 1.0 and diag["channels(tau=1)"]["cases"] > 500
    assert json.loads((tmp_path / "summary.json").read_text())["meta"]["args"]["kv_host_dtype"] == "fp8_e4m3"

@pytest.mark.parametrize("task", ["passkey", "multikey"])
def test_dense_method_equals_hf_generate(smollm2, task):
    """The dense baseline (every layer dense in the adapter) is the model's own greedy decoding."""
    from freekv_sglang.hf_adapter import FreeKVModel

    model, tok = smollm2
    s = tasks.make_sample(tok, task, 512, 0)
    cfg = parse_methods("dense", [])[0].config(0, Geometry(), model.config.num_hidden_layers)
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=512)
    out = fm.generate([fm.prefill(list(s.ids))], 12, eos_token_id=tok.eos_token_id)[0]
    ids = torch.tensor([s.ids])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert out == ref[0, len(s.ids):].tolist()


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
@pytest.mark.parametrize("length", [1024, 4096, 8192])
def test_generators_hit_the_length_and_are_seeded(smollm2, task, length):
    _, tok = smollm2
    a = tasks.make_sample(tok, task, length, 3, seed=1)
    assert a == tasks.make_sample(tok, task, length, 3, seed=1)
    assert a.ids != tasks.make_sample(tok, task, length, 3, seed=2).ids
    room = length - a.max_new_tokens
    assert room * 0.97 <= len(a.ids) <= room
    assert list(a.ids) == tok(a.text, add_special_tokens=False)["input_ids"]
    for ans in a.answers:
        assert ans in a.text.split("<|im_start|>assistant")[0]  # the answer is in the context, not the prefix
    assert a.score(" " + ", ".join(a.answers) + ".") == 1.0


def test_needle_depth_varies_across_samples(smollm2):
    _, tok = smollm2
    depths = [tasks.make_sample(tok, "passkey", 1024, i).depth for i in range(10)]
    assert sorted(int(d * 10) for d in depths) == list(range(10))  # one per tenth of the context


def test_scorers():
    assert tasks.score_first_number(("12345",), " 12345. Remember") == 1
    assert tasks.score_first_number(("12345",), " 123456") == 0  # exact, not a substring
    assert tasks.score_first_number(("12345",), " 54321 or 12345") == 0
    assert tasks.score_all_numbers(("1", "22", "333", "4444"), "22, 1 and 4444") == 0.75
    assert tasks.score_all_words(("ABCDE", "FGHIJ"), " ABCDE, FGHIJK") == 0.5


def test_codechain_prompt_and_scorer(smollm2):
    """codechain: each link of the chain is a needle of the context, the word's code is the first answer, and the
    score is the share of the chain the output follows from its start (each step's key is the model's own output)."""
    _, tok = smollm2
    s = tasks.make_sample(tok, "codechain", 2048, 1)
    context, prefix = s.text.split("<|im_start|>assistant")
    word = re.search(r"The code for (\w+) is$", s.text).group(1)
    assert f"The code for {word} is {s.answers[0]}." in context and len(s.answers) == 5
    for a, b in zip(s.answers, s.answers[1:]):
        assert f"The code for {a} is {b}." in context
    assert not any(a in prefix for a in s.answers)
    right = f" {s.answers[0]}." + "".join(f" The code for {a} is {b}." for a, b in zip(s.answers, s.answers[1:]))
    assert s.score(right) == 1.0
    assert s.score(right.replace(s.answers[2], "99999")) == 0.4  # the chain breaks at the third number
    assert s.score(" " + s.answers[1] + right) == 0.0  # a wrong first lookup earns nothing after it
    assert s.score(" " + ", ".join(reversed(s.answers))) == 0.0
    assert tasks.score_chain(("1", "2", "3"), " 1. The code for 1 is 2. The code for 2 is 4.") == pytest.approx(2 / 3)


def test_noise_is_seeded():
    a = [tasks.noise_sentence(random.Random("x")) for _ in range(3)]
    assert a == [tasks.noise_sentence(random.Random("x")) for _ in range(3)]


def test_report_without_matplotlib_says_so(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    recs = [dict(kind="sample", task="passkey", length=1024, index=0, method="dense", budget=None, score=1.0)]
    msg = report.plot(report.summarize(recs), tmp_path / "p.png")
    assert "matplotlib is not installed" in msg and not (tmp_path / "p.png").exists()


def test_bad_arguments_are_refused(capsys):
    assert main(["--tasks", "nope"]) == 2
    assert main(["--budgets", "100", "--page-size", "16"]) == 2  # not whole pages
    assert "error:" in capsys.readouterr().err


@contextlib.contextmanager
def stand_in_generate(answer):
    """A stdlib HTTP server on a free port that answers each POST with the JSON of answer(path, body); yields its
    URL. It stands in for an SGLang server's /generate."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(answer(self.path, body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()


def test_sglang_backend_posts_token_ids_and_scores(smollm2, tmp_path):
    """The server target against a stand-in /generate that reads the pass key out of the token ids it receives."""
    _, tok = smollm2
    seen = []

    def answer(path, body):
        seen.append((path, body))
        keys = [re.search(r"pass key number is (\d+)", tok.decode(ids)).group(1) for ids in body["input_ids"]]
        return [{"text": f" {k}.", "meta_info": {}} for k in keys]

    with stand_in_generate(answer) as url:
        assert main(["--backend", "sglang", "--url", url, "--tasks", "passkey", "--lengths", "1024", "--samples", "3",
                     "--batch", "2", "--server-method", "sglang-freekv", "--server-budget", "256",
                     "--out", str(tmp_path)]) == 0
    assert [p for p, _ in seen] == ["/generate", "/generate"]
    assert all(sp["temperature"] == 0 for _, b in seen for sp in b["sampling_params"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["method"], s["budget"], s["score"], s["samples"]) for s in summary["scores"]] == \
        [("sglang-freekv", 256, 1.0, 3)]


def test_sglang_backend_refuses_answers_clipped_at_the_context_length(smollm2, tmp_path):
    """SGLang cuts max_new_tokens to its context length less two tokens: a prompt that fills the model's window
    gets a short answer that would score as wrong. The harness stops with the flag to change instead."""
    ctx = {}  # the stand-in server's context length, by prompt length

    def answer(path, body):
        out = []
        for ids, sp in zip(body["input_ids"], body["sampling_params"]):
            n = min(sp["max_new_tokens"], ctx[len(ids)] - 2 - len(ids))  # SGLang's scheduler rule
            out.append({"text": " 1" * n, "meta_info": {"completion_tokens": n,
                                                        "finish_reason": {"type": "length", "length": n}}})
        return out

    n = len(tasks.make_samples(smollm2[1], "passkey", 1024, 1)[0].ids)
    with stand_in_generate(answer) as url:
        args = ["--backend", "sglang", "--url", url, "--tasks", "passkey", "--lengths", "1024", "--samples", "1",
                "--out"]
        ctx[n] = n + 7 + 1  # one token short
        with pytest.raises(RuntimeError, match=rf"after 6 of 7 new tokens.*--context-length {n + 9}\b"):
            main(args + [str(tmp_path / "short")])
        ctx[n] = n + 7 + 2
        assert main(args + [str(tmp_path / "room")]) == 0


def test_sglang_backend_unreachable_server_is_a_clear_error(smollm2, tmp_path):
    with pytest.raises(RuntimeError, match="cannot reach an SGLang server"):
        main(["--backend", "sglang", "--url", "http://127.0.0.1:9", "--tasks", "passkey", "--lengths", "1024",
              "--samples", "1", "--out", str(tmp_path)])


def test_report_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [dict(kind="sample", task="passkey", length=1024, index=0, method=m, budget=b, score=s)
            for m, b, s in [("dense", None, 1.0), ("quest", 256, 0.5), ("quest", 512, 1.0)]]
    assert report.plot(report.summarize(recs), tmp_path / "p.png").startswith("plot:")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
