"""Faults against a FreeKV SGLang server on one GPU (issue 19): what survives, what ends with a message, what is lost.

    python3 benchmarks/faults.py --model-path /tmp/smollm2 --out results/faults \
        [--scenarios daemon-kill,daemon-stop,daemon-gone,daemon-lost,server-restart,arena-full,malformed]

Each scenario starts its own server(s) (triton attention, page 16, FreeKV budget 1024 unless --freekv-args says
otherwise) and prints one row: requests sent, completed (every token), aborted with a message (finish_reason
abort and a text), lost (an error without such a message, or no answer), how many completed outputs equal an
undisturbed run of the same prompts, whether the server answers /health afterwards, and the recovery seconds
(from the fault to the first new request that completes). Rows go to a table on stdout and to faults.json.

  daemon-kill     `--requests` requests decoding, kill -9 of the embedded kvstore daemon after `--fault-after` s
                  (daemon-kill and daemon-stop share one server and its undisturbed run)
                  (its supervisor restarts it; every request should complete)
  daemon-stop     the same with SIGSTOP of the daemon for 10 s, then SIGCONT (past the 5 s deadline of a kvstore call:
                  the requests that need a new host page meanwhile end with the abort, the others complete)
  daemon-gone     an external daemon, kill -9 while requests decode, down for --down-s s, then restarted on its
                  endpoint (it re-adopts the store): requests that needed host pages meanwhile end with an abort (HTTP
                  503 and a message naming the daemon), the others complete, new ones are refused, /health answers 503
                  during the outage; recovery is timed from the restart
  daemon-lost     the same, but the store is removed before the restart (the arena is lost): every request holding
                  host pages ends with the abort; the server opens a new session on the new daemon
  server-restart  an external daemon; kill -9 of the server while requests decode, then a new server on the same
                  daemon (the dead one's pages must be freed by session liveness: used pages before and after)
  arena-full      an arena of --small-arena-gb and a burst of long prompts
  malformed       negative max_new_tokens, a prompt longer than the context, a bogus FREEKV_ARGS at launch

Greedy outputs compare equal only when the server's inference is deterministic for a batch (--deterministic adds
SGLang's --enable-deterministic-inference).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess

DAEMON_LINE = re.compile(r"freekv-kvstore listening on (\S+) \(pid (\d+)")
SHM_DIR = "/dev/shm"


def generate(url: str, ids: list[int], max_new: int, timeout: float) -> dict:
    """One greedy /generate: {"outcome": completed | aborted | lost, "output_ids", "message"}."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:  # a refusal with a message counts as an answer
        text = e.read().decode(errors="replace")[:300]
        return {"outcome": "aborted" if text.strip() else "lost", "output_ids": [], "message": f"HTTP {e.code}: {text}"}
    except Exception as e:
        return {"outcome": "lost", "output_ids": [], "message": f"{type(e).__name__}: {e}"}
    finish = (out.get("meta_info") or {}).get("finish_reason") or {}
    ids_out = out.get("output_ids") or []
    if finish.get("type") == "abort":
        msg = str(finish.get("message") or "")
        return {"outcome": "aborted" if msg else "lost", "output_ids": ids_out, "message": msg}
    if len(ids_out) == max_new:
        return {"outcome": "completed", "output_ids": ids_out, "message": ""}
    return {"outcome": "lost", "output_ids": ids_out, "message": f"{len(ids_out)} of {max_new} tokens, {finish}"}


def burst(url: str, prompts: list[list[int]], max_new: int, timeout: float, during=None) -> list[dict]:
    """All prompts at once; `during` (if any) runs in this thread while they decode."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(generate, url, p, max_new, timeout) for p in prompts]
        if during is not None:
            during()
        return [f.result() for f in futs]


def health(url: str) -> int | None:
    """The HTTP status of GET /health, or None without an answer."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None


def healthy(url: str) -> bool:
    return health(url) == 200


def recover(url: str, probe: list[int], since: float, deadline_s: float) -> float | None:
    """Seconds from `since` until a short request completes, or None by the deadline."""
    while time.time() - since < deadline_s:
        if generate(url, probe, 4, 30)["outcome"] == "completed":
            return time.time() - since
        time.sleep(0.5)
    return None


def daemon_pid(srv: ServerProcess) -> int:
    """The embedded daemon's pid from the server log (the newest, after a supervised restart)."""
    found = DAEMON_LINE.findall(srv.log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"[{srv.name}] no kvstore daemon line in the log; tail:\n{srv.tail()}")
    return int(found[-1][1])


