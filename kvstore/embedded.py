"""Embedded mode: a supervised daemon subprocess that lives and dies with the server that started it.

For a server started without a kvstore endpoint: start_embedded() launches ``python -m freekv_kvstore`` on
a private ipc:// path and waits until it answers. A thread of the server watches the daemon: when it dies
(a crash, kill -9) it is started again on the same endpoint, where it re-adopts the arenas, page tables and
sessions of the dead one (journal.py), so the clients' sessions and pages go on. The daemon stops on stop(),
at the end of a with-block, at interpreter exit, and by itself within a reaper tick when the starting process
dies (it watches its pid), so even a kill -9 of the server leaves no daemon or segment behind.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

from .client import ping_daemon
from .config import TOKEN_ENV, ensure_private_dir, ipc_path, runtime_dir
from .errors import DaemonUnavailable, KVStoreError
from .journal import discard_store

log = logging.getLogger("freekv_kvstore")

# A daemon that dies this often within the window is not restarted again: something kills it on sight.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class EmbeddedKVStore:
    """Handle of an embedded daemon: .endpoint and .token to connect, .stop() to end it. .restarts counts the
    restarts after deaths (add_restart_listener(fn) calls fn(restarts) after each); .failure says why the supervisor
    gave up (None while it keeps a daemon running)."""

    def __init__(self, supervisor: _Supervisor) -> None:
        self._supervisor = supervisor
        self.token = supervisor.token
        self._finalizer = weakref.finalize(self, supervisor.stop, 10.0)

    @property
    def endpoint(self) -> str:
        return self._supervisor.endpoint

    @property
    def process(self) -> subprocess.Popen:
        return self._supervisor.process

    @property
    def pid(self) -> int:
        return self._supervisor.process.pid

    @property
    def restarts(self) -> int:
        return self._supervisor.restarts

    @property
    def failure(self) -> str | None:
        return self._supervisor.failure

    def add_restart_listener(self, fn: Callable[[int], None]) -> None:
        """Call fn(restarts) on the supervisor thread after each restart (e.g. to count it in a metric); an
        exception from fn is logged, never raised into the supervisor."""
        self._supervisor.listeners.append(fn)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code. Idempotent."""
        if not self._finalizer.alive:
            return self.process.returncode
        self._finalizer.detach()
        return self._supervisor.stop(timeout_s)

    def __enter__(self) -> EmbeddedKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedKVStore({self.endpoint}, pid {self.pid})"


@dataclasses.dataclass(frozen=True, slots=True)
class _Leftovers:
    """What a daemon that did not stop cleanly leaves behind."""

    shm_dir: str
    ready_file: str

    def remove(self, endpoint: str) -> None:
        discard_store(self.shm_dir, endpoint)
        paths = [self.ready_file]
        socket_path = ipc_path(endpoint)
        if socket_path is not None:
            paths += [socket_path, f"{socket_path}.lock"]
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class _Supervisor(threading.Thread):
    """Owns the daemon process: starts it, restarts it when it dies, stops it. Holds no reference to the handle,
    so the handle's finalizer can stop it."""

    def __init__(self, cmd: list[str], env: dict[str, str], endpoint: str, token: str | None,
                 leftovers: _Leftovers, startup_timeout_s: float) -> None:  # fmt: skip
        super().__init__(name="kvstore-supervisor", daemon=True)
        self.cmd, self.env, self.endpoint, self.token = cmd, env, endpoint, token
        self.leftovers = leftovers
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.listeners: list[Callable[[int], None]] = []
        self.failure: str | None = None
        self._deaths: collections.deque[float] = collections.deque(maxlen=MAX_RESTARTS)
        self._lock = threading.Lock()  # orders a restart against stop()
        self._stopping = False

    def launch(self) -> None:
        """Start the daemon and wait until it answers; the first start also learns the bound endpoint."""
        with self._lock:
            if self._stopping:
                raise DaemonUnavailable("the embedded kvstore is stopping")
            try:
                os.unlink(self.leftovers.ready_file)  # a killed daemon's, naming the old endpoint
            except FileNotFoundError:
                pass
            # Its own session: a Ctrl-C meant for the server must not kill the daemon before the server lets go.
            self.process = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.endpoint = _wait_ready(self.process, self.leftovers.ready_file, self.token, self.startup_timeout_s)
        if self.endpoint != self.cmd[self.cmd.index("--endpoint") + 1]:
            self.cmd[self.cmd.index("--endpoint") + 1] = self.endpoint  # tcp port 0: restarts take the same port

    def run(self) -> None:
        while True:
            code = self.process.wait()
            now = time.monotonic()
            with self._lock:
                if self._stopping:
                    return
            self._deaths.append(now)
            if len(self._deaths) == MAX_RESTARTS and now - self._deaths[0] < RESTART_WINDOW_S:
                self._give_up(f"it died {MAX_RESTARTS} times within {RESTART_WINDOW_S:g} s (last exit code {code})")
                return
            log.warning("the embedded kvstore (pid %d) exited with code %s; restarting it on %s",
                        self.process.pid, code, self.endpoint)  # fmt: skip
            try:
                self.launch()
            except (KVStoreError, RuntimeError) as e:
                with self._lock:
                    if self._stopping:
                        return
                self._give_up(f"its restart failed: {e}")
                return
            self.restarts += 1
            log.warning("the embedded kvstore is back on %s after %.2f s (pid %d, restart %d)",
                        self.endpoint, time.monotonic() - now, self.process.pid, self.restarts)  # fmt: skip
            for fn in list(self.listeners):
                try:
                    fn(self.restarts)
                except Exception:  # noqa: BLE001 - a listener must not stop the supervision
                    log.exception("a restart listener of the embedded kvstore failed")

    def stop(self, timeout_s: float) -> int | None:
        with self._lock:
            self._stopping = True
            process = self.process
        if process is None:  # it never started
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout_s)
        # Whatever a killed or refused daemon left: nothing but this server could re-adopt its private store.
        self.leftovers.remove(self.endpoint)
        return process.returncode

    def _give_up(self, why: str) -> None:
        self.failure = f"the embedded kvstore on {self.endpoint} is not restarted: {why}; see its log above"
        log.error("%s", self.failure)


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
    """Start a supervised daemon subprocess with an arena budget of arena_gb GiB and wait until it answers
    PING. endpoint defaults to a fresh ipc:// path in the per-user runtime directory; a tcp:// endpoint gets a
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
    supervisor = _Supervisor(cmd, env, endpoint, token, _Leftovers(shm_dir, ready_file), startup_timeout_s)
    handle = EmbeddedKVStore(supervisor)
    try:
        supervisor.launch()
    except BaseException:
        handle.stop(timeout_s=2.0)
        raise
    supervisor.start()
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
