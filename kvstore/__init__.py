"""freekv_kvstore: the host-memory KV page store of FreeKV, a daemon of its own.

A GPU process connects with KVStoreClient, gets one shared-memory arena of pages, and allocates, frees,
retains and looks up pages by id; the bytes are read and written in place, never sent over the socket.
See docs/kvstore.md.
"""

from .arena import ArenaGeometry
from .client import KVStoreClient, daemon_stats, ping_daemon, shutdown_daemon
from .config import DaemonConfig, default_endpoint
from .embedded import EmbeddedKVStore, start_embedded
from .errors import (
    ArenaFailed,
    ArenaFull,
    ArenaNotReady,
    BudgetExceeded,
    ClientIdInUse,
    DaemonUnavailable,
    EndpointInUse,
    HostMemoryExhausted,
    InvalidArgument,
    KVStoreError,
    LimitExceeded,
    ProtocolError,
    SessionExpired,
    StateRejected,
    Unauthorized,
)
from .prefix import prefix_keys
from .protocol import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "ArenaFailed",
    "ArenaFull",
    "ArenaGeometry",
    "ArenaNotReady",
    "BudgetExceeded",
    "ClientIdInUse",
    "DaemonConfig",
    "DaemonUnavailable",
    "EmbeddedKVStore",
    "EndpointInUse",
    "HostMemoryExhausted",
    "InvalidArgument",
    "KVStoreClient",
    "KVStoreError",
    "LimitExceeded",
    "ProtocolError",
    "SessionExpired",
    "StateRejected",
    "Unauthorized",
    "daemon_stats",
    "default_endpoint",
    "ping_daemon",
    "prefix_keys",
    "shutdown_daemon",
    "start_embedded",
]