def row(name: str, results: list[dict], reference: list[dict] | None, alive: bool, recovery: float | None,
        note: str = "") -> dict:
    count = {k: sum(r["outcome"] == k for r in results) for k in ("completed", "aborted", "lost")}
    equal = None
    if reference is not None:
        equal = sum(r["outcome"] == "completed" and r["output_ids"] == ref["output_ids"]
                    for r, ref in zip(results, reference))
    messages = sorted({r["message"][:160] for r in results if r["outcome"] != "completed" and r["message"]})
    return {"scenario": name, "sent": len(results), **count, "equal_outputs": equal, "server_alive": alive,
            "recovery_s": recovery, "note": note, "messages": messages[:5]}


class Run:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        self.prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.requests)]
        self.probe = [rng.randrange(100, 30000) for _ in range(32)]
        self._embedded: tuple[ServerProcess, list[dict]] | None = None  # embedded_server()

    def server(self, name: str, extra: list[str] | None = None, env: dict | None = None) -> ServerProcess:
        a = self.args
        self.close()  # one server on the port at a time: the shared embedded one goes first
        flags = ["--model-path", a.model_path, *a.model_args.split(), "--attention-backend", "triton",
                 "--sampling-backend", "pytorch",
                 "--grammar-backend", "none", "--disable-radix-cache", "--page-size", "16",
                 "--mem-fraction-static", "0.3", "--max-running-requests", str(max(16, a.requests)),
                 "--kv-retrieval", "freekv", *a.freekv_args.split(), *(extra or [])]
        if a.deterministic:  # with the backend's own decode kernel, the only batch-invariant attention
            flags += ["--enable-deterministic-inference", "--kv-attention", "backend"]
        srv = ServerProcess(name, a.port, flags, self.out / f"server-{name}.log", env=env)
        srv.wait(a.start_timeout)
        return srv

    def start_daemon(self, endpoint: str, name: str) -> subprocess.Popen:
        """An external kvstore daemon in its own session (a server's kill does not reach it), once it listens."""
        ready = self.out / f"{name}.ready"
        ready.unlink(missing_ok=True)
        with open(self.out / f"{name}.log", "w") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "freekv_kvstore", "--endpoint", endpoint, "--arena-gb",
                                       str(self.args.arena_gb), "--ready-file", str(ready)], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while not (ready.exists() and ready.read_text().strip()):
            if daemon.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"kvstore daemon {name} did not start: {(self.out / f'{name}.log').read_text()}")
            time.sleep(0.1)
        return daemon

    def scrape(self, srv: ServerProcess, name: str) -> str:
        """SGLang's /metrics after the scenario (saved under --out): how many FreeKV series, and the daemon restarts."""
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        (self.out / f"metrics-{name}.txt").write_text(text)
        series = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("sglang:freekv_")}
        restarts = [line for line in text.splitlines() if line.startswith("sglang:freekv_kvstore_restarts_total")]
        return f"/metrics: {len(series)} FreeKV series, {restarts[0] if restarts else 'no restarts series'}"

    def embedded_server(self) -> tuple[ServerProcess, list[dict]]:
        """The server with an embedded daemon and its undisturbed run, shared by daemon-kill and daemon-stop (one start
        and one reference run less); started again when the last scenario left it dead."""
        a = self.args
        if self._embedded is not None and (self._embedded[0].proc.poll() is not None or not healthy(self._embedded[0].url)):
            self.close()
        if self._embedded is None:
            srv = self.server("embedded", ["--enable-metrics"])
            reference = burst(srv.url, self.prompts, a.output_len, a.timeout)
            failed = [r for r in reference if r["outcome"] != "completed"]
            if failed:  # no fault yet: the server itself does not serve these prompts
                srv.stop()
                raise RuntimeError(f"the undisturbed run lost {len(failed)} of {len(reference)} requests "
                                   f"({failed[0]['message'][:120]}); server log tail:\n{srv.tail(12)}")
            self._embedded = (srv, reference)
        return self._embedded

    def close(self) -> None:
        if self._embedded is not None:
            self._embedded[0].stop()
            self._embedded = None

    def signal_daemon_mid_decode(self, name: str, fault) -> dict:
        a = self.args
        srv, reference = self.embedded_server()
        pid = daemon_pid(srv)
        t_fault = {}

        def inject():
            time.sleep(a.fault_after)
            t_fault["t"] = time.time()
            fault(pid, lambda: t_fault.setdefault("health", health(srv.url)))

        results = burst(srv.url, self.prompts, a.output_len, a.timeout, during=inject)
        rec = recover(srv.url, self.probe, t_fault["t"], a.recovery_deadline)
        return row(name, results, reference, healthy(srv.url) and srv.proc.poll() is None, rec,
                   f"daemon pid {pid} -> {daemon_pid(srv)}; /health during the fault: {t_fault.get('health')}; "
                   f"{self.scrape(srv, name)}")

    def daemon_kill(self) -> dict:
        def kill(pid, check_health):
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            check_health()
        return self.signal_daemon_mid_decode("daemon-kill", kill)

    def daemon_stop(self) -> dict:
        def stop_then_continue(pid, check_health):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(7)  # past the 5 s deadline of the kvstore calls
            check_health()
            time.sleep(3)
            os.kill(pid, signal.SIGCONT)
        return self.signal_daemon_mid_decode("daemon-stop", stop_then_continue)

    def daemon_outage(self, name: str, lose_store: bool) -> dict:
        """kill -9 of an external daemon while requests decode, --down-s s without one, then a daemon on the same
        endpoint: the dead one's store re-adopted, or (lose_store) started afresh."""
        from freekv_kvstore.journal import discard_store

        a = self.args
        endpoint = f"ipc://{self.out.resolve()}/{name}-kvstore.sock"
        daemons = [self.start_daemon(endpoint, f"{name}-daemon")]
        try:
            srv = self.server(name, ["--kvstore-endpoint", endpoint])
            try:
                t = {}

                def outage():
                    time.sleep(a.fault_after)
                    daemons[0].kill()
                    daemons[0].wait(30)
                    if lose_store:
                        discard_store(SHM_DIR, endpoint)
                    time.sleep(a.down_s)
                    t["health"] = health(srv.url)
                    t["refused"] = generate(srv.url, self.probe, 4, 60)
                    t["alive"] = srv.proc.poll() is None
                    daemons.append(self.start_daemon(endpoint, f"{name}-daemon-2"))
                    t["back"] = time.time()

                results = burst(srv.url, self.prompts, a.output_len, a.timeout, during=outage)
                rec = recover(srv.url, self.probe, t["back"], a.recovery_deadline)
                refused = t["refused"]
                note = (f"down {a.down_s:g} s: /health {t['health']}, a new request {refused['outcome']} "
                        f"({refused['message'][:80]}), server alive {t['alive']}; recovery from the daemon's restart")
                return row(name, results, None, healthy(srv.url) and srv.proc.poll() is None, rec, note)
            finally:
                srv.stop()
        finally:
            for d in daemons:
                if d.poll() is None:
                    os.killpg(d.pid, signal.SIGTERM)
                    d.wait(30)
            discard_store(SHM_DIR, endpoint)

    def daemon_gone(self) -> dict:
        return self.daemon_outage("daemon-gone", lose_store=False)

    def daemon_lost(self) -> dict:
        return self.daemon_outage("daemon-lost", lose_store=True)

    def server_restart(self) -> dict:
        from freekv_kvstore import daemon_stats

        a = self.args
        endpoint = f"ipc://{self.out.resolve()}/faults-kvstore.sock"
        daemon = self.start_daemon(endpoint, "server-restart-daemon")
        try:
            srv = self.server("server-restart-1", ["--kvstore-endpoint", endpoint])
            t_fault = {}

            def kill_server():
                time.sleep(a.fault_after)
                t_fault["used"] = sum(x.used_pages for x in daemon_stats(endpoint).arenas)
                t_fault["t"] = time.time()
                os.killpg(srv.proc.pid, signal.SIGKILL)

            lost = burst(srv.url, self.prompts, a.output_len, a.timeout, during=kill_server)
            deadline = time.time() + a.recovery_deadline
            while time.time() < deadline and sum(x.used_pages for x in daemon_stats(endpoint).arenas):
                time.sleep(1)
            freed = sum(x.used_pages for x in daemon_stats(endpoint).arenas)
            srv2 = self.server("server-restart-2", ["--kvstore-endpoint", endpoint])
            try:
                rec = recover(srv2.url, self.probe, t_fault["t"], a.recovery_deadline + a.start_timeout)
                results = burst(srv2.url, self.prompts, a.output_len, a.timeout)
                alive = healthy(srv2.url)
            finally:
                srv2.stop()
            note = (f"killed server's requests: {sum(r['outcome'] != 'completed' for r in lost)} of {len(lost)} "
                    f"ended; daemon used pages {t_fault['used']} at the kill, {freed} before the new server")
            return row("server-restart", results, None, alive, rec, note)
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(30)

    def arena_full(self) -> dict:
        a = self.args
        srv = self.server("arena-full", ["--kvstore-arena-gb", str(a.small_arena_gb)])
        try:
            rng = random.Random(1)
            long = [[rng.randrange(100, 30000) for _ in range(a.long_len)] for _ in range(a.requests)]
            t0 = time.time()
            results = burst(srv.url, long, 16, a.timeout)
            rec = recover(srv.url, self.probe, t0, a.recovery_deadline)
            return row("arena-full", results, None, healthy(srv.url) and srv.proc.poll() is None, rec,
                       f"{a.requests} prompts of {a.long_len} tokens, arena {a.small_arena_gb} GiB")
        finally:
            srv.stop()

    def malformed(self) -> dict:
        a = self.args
        srv = self.server("malformed")
        try:
            results = [generate(srv.url, self.probe, -1, 60),
                       generate(srv.url, [7] * (a.context_len + 1), 4, 60)]
            alive = healthy(srv.url) and srv.proc.poll() is None
            rec = recover(srv.url, self.probe, time.time(), a.recovery_deadline)
        finally:
            srv.stop()
        bogus = dict(os.environ, SGLANG_KV_RETRIEVAL="freekv", FREEKV_ARGS="--kv-budget lots")
        proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", a.model_path,
                                 *a.model_args.split(),
                                 "--port", str(a.port)], env=bogus, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=a.start_timeout)
        except subprocess.TimeoutExpired:  # it started instead of refusing: stop it and its children
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
        refused = proc.returncode != 0 and "kv-budget" in text
        last = text.strip().splitlines()[-1:] or [""]
        results.append({"outcome": "aborted" if refused else "lost", "output_ids": [],
                        "message": f"bogus FREEKV_ARGS: exit {proc.returncode}: {last[0][:200]}"})
        return row("malformed", results, None, alive, rec, "negative max_new_tokens, prompt over the context, "
                   "bogus FREEKV_ARGS (aborted = refused with a message naming the flag)")


