"""Helpers of the kvstore tests: real daemons in subprocesses (each on its own ipc path or tcp port), raw peers."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from freekv_kvstore import codec
from freekv_kvstore.journal import discard_store, store_prefix, store_segments

TOKEN = "test-token-0123456789"
HERE = Path(__file__).parent


@dataclasses.dataclass
class Daemon:
    process: subprocess.Popen
    endpoint: str
    token: str | None
    workdir: Path
    shm_dir: str = "/dev/shm"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return "".join((self.workdir / name).read_text() for name in ("daemon.out", "daemon.err"))

    def segments(self) -> list[str]:
        """Paths of the arena files of this daemon's endpoint."""
        return sorted(store_segments(store_prefix(self.shm_dir, self.endpoint)).values())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout_s)


class DaemonFactory:
    def __init__(self) -> None:
        self.daemons: list[Daemon] = []
        self.dirs: list[Path] = []

    def workdir(self) -> Path:
        # Short and unique: ipc paths are limited to 107 bytes and tests of several runs share /tmp.
        path = Path(tempfile.mkdtemp(prefix="fkv-", dir="/tmp"))
        self.dirs.append(path)
        return path

    def start(
        self,
        transport: str = "ipc",
        *,
        token: str | None = None,
        arena_gb: float = 0.25,
        endpoint: str | None = None,
        extra: tuple[str, ...] = (),
        shm_dir: str = "/dev/shm",
        wait: bool = True,
    ) -> Daemon:
        workdir = self.workdir()
        if endpoint is None:
            endpoint = f"ipc://{workdir}/kv.sock" if transport == "ipc" else "tcp://127.0.0.1:0"
        if transport == "tcp" and token is None:
            token = TOKEN
        ready = workdir / "ready"
        cmd = [sys.executable, "-m", "freekv_kvstore", "--endpoint", endpoint, "--arena-gb", str(arena_gb),
               "--log-level", "info", "--ready-file", str(ready), "--shm-dir", shm_dir, *extra]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("FREEKV_KVSTORE_")}
        if token is not None:
            env["FREEKV_KVSTORE_TOKEN"] = token
        with open(workdir / "daemon.out", "w") as out, open(workdir / "daemon.err", "w") as err:
            process = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        daemon = Daemon(process, endpoint, token, workdir, shm_dir)
        self.daemons.append(daemon)
        if wait:
            deadline = time.monotonic() + 20
            while not (ready.exists() and ready.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"daemon did not start (exit {process.poll()}):\n{daemon.log()}")
                time.sleep(0.01)
            daemon.endpoint = ready.read_text().strip()
        return daemon

    def cleanup(self) -> None:
        for d in self.daemons:
            if d.process.poll() is None:
                d.process.kill()
                d.process.wait(10)
            discard_store(d.shm_dir, d.endpoint)  # what a killed daemon left behind
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


class RawPeer:
    """A bare DEALER socket for sending frames no well-behaved client would send."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 5.0) -> tuple[int, codec.Status, int, bytes]:
        if not self.sock.poll(timeout_s * 1000):
            raise TimeoutError("no reply from the daemon")
        return codec.parse_reply(self.sock.recv_multipart())

    def exchange(self, frames: list[bytes], timeout_s: float = 5.0) -> tuple[int, codec.Status, int, bytes]:
        self.send(frames)
        return self.recv(timeout_s)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def run_worker(*args: str) -> subprocess.Popen:
    """Start tests/kvstore/kvstore_worker.py in a fresh interpreter (stdout piped, line-buffered)."""
    return subprocess.Popen(
        [sys.executable, "-u", str(HERE / "kvstore_worker.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("FREEKV_KVSTORE_")},
    )
