"""benchmarks/server_process.py against a stand-in `sglang.launch_server` (found first on PYTHONPATH): it waits
for /health, reports an early exit with the log's tail, and stop() ends the whole process session."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from server_process import ServerProcess  # noqa: E402

FAKE = textwrap.dedent("""
    import http.server, subprocess, sys
    args = sys.argv[1:]
    print("fake server", args, flush=True)
    if "--fail" in args:
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a scheduler, say
    print("child", child.pid, flush=True)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
""")


@pytest.fixture
def fake_env(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(FAKE)
    return dict(os.environ, PYTHONPATH=str(tmp_path))


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_waits_for_health_then_stops_the_session(tmp_path, fake_env):
    srv = ServerProcess("fake", free_port(), ["--model-path", "m"], tmp_path / "server.log", fake_env)
    try:
        assert srv.wait(60) < 60
        assert "fake server ['--port'" in srv.tail()
        child = int(next(ln.split()[1] for ln in srv.tail().splitlines() if ln.startswith("child")))
    finally:
        srv.stop()
    assert srv.proc.poll() is not None
    deadline = time.time() + 10
    while not gone(child) and time.time() < deadline:
        time.sleep(0.1)
    assert gone(child), "stop() left the server's child process running"


def test_an_early_exit_raises_with_the_log_tail(tmp_path, fake_env):
    srv = ServerProcess("fake", free_port(), ["--fail"], tmp_path / "server.log", fake_env)
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*fake server"):
        srv.wait(60)
