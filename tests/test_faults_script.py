"""benchmarks/faults.py's own logic, without SGLang (it cannot serve on a CPU machine): the GPU calls that run it are
few, so a slip in its bookkeeping must fail here. Servers, bursts and health probes are stand-ins; the rows, the
shared embedded server and the table printing are the script's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import faults  # noqa: E402


class FakeServer:
    def __init__(self, name, log):
        self.name, self.url, self.log, self.stopped = name, f"http://{name}", log, False
        self.proc = self

    def poll(self):
        return 0 if self.stopped else None

    def stop(self):
        self.stopped = True

    def tail(self, n=40):
        return "tail"


def make_run(tmp_path, monkeypatch, reference_outcome="completed"):
    args = argparse.Namespace(out=str(tmp_path), requests=3, input_len=8, output_len=4, timeout=1.0, fault_after=0.0,
                              recovery_deadline=1.0, model_path="m", model_args="", freekv_args="", port=1,
                              deterministic=False, start_timeout=1.0)
    run = faults.Run(args)
    started = []

    def server(name, extra=None, env=None):
        run.close()  # as Run.server does
        log = tmp_path / f"{name}-{len(started)}.log"
        log.write_text(f"freekv-kvstore listening on ipc:///x (pid {100 + len(started)}, protocol 2)\n")
        srv = FakeServer(name, log)
        started.append(srv)
        return srv

    calls = {"bursts": 0}

    def burst(url, prompts, max_new, timeout, during=None):
        calls["bursts"] += 1
        if during is not None:
            during()
        outcome = reference_outcome if calls["bursts"] == 1 else "completed"
        return [{"outcome": outcome, "output_ids": [i] * max_new, "message": "" if outcome == "completed" else "x"}
                for i, _ in enumerate(prompts)]

    monkeypatch.setattr(run, "server", server)
    monkeypatch.setattr(run, "scrape", lambda srv, name: "/metrics: stub")
    monkeypatch.setattr(faults, "burst", burst)
    monkeypatch.setattr(faults, "healthy", lambda url: True)
    monkeypatch.setattr(faults, "health", lambda url: 503)
    monkeypatch.setattr(faults, "recover", lambda url, probe, since, deadline: 0.5)
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: None)
    monkeypatch.setattr(faults.time, "sleep", lambda s: None)
    return run, started, calls


def test_daemon_kill_and_stop_share_one_server_and_reference(tmp_path, monkeypatch):
    run, started, calls = make_run(tmp_path, monkeypatch)
    kill, stop = run.daemon_kill(), run.daemon_stop()
    assert len(started) == 1 and calls["bursts"] == 3  # one reference burst, one per fault
    for r, name in ((kill, "daemon-kill"), (stop, "daemon-stop")):
        assert r["scenario"] == name and r["completed"] == r["equal_outputs"] == 3 and r["server_alive"]
        assert r["recovery_s"] == 0.5 and "/health during the fault: 503" in r["note"]
    run.close()
    assert started[0].stopped and run._embedded is None


def test_a_dead_shared_server_is_started_again(tmp_path, monkeypatch):
    run, started, _ = make_run(tmp_path, monkeypatch)
    run.daemon_kill()
    started[0].stopped = True  # the scenario left it dead
    run.daemon_stop()
    assert len(started) == 2 and not started[1].stopped


def test_a_reference_run_that_loses_requests_is_refused(tmp_path, monkeypatch):
    run, started, _ = make_run(tmp_path, monkeypatch, reference_outcome="lost")
    with pytest.raises(RuntimeError, match="undisturbed run lost 3 of 3"):
        run.daemon_kill()
    assert started[0].stopped and run._embedded is None


def test_rows_print_as_a_table(capsys):
    faults.print_row({"scenario": "daemon-kill", "sent": 16, "completed": 16, "aborted": 0, "lost": 0,
                      "equal_outputs": 16, "server_alive": True, "recovery_s": 1.25, "note": "n", "messages": ["m"]})
    faults.print_row({"scenario": "malformed", "error": "RuntimeError: boom"})
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:8] == ["daemon-kill", "16", "16", "0", "0", "16", "yes", "1.2"]
    assert "message: m" in out[1] and out[2] == "malformed       did not run: RuntimeError: boom"
