"""Embedded mode: a daemon subprocess that lives and dies with the server that started it.

For a server started without a kvstore endpoint: start_embedded() launches ``python -m freekv_kvstore`` on
a private ipc:// path and waits until it answers. The daemon stops on stop(), at the end of a with-block,
at interpreter exit, and by itself within a reaper tick when the starting process dies (it watches its pid),
so even a kill -9 of the server leaves no daemon or segment behind.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import time
import weakref

from .arena import remove_stale_segments
from .client import ping_daemon
from .config import TOKEN_ENV, ensure_private_dir, ipc_path, runtime_dir
from .errors import DaemonUnavailable, KVStoreError


class EmbeddedKVStore:
    """Handle of an embedded daemon: .endpoint and .token to connect, .stop() to end it."""

    def __init__(self, process: subprocess.Popen, endpoint: str, token: str | None, leftovers: _Leftovers) -> None:
        self.process = process
        self.endpoint = endpoint
        self.token = token
        self._leftovers = leftovers
        self._finalizer = weakref.finalize(self, _stop_process, process, leftovers, 10.0)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code. Idempotent."""
        if not self._finalizer.alive:
            return self.process.returncode
        self._finalizer.detach()
        return _stop_process(self.process, self._leftovers, timeout_s)

    def __enter__(self) -> EmbeddedKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedKVStore({self.endpoint}, pid {self.pid})"


@dataclasses.dataclass(frozen=True, slots=True)
class _Leftovers:
    """What a daemon killed before it could clean up leaves behind."""

    shm_dir: str
    socket_path: str | None
    ready_file: str

    def remove(self) -> None:
        remove_stale_segments(self.shm_dir)
        paths = [self.ready_file]
        if self.socket_path is not None:
            paths += [self.socket_path, f"{self.socket_path}.lock"]
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def start_embedded(
    arena_gb: float,
    endpoint: str | None = None,
    *,
    token: str | None = None,
    log_level: str = "warning",
    client_timeout_s: float | None = None,
    shm_dir: str = "/dev/shm",
    startup_timeout_s: float = 30.0,
) -> EmbeddedKVStore:
    """Start a daemon subprocess with an arena budget of arena_gb GiB and wait until it answers PING.
    endpoint defaults to a fresh ipc:// path in the per-user runtime directory; a tcp:// endpoint gets a
    random token unless one is given (it travels in the environment, never on the command line)."""
    if not arena_gb > 0:
        raise ValueError(f"arena_gb must be positive, got {arena_gb!r}")
    if endpoint is None:
        directory = runtime_dir()
        ensure_private_dir(directory)
        endpoint = f"ipc://{directory}/embedded-{os.getpid()}-{secrets.token_hex(4)}.sock"
    if ipc_path(endpoint) is None and token is None:
        token = secrets.token_urlsafe(24)
    ensure_private_dir(runtime_dir())
    ready_file = os.path.join(runtime_dir(), f"embedded-{os.getpid()}-{secrets.token_hex(4)}.ready")
    cmd = [
        sys.executable, "-m", "freekv_kvstore",
        "--endpoint", endpoint,
        "--arena-gb", repr(float(arena_gb)),
        "--log-level", log_level,
        "--shm-dir", shm_dir,
        "--parent-pid", str(os.getpid()),
        "--ready-file", ready_file,
    ]  # fmt: skip
    if client_timeout_s is not None:
        cmd += ["--client-timeout", repr(float(client_timeout_s))]
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if token is not None:
        env[TOKEN_ENV] = token
    # Its own session: a Ctrl-C meant for the server must not kill the daemon before the server lets go.
    process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    handle = EmbeddedKVStore(process, endpoint, token, _Leftovers(shm_dir, ipc_path(endpoint), ready_file))
    try:
        handle.endpoint = _wait_ready(process, ready_file, token, startup_timeout_s)
    except BaseException:
        handle.stop(timeout_s=2.0)
        raise
    return handle


def _wait_ready(process: subprocess.Popen, ready_file: str, token: str | None, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            code = process.returncode
            raise RuntimeError(f"the embedded kvstore exited with code {code} while starting; see its log above")
        try:
            with open(ready_file) as f:
                endpoint = f.read().strip()
        except FileNotFoundError:
            time.sleep(0.02)
            continue
        if endpoint:
            try:
                ping_daemon(endpoint, token=token, timeout_s=max(0.1, deadline - time.monotonic()))
                return endpoint
            except (DaemonUnavailable, KVStoreError):
                time.sleep(0.02)
    raise DaemonUnavailable(f"the embedded kvstore (pid {process.pid}) did not start within {timeout_s:g} s")


def _stop_process(process: subprocess.Popen, leftovers: _Leftovers, timeout_s: float) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.returncode < 0:  # killed by a signal: it could not unlink its segments and socket
        leftovers.remove()
    return process.returncode
