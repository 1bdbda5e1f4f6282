"""KVStoreClient: what a GPU process uses to get an arena from the daemon and manage its pages.

The arena is mapped into this process, so page bytes never cross the socket: the client allocates page ids
and reads/writes the pages through ``client.arena`` (a torch tensor, registered with CUDA when present so
GPU kernels reach it over UVA). Calls are synchronous, thread-safe, and fail with DaemonUnavailable after
timeout_s instead of hanging. A background thread with its own socket heartbeats, so the daemon keeps the
session even while the caller's thread is busy for a long time.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import mmap
import operator
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import psutil
import zmq

from . import codec, cuda_host
from .arena import ArenaGeometry, map_segment, mapping_address, remap_segment
from .config import TOKEN_ENV, GiB, default_endpoint, ipc_path, normalize_endpoint
from .errors import (
    ArenaFailed,
    DaemonUnavailable,
    KVStoreError,
    ProtocolError,
    SessionExpired,
    VersionMismatch,
    error_from_reply,
)
from .protocol import (
    MESSAGES,
    AllocRequest,
    ByeRequest,
    ErrorReply,
    FreeRequest,
    HeartbeatRequest,
    HelloReply,
    HelloRequest,
    LookupRequest,
    Opcode,
    PingReply,
    PingRequest,
    ReleaseRequest,
    RetainChainRequest,
    RetainRequest,
    ShutdownReply,
    ShutdownRequest,
    StatsReply,
    StatsRequest,
    Status,
)

log = logging.getLogger("freekv_kvstore")


class Channel:
    """One DEALER socket with request/reply discipline: every request carries a call id, replies to calls
    whose caller already gave up are dropped, and no call waits longer than its timeout. A request unanswered
    for RESEND_S is sent again (the daemon may have died with it; ZMQ reconnects to its restarted successor),
    at most timeout / RESEND_S times; the daemon answers a resent page call from its memory of the last one,
    so it takes effect once. Not thread-safe."""

    RESEND_S = 0.5
    # A second HELLO would open a second session; a second SHUTDOWN could stop a restarted daemon.
    _SENT_ONCE = frozenset({Opcode.HELLO, Opcode.SHUTDOWN})

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._ids = itertools.count(1)
        self._sock = self._open()

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def call(self, opcode: Opcode, request: Any, session: int = 0, timeout_s: float | None = None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        call_id = next(self._ids) & 0xFFFFFFFF
        if call_id == 0:  # 0 means "no call id" to the daemon, which would not know a resend for one
            call_id = next(self._ids) & 0xFFFFFFFF
        deadline = time.monotonic() + timeout_s
        frames = codec.request_frames(opcode, call_id, session, request)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise self._unavailable(opcode, timeout_s) from None
        resend_at = deadline if opcode in self._SENT_ONCE else time.monotonic() + self.RESEND_S
        while True:
            now = time.monotonic()
            if now >= deadline:
                # A fresh socket drops the copies still queued for a daemon that is down: a call given up on
                # must not take effect when a daemon comes back later.
                self._sock.close(linger=0)
                self._sock = self._open()
                raise self._unavailable(opcode, timeout_s)
            if now >= resend_at:
                try:
                    self._sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:  # the queue to a daemon that is down is full: the deadline decides
                    pass
                resend_at = now + self.RESEND_S
            if not self._sock.poll((min(deadline, resend_at) - now) * 1000):
                continue
            frames_in = self._sock.recv_multipart()
            try:
                _, status, reply_id, body = codec.parse_reply(frames_in)
            except VersionMismatch:
                raise
            except ProtocolError as e:
                log.warning("dropping an unreadable reply from %s: %s", self.endpoint, e)
                continue
            if reply_id != call_id:
                continue  # the late answer to a call that timed out, or to a copy of this one
            if status is Status.ERROR:
                err = codec.decode(ErrorReply, body)
                raise error_from_reply(err.code, err.message)
            return codec.decode(MESSAGES[opcode].reply, body)

    def close(self) -> None:
        self._sock.close(linger=0)

    def _unavailable(self, opcode: Opcode, timeout_s: float) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"kvstore at {self.endpoint} did not answer {opcode.name} within {timeout_s:g} s: is the daemon "
            f"running? start it with `freekv-kvstore --endpoint {self.endpoint}`"
        )


def _check_socket_exists(endpoint: str) -> None:
    path = ipc_path(endpoint)
    if path is not None and not os.path.exists(path):
        raise DaemonUnavailable(
            f"no kvstore listens at {endpoint} (no socket file): start it with `freekv-kvstore --endpoint {endpoint}`"
        )


def _admin_call(endpoint: str | None, opcode: Opcode, request: Any, timeout_s: float) -> Any:
    endpoint = normalize_endpoint(endpoint or default_endpoint())
    _check_socket_exists(endpoint)
    ctx = zmq.Context()
    channel = Channel(ctx, endpoint, timeout_s)
    try:
        return channel.call(opcode, request)
    finally:
        channel.close()
        ctx.term()


def ping_daemon(endpoint: str | None = None, *, token: str | None = None, timeout_s: float = 5.0) -> PingReply:
    return _admin_call(endpoint, Opcode.PING, PingRequest(_token(token)), timeout_s)


def daemon_stats(
    endpoint: str | None = None, *, token: str | None = None, check: bool = False, timeout_s: float = 5.0
) -> StatsReply:
    return _admin_call(endpoint, Opcode.STATS, StatsRequest(_token(token), check), timeout_s)


def shutdown_daemon(endpoint: str | None = None, *, token: str | None = None, timeout_s: float = 5.0) -> ShutdownReply:
    return _admin_call(endpoint, Opcode.SHUTDOWN, ShutdownRequest(_token(token)), timeout_s)


def _token(token: str | None) -> str | None:
    return token if token is not None else os.environ.get(TOKEN_ENV)


class _Heartbeat(threading.Thread):
    """Heartbeats on its own socket: zmq sockets belong to one thread, and this one must not wait for
    the caller's thread (which may be inside a long GPU step) to keep the session alive."""

    def __init__(self, ctx: zmq.Context, endpoint: str, session: int, interval_s: float) -> None:
        super().__init__(name="kvstore-heartbeat", daemon=True)
        self._ctx, self._endpoint, self._session, self._interval = ctx, endpoint, session, interval_s
        self._stopping = threading.Event()
        self.expired: str | None = None

    def run(self) -> None:
        channel = Channel(self._ctx, self._endpoint, self._interval)
        try:
            while not self._stopping.wait(self._interval):
                try:
                    channel.call(Opcode.HEARTBEAT, HeartbeatRequest(), self._session)
                except (SessionExpired, ArenaFailed) as e:
                    self.expired = str(e)
                    log.warning("kvstore heartbeat stopped: %s", e)
                    return
                except KVStoreError as e:  # the daemon is slow or gone; the caller's next call will tell
                    log.debug("kvstore heartbeat missed: %s", e)
        finally:
            channel.close()

    def stop(self) -> None:
        self._stopping.set()
        self.join(self._interval * 2 + 1)


