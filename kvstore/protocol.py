"""THE kvstore wire protocol: the only place it is declared.

A request is two ZMQ frames sent by a DEALER socket: ``[header, body]``.
    header = REQUEST_HEADER: magic b"FK", version u8, opcode u8, call_id u32, session u64 (network order)
    body   = msgpack map of the request's fields (field name -> value); never page bytes
A reply is ``[header, body]`` with REPLY_HEADER: magic, version u8, opcode u8 (echoed), status u8, call_id u32;
the body is the opcode's reply message when status is OK, an ``ErrorReply`` when it is ERROR.

Rules that keep old peers readable: opcode and error-code values are explicit and never reused (retired
ones go to RETIRED_*), the header layouts and ErrorReply never change, and any other change bumps
PROTOCOL_VERSION. The daemon answers a version it does not speak with VERSION_MISMATCH.
"""

from __future__ import annotations

import dataclasses
import enum
import struct

from .arena import ArenaGeometry

PROTOCOL_VERSION = 2  # 2: RETAIN_CHAIN
MAGIC = b"FK"
REQUEST_HEADER = struct.Struct("!2sBBIQ")
REPLY_HEADER = struct.Struct("!2sBBBI")
MAX_BODY_BYTES = 1 << 20  # a request body above this is answered MESSAGE_TOO_LARGE
MAX_KEY_BYTES = 64
MAX_CLIENT_ID_CHARS = 128


@enum.unique
class Opcode(enum.IntEnum):
    HELLO = 0x01
    BYE = 0x02
    HEARTBEAT = 0x03
    ALLOC = 0x10
    FREE = 0x11
    RETAIN = 0x20
    RELEASE = 0x21
    LOOKUP = 0x22
    RETAIN_CHAIN = 0x23
    STATS = 0x30
    PING = 0x31
    SHUTDOWN = 0x3F


@enum.unique
class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # wrong frame count, bad header or magic, body not msgpack
    VERSION_MISMATCH = 2
    UNKNOWN_OPCODE = 3
    MESSAGE_TOO_LARGE = 4
    INVALID_MESSAGE = 5  # body has wrong fields or field types
    INVALID_ARGUMENT = 6  # well-typed but meaningless: negative counts, foreign page ids, bad geometry
    UNAUTHORIZED = 7
    UNKNOWN_SESSION = 8  # never opened, closed, reaped, or the daemon restarted
    CLIENT_ID_IN_USE = 9
    ARENA_FULL = 10
    BUDGET_EXCEEDED = 11  # --arena-gb cannot fit the arena a HELLO asks for
    HOST_MEMORY = 12  # the shared-memory filesystem cannot hold the arena
    ARENA_NOT_READY = 13
    ARENA_FAILED = 14
    LIMIT_EXCEEDED = 15
    SHUTTING_DOWN = 16
    INTERNAL = 17


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1


RETIRED_OPCODES: frozenset[int] = frozenset()
RETIRED_ERROR_CODES: frozenset[int] = frozenset()


class SessionUse(enum.Enum):
    NONE = "none"  # HELLO: opens the session
    REQUIRED = "required"  # acts on the session's arena
    OPTIONAL = "optional"  # administrative: authorized by a session or by the token


def _check_len(name: str, values: list, limit: int) -> None:
    if len(values) > limit:
        raise ValueError(f"{name} has {len(values)} entries, more than the limit of {limit}")


def _check_key(key: bytes) -> None:
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"prefix keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


# Messages. Field types are enforced by codec.decode; __post_init__ adds the checks types cannot express
# and raises ValueError, which the daemon answers as INVALID_ARGUMENT.


@dataclasses.dataclass(frozen=True, slots=True)
class HelloRequest:
    client_id: str
    geometry: ArenaGeometry
    num_pages: int
    rank: int = 0
    token: str | None = None
    # Who is asking, so a daemon on the same host can reap a dead client at once instead of after the
    # heartbeat timeout. proc_start is the client's psutil create_time; it guards against pid reuse.
    pid: int = 0
    hostname: str = ""
    proc_start: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= len(self.client_id) <= MAX_CLIENT_ID_CHARS or not self.client_id.isprintable():
            raise ValueError(f"client_id must be 1..{MAX_CLIENT_ID_CHARS} printable characters, got {self.client_id!r}")
        if not 1 <= self.num_pages < 1 << 31:
            raise ValueError(f"num_pages must be in [1, 2^31), got {self.num_pages}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")


