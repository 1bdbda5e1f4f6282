"""The daemon's state and its answer to every request, without sockets: arenas per client, sessions,
the arena budget, liveness reaping. server.py feeds it decoded requests and sends back what it returns.

A client (one GPU rank) is known by its client_id and owns one arena. A session is one connection of that
client: it starts with HELLO and ends with BYE, when the client stops heartbeating for client_timeout_s, or
at once when the daemon sees the client's process is gone (same host only). When a session ends, its
requests' pages return to the pool; retained prefixes stay in the arena, so the next session of the same
client_id (a restarted server) finds them with LOOKUP. An arena without retained prefixes is unlinked when
its session ends; detached arenas with prefixes are unlinked, least recently used first, when a new arena
needs their budget.

Every change of that state is first appended to the store's journal (journal.py) as a record, then applied by
the same code that replays it: a daemon restarted on the same endpoint re-adopts the arenas, page tables and
sessions of the one before it, and its clients go on with their sessions and pages. The last page call of each
session is remembered, so a client resending a call whose reply was lost gets that reply, not a second effect.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hmac
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from . import codec
from .arena import ArenaGeometry, Segment, free_shm_bytes, process_alive, process_start_ms
from .config import DaemonConfig, GiB
from .errors import (
    ArenaFailed,
    ArenaNotReady,
    BudgetExceeded,
    ClientIdInUse,
    HostMemoryExhausted,
    KVStoreError,
    LimitExceeded,
    SessionExpired,
    Unauthorized,
    error_from_reply,
)
from .journal import Journal, store_segments
from .protocol import (
    MESSAGES,
    PROTOCOL_VERSION,
    AllocReply,
    ArenaStats,
    ByeReply,
    FreeReply,
    HeartbeatReply,
    HelloReply,
    HelloRequest,
    LookupReply,
    Opcode,
    PingReply,
    ReleaseReply,
    RetainChainReply,
    RetainReply,
    SessionUse,
    ShutdownReply,
    StatsReply,
)
from .store import PageTable

log = logging.getLogger("freekv_kvstore")

# Calls on a session's page table: journaled with their call id, and answered again when resent.
PAGE_CALLS = frozenset({Opcode.ALLOC, Opcode.FREE, Opcode.RETAIN, Opcode.RELEASE, Opcode.LOOKUP, Opcode.RETAIN_CHAIN})
_COMPACT_BYTES = 1 << 20  # the journal is rewritten as one snapshot once its records pass this (and 4x the last)
# ...when the daemon is idle; while it serves, only past this many times that. A snapshot is built between calls and
# holds the call after it (~70 ms at 80K retained keys on a 2-core host), so a burst of prompts defers it.
_COMPACT_BUSY_FACTOR = 4


@dataclasses.dataclass(eq=False, slots=True)
class Arena:
    client_id: str
    rank: int
    geometry: ArenaGeometry
    segment: Segment
    table: PageTable
    ready: bool = False
    failure: str | None = None
    prefault: concurrent.futures.Future | None = None
    session: Session | None = None
    idle_since: float = 0.0


@dataclasses.dataclass(eq=False, slots=True)
class Session:
    id: int
    arena: Arena
    last_seen: float
    pid: int | None = None  # watched for death when the client runs on this host in this pid namespace
    pid_start_ms: int | None = None
    last_call: tuple[int, Opcode, object] | None = None  # (call id, opcode, reply or KVStoreError) of a page call


class KVStoreCore:
    def __init__(self, config: DaemonConfig, endpoint: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.endpoint = endpoint
        self.stop_requested = False
        self.messages = 0
        self.errors = 0
        self.reaped_sessions = 0
        self._clock = clock
        self._started = clock()
        self._hostname = socket.gethostname()
        self._arenas: dict[str, Arena] = {}
        self._sessions: dict[int, Session] = {}
        # One arena pre-faults at a time; each already spreads its work over prefault_threads.
        self._prefaulter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-prefault")
        self._closing = threading.Event()  # stops a running pre-fault, so shutdown never waits for one
        parent = config.parent_pid
        self._parent_start = process_start_ms(parent) if parent is not None else None
        self._journal = Journal.open(config.shm_dir, endpoint, parent)
        try:
            self.epoch = self._adopt()
        except BaseException:
            self._prefaulter.shutdown(wait=False, cancel_futures=True)
            self._journal.close()  # what this daemon could not adopt stays as it was
            raise

    def handle(self, opcode: Opcode, session_id: int, request: object, call_id: int = 0) -> object:
        """Answer one request. call_id (0: none) lets a page call resent after a lost reply be answered again."""
        use = MESSAGES[opcode].session
        session = self._sessions.get(session_id) if session_id else None
        if session is None and (use is SessionUse.REQUIRED or (session_id and use is SessionUse.OPTIONAL)):
            raise SessionExpired(
                f"session {session_id:#x} is not open on the kvstore at {self.endpoint}: it was closed, reaped "
                f"after {self.config.client_timeout_s:g} s without a heartbeat, or the daemon restarted; "
                "connect again"
            )
        if session is not None:
            session.last_seen = self._clock()
        if opcode not in PAGE_CALLS:
            return getattr(self, f"_on_{opcode.name.lower()}")(session, request)
        last = session.last_call
        if not (call_id and last is not None and last[:2] == (call_id, opcode)):
            self._table(session)  # a failed or unready arena refuses before anything is journaled
            last = self._commit(["call", session.id, call_id, int(opcode), codec.encode(request)], request)
        result = last[2]
        if isinstance(result, KVStoreError):
            raise type(result)(str(result))
        return result

    def tick(self, idle: bool = True) -> None:
        """Housekeeping between messages: finished pre-faults, dead clients, a dead parent, the journal's compaction
        (deferred while not idle)."""
        now = self._clock()
        for arena in list(self._arenas.values()):
            if arena.prefault is not None and arena.prefault.done():
                self._finish_prefault(arena)
        for session in list(self._sessions.values()):
            silent = now - session.last_seen
            if silent > self.config.client_timeout_s:
                self._end_session(session, f"no message for {silent:.1f} s")
                self.reaped_sessions += 1
            elif session.pid is not None and not process_alive(session.pid, session.pid_start_ms):
                self._end_session(session, f"its process {session.pid} is gone")
                self.reaped_sessions += 1
        parent = self.config.parent_pid
        if parent is not None and (self._parent_start is None or not process_alive(parent, self._parent_start)):
            log.info("parent process %d is gone: stopping", parent)
            self.stop_requested = True
        journal = self._journal
        due = max(_COMPACT_BYTES, 4 * journal.snapshot_bytes)
        if journal.log_bytes > (due if idle else _COMPACT_BUSY_FACTOR * due):
            journal.compact(self.epoch, self._snapshot())

    def close(self) -> None:
        """A clean stop: every arena and the journal go (a crash leaves them for the next daemon to adopt)."""
        self._closing.set()
        self._prefaulter.shutdown(wait=False, cancel_futures=True)
        for arena in self._arenas.values():
            arena.segment.unlink()
        self._arenas.clear()
        self._sessions.clear()
        self._journal.discard()

    # Handlers, one per opcode (checked at import below).

    def _on_hello(self, session: Session | None, req: HelloRequest) -> HelloReply:
        self._check_token(req.token, None, "HELLO")
        now = self._clock()
        arena = self._arenas.get(req.client_id)
        if arena is not None and arena.session is not None:
            old = arena.session
            if old.pid is not None and not process_alive(old.pid, old.pid_start_ms):
                self._end_session(old, f"its process {old.pid} is gone")
                arena = self._arenas.get(req.client_id)  # gone unless it holds retained prefixes
            else:
                left = self.config.client_timeout_s - (now - old.last_seen)
                raise ClientIdInUse(
                    f"client_id {req.client_id!r} is in use by a live session (pid {old.pid or 'unknown'}, heard "
                    f"{now - old.last_seen:.1f} s ago); stop that process or pick another client_id"
                    + (f" (if it is dead, it is reaped within {left:.1f} s)" if old.pid is None else "")
                )
        if arena is not None and (
            arena.geometry != req.geometry or arena.table.num_pages != req.num_pages or arena.failure
        ):
            log.warning(
                "client %r returns with a different arena (%s x %d pages): dropping its old arena and %d prefixes",
                req.client_id, req.geometry, req.num_pages, arena.table.num_prefixes,
            )  # fmt: skip
            self._drop_arena(arena)
            arena = None
        reattached = arena is not None
        if arena is None:
            arena = self._create_arena(req)
        pid, pid_start = self._watchable_pid(req)
        session = self._commit(["open", self._new_session_id(), req.client_id, req.rank, pid, pid_start])
        log.info(
            "session %#x: client %r rank %d pid %s, %s arena of %d pages (%.2f GiB)",
            session.id, req.client_id, req.rank, req.pid or "?", "reattached" if reattached else "new",
            req.num_pages, arena.segment.size / GiB,
        )  # fmt: skip
        geom = arena.geometry
        return HelloReply(
            session=session.id,
            client_id=req.client_id,
            arena_path=arena.segment.path,
            arena_bytes=arena.segment.size,
            num_pages=arena.table.num_pages,
            page_bytes=geom.page_bytes,
            shape=list(geom.shape(arena.table.num_pages)),
            dtype=geom.dtype,
            ready=arena.ready,
            reattached=reattached,
            retained_prefixes=arena.table.num_prefixes,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            client_timeout_s=self.config.client_timeout_s,
            daemon_pid=os.getpid(),
        )

    def _on_bye(self, session: Session, req: object) -> ByeReply:
        return ByeReply(self._end_session(session, "the client said goodbye"))

    def _on_heartbeat(self, session: Session, req: object) -> HeartbeatReply:
        if session.arena.failure:
            raise ArenaFailed(session.arena.failure)
        return HeartbeatReply(ready=session.arena.ready)

    def _on_alloc(self, session: Session, req) -> AllocReply:
        return AllocReply(self._table(session).alloc(req.request_ids, req.counts))

    def _on_free(self, session: Session, req) -> FreeReply:
        return FreeReply(*self._table(session).free(req.request_ids))

    def _on_retain(self, session: Session, req) -> RetainReply:
        return RetainReply(*self._table(session).retain(req.keys, req.pages))

    def _on_retain_chain(self, session: Session, req) -> RetainChainReply:
        return RetainChainReply(self._table(session).retain_chain(req.keys, req.pages, req.parent))

    def _on_release(self, session: Session, req) -> ReleaseReply:
        return ReleaseReply(*self._table(session).release(req.keys))

    def _on_lookup(self, session: Session, req) -> LookupReply:
        return LookupReply(*self._table(session).lookup(req.keys, req.request_id))

    def _on_stats(self, session: Session | None, req) -> StatsReply:
        self._check_token(req.token, session, "STATS")
        now = self._clock()
        arenas = [self._arena_stats(a, now) for a in self._arenas.values()]
        ok = error = None
        if req.check:
            problems = [f"{a.client_id}: {p}" for a in self._arenas.values() if (p := a.table.audit())]
            ok, error = not problems, "; ".join(problems) or None
        return StatsReply(
            daemon_pid=os.getpid(),
            protocol_version=PROTOCOL_VERSION,
            endpoint=self.endpoint,
            uptime_s=now - self._started,
            budget_bytes=self.config.arena_bytes,
            reserved_bytes=self._reserved_bytes(),
            sessions=len(self._sessions),
            messages=self.messages,
            errors=self.errors,
            reaped_sessions=self.reaped_sessions,
            arenas=arenas,
            accounting_ok=ok,
            accounting_error=error,
        )

    def _on_ping(self, session: Session | None, req) -> PingReply:
        self._check_token(req.token, session, "PING")
        return PingReply(daemon_pid=os.getpid(), uptime_s=self._clock() - self._started)

    def _on_shutdown(self, session: Session | None, req) -> ShutdownReply:
        self._check_token(req.token, None, "SHUTDOWN")  # a session is not enough: clients may not stop a shared daemon
        log.info("SHUTDOWN requested with %d sessions open", len(self._sessions))
        self.stop_requested = True
        return ShutdownReply(sessions=len(self._sessions))

    # Helpers.

    def _check_token(self, token: str | None, session: Session | None, what: str) -> None:
        expected = self.config.token
        if expected is None or session is not None:
            return
        if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
            raise Unauthorized(f"{what} refused: this kvstore requires its token (--token) and the one given "
                               f"{'is missing' if token is None else 'is wrong'}")

    def _table(self, session: Session) -> PageTable:
        arena = session.arena
        if arena.failure:
            raise ArenaFailed(arena.failure)
        if not arena.ready:
            raise ArenaNotReady(
                f"the arena of client {arena.client_id!r} ({arena.segment.size / GiB:.2f} GiB) is still being "
                "pre-faulted; KVStoreClient.connect waits for it"
            )
        return arena.table

    def _new_session_id(self) -> int:
        while True:  # random, so a session id is no handle another connection can guess
            sid = secrets.randbits(63)  # int64 on the wire
            if sid and sid not in self._sessions:
                return sid

    def _watchable_pid(self, req: HelloRequest) -> tuple[int | None, int | None]:
        """The client's pid if it names a process of this host and pid namespace: its start time must match
        what the client measured (a client in another container would have a different process here)."""
        if req.pid <= 0 or req.hostname != self._hostname:
            return None, None
        start = process_start_ms(req.pid)
        if start is None or abs(start - req.proc_start * 1000) > 20:
            return None, None
        return req.pid, start

    def _reserved_bytes(self) -> int:
        return sum(a.segment.size for a in self._arenas.values())

    def _create_arena(self, req: HelloRequest) -> Arena:
        size = req.num_pages * req.geometry.page_bytes
        self._make_room(req, size)
        free = free_shm_bytes(self.config.shm_dir)
        if size > free:
            raise HostMemoryExhausted(
                f"{self.config.shm_dir} has {free / GiB:.2f} GiB free but the arena needs {size / GiB:.2f} GiB; "
                "enlarge it (mount -o remount,size=...) or ask for fewer pages"
            )
        path = f"{self._journal.prefix}{next(self._segment_seq)}"
        try:
            segment = Segment.create(path, size)
        except OSError as e:
            raise HostMemoryExhausted(f"cannot create arena {path}: {e}") from None
        ready = size <= self.config.sync_prefault_bytes
        try:
            if ready:
                try:
                    segment.prefault(self.config.prefault_threads)
                except OSError as e:
                    raise HostMemoryExhausted(f"cannot reserve {size} bytes for arena {path}: {e}") from None
            geom = req.geometry
            arena = self._commit(["arena", req.client_id, req.rank, list(dataclasses.astuple(geom)), req.num_pages,
                                  path, size, segment.arena_id, ready])  # fmt: skip
        except BaseException:
            segment.unlink()
            raise
        if not ready:
            arena.prefault = self._prefaulter.submit(segment.prefault, self.config.prefault_threads, self._closing)
        return arena

    def _make_room(self, req: HelloRequest, size: int) -> None:
        """Fit a new arena into the budget and the client limit, dropping detached arenas (LRU) only if that
        is enough; otherwise refuse without dropping anything."""
        budget, reserved = self.config.arena_bytes, self._reserved_bytes()
        detached = sorted((a for a in self._arenas.values() if a.session is None), key=lambda a: a.idle_since)
        reclaimable = sum(a.segment.size for a in detached)
        if reserved - reclaimable + size > budget:
            others = len(self._arenas) - len(detached)
            raise BudgetExceeded(
                f"client {req.client_id!r} asks for {size / GiB:.3f} GiB ({req.num_pages} pages of "
                f"{req.geometry.page_bytes} bytes) but only {max(0, budget - reserved + reclaimable) / GiB:.3f} GiB "
                f"of the {budget / GiB:.3f} GiB budget is available ({others} connected clients hold "
                f"{(reserved - reclaimable) / GiB:.3f} GiB); ask for fewer pages or start the daemon with a larger "
                "--arena-gb"
            )
        if len(self._arenas) - len(detached) >= self.config.max_clients:
            raise LimitExceeded(f"the kvstore already serves {self.config.max_clients} clients")
        for arena in detached:
            if reserved + size <= budget and len(self._arenas) < self.config.max_clients:
                break
            log.info("dropping detached arena of %r (%d prefixes) to make room", arena.client_id,
                     arena.table.num_prefixes)  # fmt: skip
            reserved -= arena.segment.size
            self._drop_arena(arena)

    def _drop_arena(self, arena: Arena) -> None:
        self._commit(["drop", arena.client_id])
        arena.segment.unlink()  # clients that still map it keep their memory until they unmap

    def _finish_prefault(self, arena: Arena) -> None:
        error = arena.prefault.exception()
        arena.prefault = None
        if error is None:
            self._commit(["ready", arena.client_id])
            log.info("arena of %r is pre-faulted (%.2f GiB)", arena.client_id, arena.segment.size / GiB)
            return
        size = arena.segment.size / GiB
        self._commit(["failed", arena.client_id, f"pre-faulting the {size:.2f} GiB arena of {arena.client_id!r} "
                      f"failed: {error}"])  # fmt: skip
        log.error("%s", arena.failure)
        arena.segment.unlink()

    def _end_session(self, session: Session, why: str) -> int:
        pooled = self._commit(["end", session.id])
        arena = session.arena
        kept = arena.table.num_prefixes
        if not kept and self._arenas.get(arena.client_id) is arena:
            self._drop_arena(arena)  # nothing worth keeping: give the memory back to the host
        log.info("session %#x of %r ended (%s): %d pages back in the pool, %d prefixes kept",
                 session.id, arena.client_id, why, pooled, kept)  # fmt: skip
        return pooled

    # The journal: every change of arenas and sessions is a record, appended before it is applied; _apply is
    # all that changes them, live and when a restarted daemon replays the journal.

    def _commit(self, record: list, request: object = None) -> object:
        self._journal.append(record)
        return self._apply(record, request)

    def _apply(self, record: list, request: object = None) -> object:
        kind, *args = record
        if kind not in _RECORDS:
            raise ValueError(f"unknown journal record {kind!r}")
        if kind == "call":
            return self._apply_call(*args, request=request)
        return getattr(self, f"_apply_{kind}")(*args)

    def _apply_arena(self, client_id, rank, geom, num_pages, path, size, arena_id, ready) -> Arena:
        table = PageTable(num_pages, **self._table_limits())
        arena = Arena(client_id, rank, ArenaGeometry(*geom), Segment(path, size, arena_id), table, ready=ready)
        arena.idle_since = self._clock()
        self._arenas[client_id] = arena
        return arena

    def _apply_ready(self, client_id) -> None:
        self._arenas[client_id].ready = True

    def _apply_failed(self, client_id, failure) -> None:
        self._arenas[client_id].failure = failure

    def _apply_drop(self, client_id) -> None:
        del self._arenas[client_id]

    def _apply_open(self, session_id, client_id, rank, pid, pid_start) -> Session:
        arena = self._arenas[client_id]
        arena.rank = rank
        session = Session(session_id, arena, self._clock(), pid, pid_start)
        arena.session = session
        self._sessions[session_id] = session
        return session

    def _apply_end(self, session_id) -> int:
        arena = self._sessions.pop(session_id).arena
        arena.session = None
        arena.idle_since = self._clock()
        return arena.table.free_all_requests()

    def _apply_call(self, session_id, call_id, opcode, body, request=None) -> tuple[int, Opcode, object]:
        session = self._sessions[session_id]
        op = Opcode(opcode)
        if request is None:
            request = codec.decode(MESSAGES[op].request, body)
        try:
            result = getattr(self, f"_on_{op.name.lower()}")(session, request)
        except KVStoreError as e:  # refused without a change (the table checks before it acts): so is a replay
            result = e
        session.last_call = (call_id, op, result)
        return session.last_call

    def _table_limits(self) -> dict[str, int]:
        config = self.config
        return {"max_requests": config.max_requests_per_client, "max_prefixes": config.max_prefixes_per_client}

    def _snapshot(self) -> dict:
        arenas = [
            [a.client_id, a.rank, list(dataclasses.astuple(a.geometry)), a.table.num_pages, a.segment.path,
             a.segment.size, a.segment.arena_id, a.ready, a.failure, a.table.state()]
            for a in self._arenas.values()
        ]  # fmt: skip
        sessions = [[s.id, s.arena.client_id, s.pid, s.pid_start_ms, _pack_call(s.last_call)]
                    for s in self._sessions.values()]  # fmt: skip
        return {"endpoint": self.endpoint, "arenas": arenas, "sessions": sessions}

    def _restore(self, snapshot: dict) -> None:
        for *fields, failure, table in snapshot["arenas"]:
            arena = self._apply_arena(*fields)
            arena.failure = failure
            arena.table = PageTable.from_state(arena.table.num_pages, table, **self._table_limits())
        for session_id, client_id, pid, pid_start, last_call in snapshot["sessions"]:
            session = self._apply_open(session_id, client_id, self._arenas[client_id].rank, pid, pid_start)
            session.last_call = _unpack_call(last_call)

    def _adopt(self) -> int:
        """Re-adopt what the last daemon of this endpoint left (nothing for a new store); return the new epoch."""
        journal = self._journal
        epoch, snapshot, records = journal.load()
        if snapshot is not None:
            try:
                self._restore(snapshot)
                for record in records:
                    self._apply(record)
            except (KVStoreError, ValueError, KeyError, TypeError, IndexError) as e:
                raise journal.rejected(f"its state does not replay ({type(e).__name__}: {e})") from None
            self._check_adopted(snapshot["endpoint"])
        segments = store_segments(journal.prefix)
        known = {a.segment.path for a in self._arenas.values()}
        for path in sorted(set(segments.values()) - known):
            log.warning("removing %s: no journaled arena (its daemon died while creating or dropping it)", path)
            os.unlink(path)
        self._segment_seq = itertools.count(max(segments, default=-1) + 1)
        journal.compact(epoch + 1, self._snapshot())
        for arena in self._arenas.values():
            if not arena.ready and not arena.failure:  # its pre-fault was cut short; faulting in keeps the bytes
                arena.prefault = self._prefaulter.submit(arena.segment.prefault, self.config.prefault_threads,
                                                         self._closing)  # fmt: skip
        if snapshot is not None:
            log.warning(
                "re-adopted the kvstore state of %s at epoch %d: %d arenas (%.2f GiB), %d sessions, %d requests",
                self.endpoint, epoch + 1, len(self._arenas), self._reserved_bytes() / GiB, len(self._sessions),
                sum(a.table.num_requests for a in self._arenas.values()),
            )  # fmt: skip
        return epoch + 1

    def _check_adopted(self, endpoint: str) -> None:
        """Refuse arenas this daemon cannot take as they are: another endpoint's journal, files that are not the
        journaled arenas, or more arena bytes than this daemon's budget."""
        journal = self._journal
        if endpoint != self.endpoint:
            raise journal.rejected(f"the journal belongs to {endpoint}")
        for arena in self._arenas.values():
            if arena.failure:
                continue  # its file was removed when its pre-fault failed
            seg = arena.segment
            if seg.size != arena.table.num_pages * arena.geometry.page_bytes:
                raise journal.rejected(f"the arena of {arena.client_id!r} has {seg.size} bytes, not "
                                       f"{arena.table.num_pages} pages of {arena.geometry}")  # fmt: skip
            if not seg.path.startswith(journal.prefix):
                raise journal.rejected(f"the arena of {arena.client_id!r} at {seg.path} is not a file of this store")
            problem = seg.mismatch()
            if problem:
                raise journal.rejected(f"the arena of {arena.client_id!r} is not the journaled one: {problem}")
        reserved = self._reserved_bytes()
        if reserved > self.config.arena_bytes:
            raise journal.rejected(f"its arenas take {reserved / GiB:.3f} GiB, more than the budget of "
                                   f"{self.config.arena_bytes / GiB:.3f} GiB (--arena-gb)")  # fmt: skip

    def _arena_stats(self, arena: Arena, now: float) -> ArenaStats:
        t = arena.table
        idle = now - (arena.session.last_seen if arena.session else arena.idle_since)
        return ArenaStats(
            client_id=arena.client_id,
            rank=arena.rank,
            attached=arena.session is not None,
            ready=arena.ready,
            arena_path=arena.segment.path,
            num_pages=t.num_pages,
            page_bytes=arena.geometry.page_bytes,
            free_pages=t.free_pages,
            used_pages=t.used_pages,
            cached_pages=t.cached_pages,
            requests=t.num_requests,
            prefixes=t.num_prefixes,
            evicted_prefixes=t.evicted_prefixes,
            idle_s=idle,
        )


_RECORDS = frozenset({"arena", "ready", "failed", "drop", "open", "end", "call"})


def _pack_call(last_call: tuple[int, Opcode, object] | None) -> list | None:
    if last_call is None:
        return None
    call_id, op, result = last_call
    if isinstance(result, KVStoreError):
        return [call_id, int(op), False, int(result.code), str(result)]
    return [call_id, int(op), True, codec.encode(result)]


def _unpack_call(packed: list | None) -> tuple[int, Opcode, object] | None:
    if packed is None:
        return None
    call_id, opcode, ok, *result = packed
    op = Opcode(opcode)
    if ok:
        return call_id, op, codec.decode(MESSAGES[op].reply, result[0])
    return call_id, op, error_from_reply(*result)


def _check_handlers() -> None:
    missing = [op.name for op in Opcode if not callable(getattr(KVStoreCore, f"_on_{op.name.lower()}", None))]
    if missing:
        raise RuntimeError(f"KVStoreCore has no handler for {missing}")


_check_handlers()
