"""One SGLang server process of a benchmark or check: launched in its own session with its log in a file,
waited for until /health answers, stopped with its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class ServerProcess:
    def __init__(self, name: str, port: int, args: list[str], log: Path, env: dict | None = None):
        self.name, self.log, self.url = name, log, f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(port), *args]
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait(self, timeout: float) -> float:
        """Seconds until /health answers; raises with the log's tail if the process exits or times out first."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"[{self.name}] exited with {self.proc.returncode}; tail:\n{self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return time.time() - t0
            except Exception:
                time.sleep(1)
        raise RuntimeError(f"[{self.name}] not healthy after {timeout} s; tail:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM to the whole session (the server's scheduler and detokenizer too), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