@dataclasses.dataclass(frozen=True, slots=True)
class HelloReply:
    session: int
    client_id: str
    arena_path: str  # a file under the daemon's shared-memory directory; map it MAP_SHARED
    arena_bytes: int
    num_pages: int
    page_bytes: int
    shape: list[int]  # [num_pages, num_layers, num_kv_heads, 2, page_size, head_dim], C-contiguous
    dtype: str
    ready: bool  # False while the daemon pre-faults the arena; poll HEARTBEAT until it says ready
    reattached: bool  # True when the client_id's arena (and its retained prefixes) survived from before
    retained_prefixes: int
    heartbeat_interval_s: float
    client_timeout_s: float
    daemon_pid: int


@dataclasses.dataclass(frozen=True, slots=True)
class ByeRequest:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class ByeReply:
    freed_pages: int


@dataclasses.dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class HeartbeatReply:
    ready: bool


@dataclasses.dataclass(frozen=True, slots=True)
class AllocRequest:
    """Append counts[i] pages to request request_ids[i], for every i, all or nothing."""

    request_ids: list[int]
    counts: list[int]

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.counts):
            raise ValueError(f"{len(self.request_ids)} request_ids but {len(self.counts)} counts")
        if any(n < 0 for n in self.counts):
            raise ValueError("page counts must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class AllocReply:
    pages: list[list[int]]


@dataclasses.dataclass(frozen=True, slots=True)
class FreeRequest:
    request_ids: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class FreeReply:
    released: list[int]  # pages each request held
    freed: list[int]  # of those, pages that went back to the free pool (the rest stay retained or shared)


@dataclasses.dataclass(frozen=True, slots=True)
class RetainRequest:
    """Retain pages[i] under keys[i]. A key already retained keeps its pages (equal keys mean equal tokens)."""

    keys: list[bytes]
    pages: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.pages):
            raise ValueError(f"{len(self.keys)} keys but {len(self.pages)} page lists")
        for key in self.keys:
            _check_key(key)
        if any(not p for p in self.pages):
            raise ValueError("every retained key needs at least one page")


@dataclasses.dataclass(frozen=True, slots=True)
class RetainReply:
    pages: list[list[int]]  # the pages that hold each key after the call
    created: list[bool]


@dataclasses.dataclass(frozen=True, slots=True)
class RetainChainRequest:
    """Retain a chain of prefix keys, one page each: keys[i] holds pages[i], its parent key being keys[i-1] (keys[0]'s:
    parent, a key already retained, or none). LOOKUP of a chain key gives its ancestors' pages then its own."""

    keys: list[bytes]
    pages: list[int]
    parent: bytes | None = None

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.pages) or not self.keys:
            raise ValueError(f"a chain needs one page per key, got {len(self.keys)} keys and {len(self.pages)} pages")
        for key in self.keys + ([] if self.parent is None else [self.parent]):
            _check_key(key)


@dataclasses.dataclass(frozen=True, slots=True)
class RetainChainReply:
    created: list[bool]


@dataclasses.dataclass(frozen=True, slots=True)
class ReleaseRequest:
    keys: list[bytes]

    def __post_init__(self) -> None:
        for key in self.keys:
            _check_key(key)


@dataclasses.dataclass(frozen=True, slots=True)
class ReleaseReply:
    released: list[bool]  # False: the key was not retained (never, released before, or evicted)
    freed: int


@dataclasses.dataclass(frozen=True, slots=True)
class LookupRequest:
    """Find the last of keys that is retained. With request_id, its pages are also held by that request
    until FREE, so they cannot be evicted while the request reads them."""

    keys: list[bytes]
    request_id: int | None = None

    def __post_init__(self) -> None:
        for key in self.keys:
            _check_key(key)


