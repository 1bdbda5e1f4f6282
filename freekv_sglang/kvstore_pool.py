"""The engine's host pool backed by the kvstore daemon's shared-memory arena, and what it does when the daemon fails.

The pool is in one of three states:
- up: page calls go to the daemon.
- down: the daemon did not answer a call within timeout_s (its client already resent it meanwhile, so a supervised
  daemon that restarted and re-adopted its state would have answered), or a daemon of another protocol version
  answers. Pages already held stay usable: they live in this process's mapping of the arena, which nothing else
  writes, and a daemon restarted on the endpoint re-adopts their table. New pages cannot be had: reserve/alloc fail
  at once with HostPagesUnavailable, except for one probe (a PING of PROBE_TIMEOUT_S) every PROBE_EVERY_S, which
  brings the pool back up and sends the frees that waited.
- lost: the daemon no longer knows this session (it restarted without the dead one's state, or reaped it): every
  page held is gone. Owners that held pages then never get pages again (they must end); a later reserve/alloc for a
  new owner opens a new session whose arena is mapped at the old address (KVStoreClient.reconnect, with the GPU
  synchronised first, as captured CUDA graphs hold that address).

Pages can be reserved ahead of a step (reserve), from the scheduler, where a failure can still take the request out
of the batch; the engine's alloc during the step then takes them without a daemon call.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from freekv_kvstore import ArenaFull, ArenaGeometry, DaemonUnavailable, KVStoreClient, KVStoreError, SessionExpired
from freekv_kvstore.errors import ArenaFailed, VersionMismatch

logger = logging.getLogger(__name__)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
PROBE_EVERY_S = 1.0  # while down or lost: how often a call may try the daemon again
PROBE_TIMEOUT_S = 0.5


def stable_client_id(runner, rank: int, instance: int = 0) -> str:
    """The kvstore client id of a server rank: the model, port and TP rank (not the pid), so a restarted server
    re-attaches its arena and the prefixes it retained. instance > 0 (a second backend in one process) is appended."""
    server_args = getattr(runner, "server_args", None)
    model = str(getattr(server_args, "model_path", None) or "model")
    digest = hashlib.blake2b(model.encode(), digest_size=4).hexdigest()
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in model.rstrip("/").rsplit("/", 1)[-1])[:64]
    port = getattr(server_args, "port", None)
    return f"{name}-{digest}-port{port}-tp{rank}" + (f"-{instance}" if instance else "")


class HostPagesUnavailable(RuntimeError):
    """A request cannot get (or keep) its host pages. reason: the label of the aborted-requests metric."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class KVStoreHostPool:
    """Pages come from the daemon (ALLOC/FREE per request); the GPU reads and writes the mapped arena."""

    def __init__(self, endpoint: str, *, num_layers: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, num_pages: int, rank: int, client_id: str, token: str | None = None,
                 timeout_s: float = 5.0):
        if dtype not in _DTYPES:
            raise ValueError(f"kvstore arenas hold {sorted(_DTYPES.values())}, not {dtype}")
        geom = ArenaGeometry(num_layers=num_layers, num_kv_heads=num_kv_heads, page_size=page_size,
                             head_dim=head_dim, dtype=_DTYPES[dtype])
        self.client = KVStoreClient.connect(endpoint, geometry=geom, num_pages=num_pages, rank=rank,
                                            client_id=client_id, token=token, timeout_s=timeout_s)
        self.endpoint = self.client.endpoint
        self.arena = self.client.arena  # its address never changes, even across a new session
        self.num_pages = self.client.num_pages
        self.state = "up"
        self._problem: HostPagesUnavailable | None = None  # why the pool is down or lost
        self._loss: HostPagesUnavailable | None = None  # why the pages of the last lost session are gone
        self._next_probe = 0.0
        self._epoch = 0  # sessions lost so far
        self._given: dict[int, int] = {}  # owner -> pages the daemon gave it (the engine's and the reserved)
        self._reserved: dict[int, list[int]] = {}  # owner -> pages given but not yet taken by the engine
        # owner -> pages given that are not the engine's logical pages past the sink (a shared or exported prefix's
        # sink pages): reserve does not count them.
        self._extra: dict[int, int] = {}
        self._epoch_of: dict[int, int] = {}  # owner -> the epoch of its pages
        self._pending_free: set[int] = set()  # owners freed while down
        # Owners whose ALLOC timed out: a stopped daemon may still carry it out, so their FREE is sent all the same.
        self._uncertain: set[int] = set()
        # Pages this pool holds, counted from the daemon's answers (no call of its own: read by the metrics).
        self.used_pages = 0

    # ---- what the engine calls ----------------------------------------------------------------

    def alloc(self, owner: int, n: int) -> list[int]:
        reserved = self._reserved.get(owner, [])
        if len(reserved) < n:
            reserved = reserved + self._get(owner, n - len(reserved))
        pages, self._reserved[owner] = reserved[:n], reserved[n:]
        return pages

    def alloc_extra(self, owner: int, n: int) -> list[int]:
        """Pages beyond the engine's logical pages past the sink (export_prefix's sink pages): from the daemon, not
        from the owner's reservation, and not counted against it."""
        pages = self._get(owner, n)
        self._extra[owner] = self._extra.get(owner, 0) + len(pages)
        return pages

    # ---- shared prefixes (docs/radix.md) ---------------------------------------------------------

    def lookup_prefix(self, owner: int, keys, *, sink_pages: int) -> list[int]:
        """Host pages of the longest prefix retained under keys (prefix_keys of the prompt), pinned for owner until
        free(owner); [] on a miss or while the daemon cannot be used (the request then prefills from scratch). The
        pages past the first sink_pages count as the owner's for reserve (the engine maps them as its logical pages
        past the sink)."""
        self._check_heartbeat()
        if self.owner_lost(owner) or (self.state != "up" and not self._recover()):
            return []
        try:
            hit = self.client.lookup_longest(keys, request_id=owner)
        except KVStoreError as e:
            if isinstance(e, DaemonUnavailable):
                self._uncertain.add(owner)  # it may have pinned pages: free(owner) sends a FREE all the same
            if not self._failed(e):
                logger.error("FreeKV: kvstore LOOKUP at %s failed: %s", self.endpoint, e)
            return []
        if hit is None:
            return []
        pages = hit[1]
        self._given[owner] = self._given.get(owner, 0) + len(pages)
        self._extra[owner] = self._extra.get(owner, 0) + min(sink_pages, len(pages))
        self._epoch_of.setdefault(owner, self._epoch)
        self.used_pages += len(pages)
        return pages

    def retain_prefix(self, key: bytes, pages) -> bool:
        """Retain pages (export_prefix's) under key; False when the daemon cannot be used or refuses (the prefix is
        then not cached)."""
        if self.state != "up":
            return False
        try:
            self.client.retain(key, pages)
        except KVStoreError as e:
            if not self._failed(e):
                logger.warning("FreeKV: kvstore RETAIN at %s failed: %s", self.endpoint, e)
            return False
        return True

    def retain_chain(self, keys, pages) -> bool:
        """Retain pages[i] under keys[i] as one chain (RETAIN_CHAIN: every page-aligned prefix for one page id per
        key); False when the daemon cannot be used or refuses (the prefix is then not cached)."""
        if self.state != "up":
            return False
        try:
            self.client.retain_chain(keys, pages)
        except KVStoreError as e:
            if not self._failed(e):
                logger.warning("FreeKV: kvstore RETAIN_CHAIN at %s failed: %s", self.endpoint, e)
            return False
        return True

    def free(self, owner: int) -> int:
        """Drop an owner's pages; never raises for the daemon's sake (while down the FREE waits for it)."""
        self._extra.pop(owner, None)
        given = self._given.pop(owner, 0)
        self._reserved.pop(owner, None)
        epoch = self._epoch_of.pop(owner, self._epoch)
        uncertain = owner in self._uncertain
        self._uncertain.discard(owner)
        if epoch != self._epoch or not (given or uncertain):  # held in a lost session, or nothing held
            return given
        self.used_pages -= given
        if self.state == "up":
            try:
                return self.client.free(owner)
            except KVStoreError as e:
                if not self._failed(e):
                    logger.error("FreeKV: kvstore FREE of request %d at %s failed: %s", owner, self.endpoint, e)
        if self.state == "down":
            self._pending_free.add(owner)
        return given

    # ---- what the scheduler side calls ----------------------------------------------------------

    def reserve(self, owner: int, total: int) -> None:
        """Make sure the daemon gave owner at least `total` pages (those the engine holds included)."""
        if self.owner_lost(owner):
            raise self._loss
        missing = total - self._given.get(owner, 0) + self._extra.get(owner, 0)
        if missing > 0:
            self._reserved.setdefault(owner, []).extend(self._get(owner, missing))

    def owner_lost(self, owner: int) -> bool:
        """True when owner's pages were in a session the daemon no longer knows."""
        self._check_heartbeat()
        return self._epoch_of.get(owner, self._epoch) != self._epoch

    def problem(self) -> HostPagesUnavailable | None:
        """Why new requests cannot get pages now (None: they can); probes the daemon when a probe is due."""
        self._check_heartbeat()
        if self.state != "up":
            self._recover()
        return self._problem

    def close(self) -> None:
        self.client.close()

    # ---- internals ---------------------------------------------------------------------------

    def _get(self, owner: int, n: int) -> list[int]:
        self._check_heartbeat()
        if self.state != "up" and not self._recover():
            raise self._problem
        try:
            pages = self.client.alloc(owner, n)
        except ArenaFull as e:
            raise HostPagesUnavailable("kvstore_arena_full", f"the kvstore arena at {self.endpoint} is full: {e}") from e
        except KVStoreError as e:
            if isinstance(e, DaemonUnavailable):
                self._uncertain.add(owner)
            if self._failed(e):
                raise self._problem from e
            raise HostPagesUnavailable("kvstore_error", f"the kvstore daemon at {self.endpoint} refused host pages "
                                                        f"for a request: {type(e).__name__}: {e}") from e
        self._given[owner] = self._given.get(owner, 0) + len(pages)
        self._epoch_of.setdefault(owner, self._epoch)
        self.used_pages += len(pages)
        return pages

    def _check_heartbeat(self) -> None:
        if self.state != "lost" and self.client.expired is not None:
            self._failed(SessionExpired(self.client.expired))

    def _failed(self, e: KVStoreError) -> bool:
        """Take a daemon failure into the pool's state; False for an error about one call only."""
        if isinstance(e, (SessionExpired, ArenaFailed)):
            self._lose(e)
        elif isinstance(e, (DaemonUnavailable, VersionMismatch)):
            if self.state == "up":
                reason = "kvstore_version_mismatch" if isinstance(e, VersionMismatch) else "kvstore_unreachable"
                self.state = "down"
                self._problem = HostPagesUnavailable(reason, f"the kvstore daemon at {self.endpoint} cannot be "
                                                             f"used: {e}")
                self._next_probe = time.monotonic() + PROBE_EVERY_S
                logger.error("FreeKV: %s; requests that need new host pages end with an abort until it answers",
                             self._problem)
        else:
            return False
        return True

    def _lose(self, e: Exception) -> None:
        if self.state == "lost":
            return
        self.state = "lost"
        self._epoch += 1
        self._loss = self._problem = HostPagesUnavailable(
            "kvstore_session_lost", f"the kvstore daemon at {self.endpoint} no longer holds this server's host pages "
                                    f"(its session and arena are gone: {e})")
        self._pending_free.clear()
        self._uncertain.clear()
        self._reserved.clear()
        self.used_pages = 0
        self._next_probe = 0.0  # a new session may be opened at once
        logger.error("FreeKV: %s; every request holding host pages on this rank ends with an abort", self._problem)

    def _recover(self) -> bool:
        """One probe (or new session) when due; True once the pool is up."""
        if time.monotonic() < self._next_probe:
            return False
        self._next_probe = time.monotonic() + PROBE_EVERY_S
        try:
            if self.state == "lost":
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # nothing may touch the arena while it is mapped anew
                self.client.reconnect()
            else:
                self.client.ping(timeout_s=PROBE_TIMEOUT_S)
                if self._pending_free:
                    self.client.free_many(sorted(self._pending_free))
                    self._pending_free.clear()
        except KVStoreError as e:
            if self.state == "down":
                self._failed(e)  # may find the session lost; anything else keeps it down
            else:
                logger.warning("FreeKV: no new kvstore session at %s yet: %s", self.endpoint, e)
            return False
        logger.warning("FreeKV: the kvstore daemon at %s answers again%s", self.endpoint,
                       " (new session: the lost requests' pages are gone)" if self.state == "lost" else "")
        self.state, self._problem = "up", None
        return True