SCENARIOS = {"daemon-kill": Run.daemon_kill, "daemon-stop": Run.daemon_stop, "daemon-gone": Run.daemon_gone,
             "daemon-lost": Run.daemon_lost, "server-restart": Run.server_restart, "arena-full": Run.arena_full,
             "malformed": Run.malformed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-args", default="", help="more server flags for the model, e.g. '--load-format dummy "
                    "--tokenizer-path DIR/tokenizer' for scripts/make_dummy_model.py's folders")
    ap.add_argument("--out", default="results/faults")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--port", type=int, default=30011)
    ap.add_argument("--freekv-args", default="--kv-budget 1024 --kv-sink 64 --kv-window 128 --kv-page-size 16 "
                                             "--kvstore-arena-gb 4")
    ap.add_argument("--arena-gb", type=float, default=4.0, help="the external daemons' arena")
    ap.add_argument("--down-s", type=float, default=15.0,
                    help="daemon-gone/-lost: seconds without a daemon (past the 5 s deadline of a kvstore call)")
    ap.add_argument("--small-arena-gb", type=float, default=0.4,
                    help="arena-full's arena (SmolLM2: ~17K tokens, two long prompts; it must hold one prefill chunk)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=4000)
    ap.add_argument("--long-len", type=int, default=7000, help="arena-full's prompt length")
    ap.add_argument("--context-len", type=int, default=8192, help="the model's context (malformed: one more)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--fault-after", type=float, default=2.0, help="seconds into the burst the fault strikes")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request")
    ap.add_argument("--recovery-deadline", type=float, default=60.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--deterministic", action="store_true", help="add --enable-deterministic-inference")
    args = ap.parse_args()
    run = Run(args)
    rows = []
    print(f"{'scenario':<15}" + "".join(f"{c:>15}" for c in COLUMNS) + "  note", flush=True)
    try:
        for name in args.scenarios.split(","):  # each row as it ends: a call cut off by its time limit keeps them
            try:
                rows.append(SCENARIOS[name](run))
            except Exception as e:  # the scenario could not run: say so in its row, go on with the next
                rows.append({"scenario": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            (run.out / "faults.json").write_text(json.dumps(rows, indent=1) + os.linesep)
            print_row(rows[-1])
    finally:
        run.close()


COLUMNS = ("sent", "completed", "aborted", "lost", "equal_outputs", "server_alive", "recovery_s")


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['scenario']:<15} did not run: {r['error']}", flush=True)
        return
    rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
    vals = [r["sent"], r["completed"], r["aborted"], r["lost"], "-" if r["equal_outputs"] is None
            else r["equal_outputs"], "yes" if r["server_alive"] else "NO", rec]
    print(f"{r['scenario']:<15}" + "".join(f"{v!s:>15}" for v in vals) + f"  {r['note']}")
    for m in r["messages"]:
        print(f"{'':<15}  message: {m}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