@dataclasses.dataclass(frozen=True, slots=True)
class LookupReply:
    index: int  # position in keys of the hit, -1 when none is retained
    pages: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class StatsRequest:
    token: str | None = None
    check: bool = False  # also run the full accounting check (O(pages)) and report its outcome


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaStats:
    client_id: str
    rank: int
    attached: bool  # a live session holds it
    ready: bool
    arena_path: str
    num_pages: int
    page_bytes: int
    free_pages: int
    used_pages: int  # held by at least one request
    cached_pages: int  # held only by retained prefixes (evictable)
    requests: int
    prefixes: int
    evicted_prefixes: int
    idle_s: float  # since the last message of its session, or since it was detached


@dataclasses.dataclass(frozen=True, slots=True)
class StatsReply:
    daemon_pid: int
    protocol_version: int
    endpoint: str
    uptime_s: float
    budget_bytes: int
    reserved_bytes: int
    sessions: int
    messages: int
    errors: int
    reaped_sessions: int
    arenas: list[ArenaStats]
    accounting_ok: bool | None = None  # None when check was not asked for
    accounting_error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PingRequest:
    token: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PingReply:
    daemon_pid: int
    uptime_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class ShutdownRequest:
    token: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ShutdownReply:
    sessions: int  # sessions open when the daemon stopped


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorReply:
    code: int  # an ErrorCode; an int so that codes a newer daemon adds still decode
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class MessageSpec:
    request: type
    reply: type
    session: SessionUse


MESSAGES: dict[Opcode, MessageSpec] = {
    Opcode.HELLO: MessageSpec(HelloRequest, HelloReply, SessionUse.NONE),
    Opcode.BYE: MessageSpec(ByeRequest, ByeReply, SessionUse.REQUIRED),
    Opcode.HEARTBEAT: MessageSpec(HeartbeatRequest, HeartbeatReply, SessionUse.REQUIRED),
    Opcode.ALLOC: MessageSpec(AllocRequest, AllocReply, SessionUse.REQUIRED),
    Opcode.FREE: MessageSpec(FreeRequest, FreeReply, SessionUse.REQUIRED),
    Opcode.RETAIN: MessageSpec(RetainRequest, RetainReply, SessionUse.REQUIRED),
    Opcode.RELEASE: MessageSpec(ReleaseRequest, ReleaseReply, SessionUse.REQUIRED),
    Opcode.LOOKUP: MessageSpec(LookupRequest, LookupReply, SessionUse.REQUIRED),
    Opcode.RETAIN_CHAIN: MessageSpec(RetainChainRequest, RetainChainReply, SessionUse.REQUIRED),
    Opcode.STATS: MessageSpec(StatsRequest, StatsReply, SessionUse.OPTIONAL),
    Opcode.PING: MessageSpec(PingRequest, PingReply, SessionUse.OPTIONAL),
    Opcode.SHUTDOWN: MessageSpec(ShutdownRequest, ShutdownReply, SessionUse.OPTIONAL),
}


def _check_tables() -> None:
    """Import-time guard: every opcode has exactly one message definition and no value is reused."""
    if set(MESSAGES) != set(Opcode):
        missing = {op.name for op in Opcode} - {op.name for op in MESSAGES}
        raise RuntimeError(f"protocol.MESSAGES lacks definitions for {sorted(missing)}")
    for retired, enum_cls in ((RETIRED_OPCODES, Opcode), (RETIRED_ERROR_CODES, ErrorCode)):
        reused = retired & {int(v) for v in enum_cls}
        if reused:
            raise RuntimeError(f"{enum_cls.__name__} reuses retired values {sorted(reused)}")
    if any(not 0 < op <= 0xFF for op in Opcode) or any(not 0 < c <= 0xFFFF for c in ErrorCode):
        raise RuntimeError("opcodes must fit one byte and error codes two, both non-zero")
    requests = [spec.request for spec in MESSAGES.values()]
    if len(set(requests)) != len(requests):
        raise RuntimeError("two opcodes share a request message type")


_check_tables()
