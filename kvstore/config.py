"""The daemon's settings (one dataclass) and where a daemon listens by default."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import tempfile

import psutil

ENDPOINT_ENV = "FREEKV_KVSTORE_ENDPOINT"
TOKEN_ENV = "FREEKV_KVSTORE_TOKEN"
GiB = 1 << 30
_IPC_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL


def runtime_dir() -> str:
    """This user's private directory for sockets: $XDG_RUNTIME_DIR/freekv, else /tmp/freekv-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
        return os.path.join(base, "freekv")
    return os.path.join(tempfile.gettempdir(), f"freekv-{os.getuid()}")


def ensure_private_dir(path: str) -> None:
    """Create path 0700, or check that an existing one is ours and closed to others (a directory somebody
    else created in /tmp could let them replace the socket)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); remove it or choose --endpoint"
        )


def default_endpoint() -> str:
    return os.environ.get(ENDPOINT_ENV) or f"ipc://{os.path.join(runtime_dir(), 'kvstore.sock')}"


def ipc_path(endpoint: str) -> str | None:
    """The socket path of an ipc:// endpoint (made absolute), None for tcp://; ValueError for anything else."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if not path or path.startswith("@"):
            raise ValueError(f"ipc endpoints need a file path, got {endpoint!r}")
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > _IPC_PATH_MAX:
            raise ValueError(f"ipc socket path {path!r} is longer than the {_IPC_PATH_MAX} bytes Unix sockets allow")
        return path
    if endpoint.startswith("tcp://") and ":" in endpoint.removeprefix("tcp://"):
        return None
    raise ValueError(f"endpoint must be ipc://<path> or tcp://<host>:<port>, got {endpoint!r}")


def normalize_endpoint(endpoint: str) -> str:
    path = ipc_path(endpoint)
    return endpoint if path is None else f"ipc://{path}"


def _default_arena_bytes() -> int:
    """Half the host's memory, and no more than the shared-memory filesystem can hold."""
    half = psutil.virtual_memory().total // 2
    try:
        st = os.statvfs("/dev/shm")
        return min(half, st.f_blocks * st.f_frsize)
    except OSError:
        return half


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Settings of one kvstore daemon. arena_bytes is the budget for the arenas of all clients together;
    each client asks for its own arena in HELLO and is refused (BUDGET_EXCEEDED) when it would not fit."""

    endpoint: str = dataclasses.field(default_factory=default_endpoint)
    arena_bytes: int = dataclasses.field(default_factory=_default_arena_bytes)
    token: str | None = None
    log_level: str = "info"
    # Liveness: a client silent for client_timeout_s loses its session and its unretained pages. The reaper
    # runs every reap_interval_s, so pages are back within client_timeout_s + reap_interval_s (< 5 s).
    heartbeat_interval_s: float = 1.0
    client_timeout_s: float = 3.0
    reap_interval_s: float = 0.25
    max_clients: int = 256
    max_requests_per_client: int = 1 << 20
    max_prefixes_per_client: int = 1 << 20
    shm_dir: str = "/dev/shm"
    prefault_threads: int = dataclasses.field(default_factory=lambda: min(8, os.cpu_count() or 1))
    # Arenas up to this size are pre-faulted before HELLO answers; larger ones in the background.
    sync_prefault_bytes: int = 64 << 20
    parent_pid: int | None = None  # stop when this process is gone (embedded mode)
    ready_file: str | None = None  # written with the bound endpoint once the daemon listens

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", normalize_endpoint(self.endpoint))
        if ipc_path(self.endpoint) is None and not self.token:
            raise ValueError("tcp:// endpoints need a token (--token, --token-file or $FREEKV_KVSTORE_TOKEN)")
        if self.token is not None and (not self.token or not self.token.isprintable()):
            raise ValueError("the token must be a non-empty printable string")
        if self.arena_bytes <= 0:
            raise ValueError(f"the arena budget must be positive, got {self.arena_bytes} bytes")
        if logging.getLevelName(self.log_level.upper()) not in (10, 20, 30, 40, 50):
            raise ValueError(f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}")
        if not 0 < self.heartbeat_interval_s * 2 <= self.client_timeout_s:
            raise ValueError(
                f"client_timeout_s ({self.client_timeout_s}) must be at least twice heartbeat_interval_s "
                f"({self.heartbeat_interval_s}) so one lost heartbeat does not reap a live client"
            )
        if not 0 < self.reap_interval_s <= self.client_timeout_s:
            raise ValueError(f"reap_interval_s must be in (0, client_timeout_s], got {self.reap_interval_s}")
        for name in ("max_clients", "max_requests_per_client", "max_prefixes_per_client", "prefault_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"shared-memory directory {self.shm_dir!r} does not exist")
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ValueError(f"parent_pid must be a process id, got {self.parent_pid}")