class KVStoreClient:
    """A session with the kvstore daemon and the mapped arena of this client. Use ``connect``."""

    def __init__(self, resources: _Resources, hello_req: HelloRequest, hello: HelloReply,
                 geometry: ArenaGeometry) -> None:
        self._res = resources
        self._channel = resources.channel
        self._lock = threading.RLock()
        self._hello_req = hello_req
        self._hello = hello
        self.geometry = geometry
        self._arena = self._scales = None
        self._closed = False
        # Seconds connect waited for the daemon to pre-fault a new arena, and took to map it and register it with CUDA.
        self.startup_s: dict[str, float] = {}
        # Unmaps and closes the sockets even for a client dropped without close() (holds no ref to self).
        self._finalizer = weakref.finalize(self, cuda_host.when_safe, resources.release)

    @classmethod
    def connect(
        cls,
        endpoint: str | None = None,
        *,
        geometry: ArenaGeometry,
        num_pages: int,
        rank: int = 0,
        client_id: str | None = None,
        token: str | None = None,
        timeout_s: float = 5.0,
        ready_timeout_s: float = 600.0,
        cuda_register: bool | None = None,
    ) -> KVStoreClient:
        """Open a session and map this client's arena of num_pages pages of the given geometry.

        client_id names the arena (default ``rank<rank>``): a restarted process that connects with the same
        client_id and geometry gets the same arena back, with its retained prefixes. The daemon pre-faults a
        new arena before pages can be allocated; connect waits up to ready_timeout_s for that. cuda_register:
        None registers the arena with CUDA when torch sees a GPU; True requires it; False skips it.
        """
        if not isinstance(geometry, ArenaGeometry):
            raise TypeError(f"geometry must be an ArenaGeometry, got {type(geometry).__name__}")
        if not timeout_s > 0 or not ready_timeout_s > 0:
            raise ValueError("timeout_s and ready_timeout_s must be positive")
        endpoint = normalize_endpoint(endpoint or default_endpoint())
        _check_socket_exists(endpoint)
        me = psutil.Process()
        hello_req = HelloRequest(
            client_id=client_id if client_id is not None else f"rank{rank}",
            geometry=geometry,
            num_pages=_int(num_pages),
            rank=_int(rank),
            token=_token(token),
            pid=me.pid,
            hostname=socket.gethostname(),
            proc_start=me.create_time(),
        )
        res = _Resources(endpoint, timeout_s)
        try:
            hello = res.channel.call(Opcode.HELLO, hello_req)
        except BaseException:
            res.release()
            raise
        client = cls(res, hello_req, hello, geometry)
        try:
            res.heartbeat = _Heartbeat(res.ctx, endpoint, hello.session, hello.heartbeat_interval_s)
            res.heartbeat.start()
            t0 = time.monotonic()
            if not hello.ready:
                client._wait_ready(ready_timeout_s)
            t1 = time.monotonic()
            client._attach(cuda_register)
            client.startup_s = {"prefault": t1 - t0, "attach": time.monotonic() - t1}
        except BaseException:
            client.close()
            raise
        return client

    # Session facts.

    @property
    def endpoint(self) -> str:
        return self._channel.endpoint

    @property
    def session(self) -> int:
        return self._hello.session

    @property
    def client_id(self) -> str:
        return self._hello.client_id

    @property
    def num_pages(self) -> int:
        return self._hello.num_pages

    @property
    def page_bytes(self) -> int:
        return self._hello.page_bytes

    @property
    def arena_path(self) -> str:
        return self._hello.arena_path

    @property
    def expired(self) -> str | None:
        """Why the daemon no longer knows this session (seen by the heartbeat), or None while it does."""
        heartbeat = self._res.heartbeat
        return None if heartbeat is None else heartbeat.expired

    @property
    def reattached(self) -> bool:
        """True when this client_id's arena, with its retained prefixes, survived from an earlier session."""
        return self._hello.reattached

    @property
    def buffer(self) -> memoryview:
        """The arena as raw bytes; page i is buffer[i * page_bytes : (i + 1) * page_bytes]."""
        self._check_open()
        return memoryview(self._res.mmap)

    @property
    def arena(self):
        """torch.Tensor [num_pages, num_layers, num_kv_heads, 2, page_size, head_dim] over the shared memory."""
        self._check_open()
        if self._arena is None:
            self._arena, self._scales = arena_views(self._res.mmap, self.geometry, self.num_pages)
        return self._arena

    @property
    def scales(self):
        """The row exponents [num_pages, num_layers, num_kv_heads, 2, page_size] int8 of a scaled (FP8) arena, over
        the same shared memory; None for other dtypes."""
        self.arena
        return self._scales

    # Page calls.

    def alloc(self, request_id: int, n: int) -> list[int]:
        """Append n pages to request_id and return their ids; ArenaFull when there is no room."""
        return self.alloc_many([(request_id, n)])[0]

    def alloc_many(self, requests: Iterable[tuple[int, int]]) -> list[list[int]]:
        """One round trip for several (request_id, n): all are granted or none (ArenaFull)."""
        pairs = [(_int(r), _int(n)) for r, n in requests]
        return self._call(Opcode.ALLOC, AllocRequest([r for r, _ in pairs], [n for _, n in pairs])).pages

    def free(self, request_id: int) -> int:
        """Drop a request; returns how many of its pages went back to the free pool (retained pages stay)."""
        return self.free_many([request_id])

    def free_many(self, request_ids: Iterable[int]) -> int:
        return sum(self._call(Opcode.FREE, FreeRequest([_int(r) for r in request_ids])).freed)

    def retain(self, prefix_key: bytes, pages: Sequence[int]) -> list[int]:
        """Keep pages under prefix_key beyond their request, until release or LRU eviction under pressure.
        Returns the pages that hold the key: the existing ones if the key was already retained."""
        return self.retain_many([(prefix_key, pages)])[0]

    def retain_many(self, entries: Iterable[tuple[bytes, Sequence[int]]]) -> list[list[int]]:
        keys, pages = [], []
        for key, key_pages in entries:
            keys.append(bytes(key))
            pages.append([_int(p) for p in key_pages])
        return self._call(Opcode.RETAIN, RetainRequest(keys, pages)).pages

    def retain_chain(self, prefix_keys: Sequence[bytes], pages: Sequence[int], *, parent: bytes | None = None) -> list[bool]:
        """Retain every key of a chain with one page each (keys[i] holds pages[i], linked to keys[i-1], keys[0] to
        parent): all page-aligned prefixes of a prompt for one page id per key. Returns which keys were new."""
        req = RetainChainRequest([bytes(k) for k in prefix_keys], [_int(p) for p in pages],
                                 None if parent is None else bytes(parent))
        return self._call(Opcode.RETAIN_CHAIN, req).created

    def release(self, prefix_key: bytes) -> bool:
        """Stop retaining prefix_key; False if it was not retained (never, already released, or evicted)."""
        return self.release_many([prefix_key])[0]

    def release_many(self, prefix_keys: Iterable[bytes]) -> list[bool]:
        return self._call(Opcode.RELEASE, ReleaseRequest([bytes(k) for k in prefix_keys])).released

    def lookup(self, prefix_key: bytes, *, request_id: int | None = None) -> list[int] | None:
        """The pages retained under prefix_key, or None. Without request_id they stay valid until this
        client's next alloc (which may evict them); with it, request_id holds them until free(request_id)."""
        hit = self.lookup_longest([prefix_key], request_id=request_id)
        return None if hit is None else hit[1]

    def lookup_longest(
        self, prefix_keys: Sequence[bytes], *, request_id: int | None = None
    ) -> tuple[int, list[int]] | None:
        """(index, pages) of the last retained key of prefix_keys (e.g. the longest cached prefix of a
        prompt, with keys from prefix_keys()), or None. request_id as in lookup."""
        rid = None if request_id is None else _int(request_id)
        reply = self._call(Opcode.LOOKUP, LookupRequest([bytes(k) for k in prefix_keys], rid))
        return None if reply.index < 0 else (reply.index, reply.pages)

    def stats(self, *, check: bool = False) -> dict[str, Any]:
        """The daemon's counters and every arena's accounting; check=True also audits every page."""
        return dataclasses.asdict(self._call(Opcode.STATS, StatsRequest(check=check)))

    def ping(self, timeout_s: float | None = None) -> float:
        """Round-trip time of one control message on this session, in seconds; SessionExpired when the daemon no
        longer knows the session, DaemonUnavailable after timeout_s (default: the client's)."""
        t0 = time.perf_counter()
        self._call(Opcode.PING, PingRequest(), timeout_s)
        return time.perf_counter() - t0

    def reconnect(self, ready_timeout_s: float = 600.0) -> None:
        """Open a new session after this one ended (SessionExpired: reaped, or a daemon restarted without its state):
        HELLO again with the same client_id, geometry and size, and map the new arena over the old one's address, so
        `arena`, `buffer` and every pointer into them (GPU kernels, captured CUDA graphs) reach the new arena. Every
        page of the old session is gone. Nothing may read or write the arena meanwhile (the caller synchronises the
        GPU first)."""
        with self._lock:
            self._check_open()
            res = self._res
            if res.heartbeat is not None:
                res.heartbeat.stop()
                res.heartbeat = None
            hello = res.channel.call(Opcode.HELLO, self._hello_req)
            old = self._hello
            self._hello = hello
            try:
                if (hello.arena_bytes, tuple(hello.shape), hello.dtype) != (old.arena_bytes, tuple(old.shape),
                                                                           old.dtype):
                    raise KVStoreError(f"the kvstore at {self.endpoint} gave client {old.client_id!r} an arena of "
                                       f"{hello.arena_bytes} bytes {hello.shape} {hello.dtype} instead of "
                                       f"{old.arena_bytes} bytes {old.shape} {old.dtype}")
                res.heartbeat = _Heartbeat(res.ctx, self.endpoint, hello.session, hello.heartbeat_interval_s)
                res.heartbeat.start()
                if not hello.ready:
                    self._wait_ready(ready_timeout_s)
                self._remap(hello)
            except BaseException:
                self._end_session(hello.session)
                raise
            log.info("kvstore client %r: new session at %s, arena %s mapped over the lost one", hello.client_id,
                     self.endpoint, hello.arena_path)

    def close(self) -> None:
        """End the session (its requests' pages return to the pool; retained prefixes stay) and unmap."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._res.heartbeat is not None:
                self._res.heartbeat.stop()
            path = ipc_path(self.endpoint)
            if path is None or os.path.exists(path):  # no socket file: the daemon is gone, nobody to tell
                try:
                    self._channel.call(Opcode.BYE, ByeRequest(), self.session, min(self._channel.timeout_s, 1.0))
                except KVStoreError as e:  # the daemon is gone or reaped us already: its reaper frees our pages
                    log.debug("BYE not acknowledged: %s", e)
            self._arena = None  # our view of the mapping; views the caller still holds keep it mapped
            self._finalizer()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"session {self.session:#x}"
        return f"KVStoreClient({self.endpoint}, {self.client_id!r}, {self.num_pages} pages, {state})"

    # Internals.

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError(f"this KVStoreClient for {self.endpoint} is closed")

    def _call(self, opcode: Opcode, request: Any, timeout_s: float | None = None) -> Any:
        with self._lock:
            self._check_open()
            return self._channel.call(opcode, request, self.session, timeout_s)

    def _remap(self, hello: HelloReply) -> None:
        res = self._res
        address = mapping_address(res.mmap)
        registered = res.cuda_ptr is not None
        if registered:  # the registration pins the old pages: drop it around the swap
            cuda_host.unregister(res.cuda_ptr, "arena")
            res.cuda_ptr = None
        try:
            remap_segment(hello.arena_path, hello.arena_bytes, address)
        finally:
            if registered:
                cuda_host.register(address, hello.arena_bytes, "arena")
                res.cuda_ptr = address

    def _end_session(self, session: int) -> None:
        """Best effort BYE for a session opened by reconnect that could not be put to use."""
        if self._res.heartbeat is not None:
            self._res.heartbeat.stop()
            self._res.heartbeat = None
        try:
            self._channel.call(Opcode.BYE, ByeRequest(), session, min(self._channel.timeout_s, 1.0))
        except KVStoreError as e:
            log.debug("BYE of the unused session not acknowledged: %s", e)

    def _wait_ready(self, ready_timeout_s: float) -> None:
        deadline = time.monotonic() + ready_timeout_s
        delay = 0.01
        while True:
            if self._call(Opcode.HEARTBEAT, HeartbeatRequest()).ready:
                return
            if time.monotonic() + delay > deadline:
                raise DaemonUnavailable(
                    f"the kvstore at {self.endpoint} did not finish pre-faulting this client's "
                    f"{self._hello.arena_bytes / GiB:.2f} GiB arena within {ready_timeout_s:g} s (ready_timeout_s)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _attach(self, cuda_register: bool | None) -> None:
        res = self._res
        res.mmap = map_segment(self._hello.arena_path, self._hello.arena_bytes)
        if cuda_register is False:
            return
        import torch

        if not torch.cuda.is_available():
            if cuda_register:
                raise RuntimeError("cuda_register=True but torch sees no CUDA device")
            return
        ptr = self.arena.data_ptr()
        cuda_host.register(ptr, self._hello.arena_bytes, "arena")
        res.cuda_ptr = ptr


class _Resources:
    """Everything a client must give back, kept apart from the client so a finalizer can release it."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.ctx = zmq.Context()
        self.channel = Channel(self.ctx, endpoint, timeout_s)
        self.heartbeat: _Heartbeat | None = None
        self.mmap: mmap.mmap | None = None
        self.cuda_ptr: int | None = None

    def release(self) -> None:
        heartbeat_done = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
            heartbeat_done = not self.heartbeat.is_alive()
        if self.cuda_ptr is not None:
            cuda_host.unregister(self.cuda_ptr, "arena")
            self.cuda_ptr = None
        if self.mmap is not None:
            try:
                self.mmap.close()
            except BufferError:  # views of the arena are still alive: it is unmapped when the last one dies
                log.debug("arena views still alive; the mapping goes away with them")
            self.mmap = None
        self.channel.close()
        if heartbeat_done:  # term() would wait forever for a socket still open in a stuck thread
            self.ctx.term()


def _int(value: Any) -> int:
    """Python, numpy and 0-d torch integers alike (msgpack only packs Python ints); bools and floats refused."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"expected an integer, got {value!r}")
    return operator.index(value)


def arena_views(raw, geometry: ArenaGeometry, num_pages: int):
    """(pages [P, L, H, 2, p, D], exponents [P, L, H, 2, p] int8 or None) over raw, P * page_bytes bytes (a uint8
    tensor or a buffer); for a scaled dtype both are strided views of the one page-major byte range."""
    import torch

    if not isinstance(raw, torch.Tensor):
        raw = torch.frombuffer(raw, dtype=torch.uint8)
    g = geometry
    dtype = getattr(torch, g.dtype)
    if not g.scaled:
        return raw.view(dtype).view(g.shape(num_pages)), None
    paged = raw[: num_pages * g.page_bytes].view(num_pages, g.page_bytes)
    pages = paged[:, : g.value_bytes].view(dtype).unflatten(1, g.shape(num_pages)[1:])
    exponents = paged[:, g.value_bytes:].view(torch.int8).unflatten(1, g.shape(num_pages)[1:5])
    return pages, exponents
