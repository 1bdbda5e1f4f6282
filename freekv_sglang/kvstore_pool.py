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

The pool publishes its state for the server's /health (freekv_patches._health, in the HTTP process): a small JSON file
per pool (state, reason, message, rank, pid), under /dev/shm (the temporary directory where there is none), named from
its client id (stable_client_id: model, port, TP rank), replaced atomically (tmp file + os.replace) at every state
change and removed when the pool closes or its process exits. A daemon that answers a PING says nothing about this
pool: its session may be lost for good (a new one refused), and then every request aborts. read_pool_states gives a
server's live pools' states (files of dead processes, e.g. a server killed with -9, are ignored).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import uuid
import weakref

import psutil
import torch

from freekv_kvstore import ArenaFull, ArenaGeometry, DaemonUnavailable, KVStoreClient, KVStoreError, SessionExpired
from freekv_kvstore.errors import ArenaFailed, VersionMismatch

logger = logging.getLogger(__name__)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
           torch.float8_e4m3fn: "float8_e4m3fn"}
PROBE_EVERY_S = 1.0  # while down or lost: how often a call may try the daemon again
PROBE_TIMEOUT_S = 0.5
STATE_PREFIX = "freekv-pool"  # published state files: <dir>/freekv-pool.<uid>.<client id>.json


def _file_safe(text: str) -> str:
    """text with every character but letters, digits and ._- replaced by _ (names of ids and files)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def server_identity(server_args) -> str:
    """What every TP rank's client id of one server starts with: the model and the port."""
    model = str(getattr(server_args, "model_path", None) or "model")
    digest = hashlib.blake2b(model.encode(), digest_size=4).hexdigest()
    name = _file_safe(model.rstrip("/").rsplit("/", 1)[-1])[:64]
    port = getattr(server_args, "port", None)
    return f"{name}-{digest}-port{port}"


def stable_client_id(runner, rank: int, instance: int = 0) -> str:
    """The kvstore client id of a server rank: the model, port and TP rank (not the pid), so a restarted server
    re-attaches its arena and the prefixes it retained. instance > 0 (a second backend in one process) is appended."""
    return (f"{server_identity(getattr(runner, 'server_args', None))}-tp{rank}"
            + (f"-{instance}" if instance else ""))


# ---- the published state (read by the HTTP process's /health) -------------------------------------


def state_dir() -> str:
    """Where pools publish their state: /dev/shm (memory, cleared at boot), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _state_name(client_id: str) -> str:
    return f"{STATE_PREFIX}.{os.getuid()}.{_file_safe(client_id)}.json"


def state_path(client_id: str) -> str:
    return os.path.join(state_dir(), _state_name(client_id))


def _remove_state(path: str, token: str) -> None:
    """Remove a pool's state file, unless another pool (a later one with the same client id) has replaced it."""
    try:
        with open(path) as f:
            if json.load(f).get("token") != token:
                return
        os.unlink(path)
    except (OSError, ValueError):
        pass


def _alive(state: dict) -> bool:
    """Whether the process that published state still runs (the pid and its start time: pids are reused)."""
    try:
        return abs(psutil.Process(int(state["pid"])).create_time() - float(state["proc_start"])) < 0.05
    except psutil.AccessDenied:
        return True
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def read_pool_states(identity: str) -> list[dict]:
    """The published states of the live pools of the server `identity` (server_identity), one per TP rank that has
    opened its pool, in file-name order. A rank without a file has not opened its pool yet (or closed it)."""
    directory = state_dir()
    prefix = _state_name(f"{identity}-tp")[:-len(".json")]
    states = []
    try:
        names = sorted(e.name for e in os.scandir(directory) if e.name.startswith(prefix) and e.name.endswith(".json"))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                state = json.load(f)
        except (OSError, ValueError):  # removed meanwhile (a replace is atomic: a file is whole or absent)
            continue
        if isinstance(state, dict) and _alive(state):
            states.append(state)
    return states


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
        self.scales = self.client.scales
        t = self.client.startup_s
        logger.info("FreeKV rank %d: kvstore arena of %.1f GB: %.1f s waiting for its pre-fault, %.1f s to map and "
                    "register it", rank, self.client.num_pages * self.client.page_bytes / 1e9, t["prefault"],
                    t["attach"])
        self.num_pages = self.client.num_pages
        self.rank, self.client_id = rank, client_id
        self.state = "up"
        self._problem: HostPagesUnavailable | None = None  # why the pool is down or lost
        self._retry_error: str | None = None  # while lost: why the last new session was refused
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
        self.state_path = state_path(client_id)
        self._state_token = uuid.uuid4().hex  # this pool's files (a later pool of the same client id replaces them)
        self._proc_start = psutil.Process().create_time()
        self._state_warned = False
        self._publish()
        # Removed by close(), at interpreter exit, or when the pool is collected. A process killed without either
        # leaves it: read_pool_states ignores files of dead processes, and the rank's next pool replaces it.
        self._unpublish = weakref.finalize(self, _remove_state, self.state_path, self._state_token)

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

    def retain_chain(self, keys, pages, parent: bytes | None = None) -> bool:
        """Retain pages[i] under keys[i] as one chain (RETAIN_CHAIN: every page-aligned prefix for one page id per
        key), keys[0] linked to the retained key parent if given; False when the daemon cannot be used or refuses
        (the prefix is then not cached)."""
        if self.state != "up":
            return False
        try:
            self.client.retain_chain(keys, pages, parent=parent)
        except KVStoreError as e:
            if not self._failed(e):
                logger.warning("FreeKV: kvstore RETAIN_CHAIN at %s failed: %s", self.endpoint, e)
            return False
        return True

    def free(self, owner: int) -> int:
        """Drop an owner's pages; never raises for the daemon's sake (while down the FREE waits for it). Returns the
        pages the daemon had given it."""
        return self.free_many([owner])

    def free_many(self, owners: list[int]) -> int:
        """free() of several owners in one FREE round trip (a step's finished requests)."""
        send, given_all = [], 0
        for owner in owners:
            self._extra.pop(owner, None)
            given = self._given.pop(owner, 0)
            given_all += given
            self._reserved.pop(owner, None)
            epoch = self._epoch_of.pop(owner, self._epoch)
            uncertain = owner in self._uncertain
            self._uncertain.discard(owner)
            if epoch == self._epoch and (given or uncertain):  # else held in a lost session, or nothing held
                self.used_pages -= given
                send.append(owner)
        if send:
            self._send_free(send)
        return given_all

    def _send_free(self, owners: list[int]) -> None:
        if self.state == "up":
            try:
                self.client.free_many(owners)
                return
            except KVStoreError as e:
                if not self._failed(e):
                    if len(owners) > 1:  # the daemon refuses a FREE whole: one refused owner keeps no other's pages
                        for owner in owners:
                            self._send_free([owner])
                        return
                    logger.error("FreeKV: kvstore FREE of request %d at %s failed: %s", owners[0], self.endpoint, e)
        if self.state == "down":
            self._pending_free.update(owners)

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
        self._unpublish()
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
                self._publish()
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
        self._retry_error = None
        self._publish()
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
                error = f"{type(e).__name__}: {e}"
                if error != self._retry_error:  # /health says why no session opens (rewritten when that changes)
                    self._retry_error = error
                    self._publish()
            return False
        logger.warning("FreeKV: the kvstore daemon at %s answers again%s", self.endpoint,
                       " (new session: the lost requests' pages are gone)" if self.state == "lost" else "")
        self.state, self._problem, self._retry_error = "up", None, None
        self._publish()
        return True

    def _publish(self) -> None:
        """Write the pool's state for /health: a new file put in place with os.replace, so a reader sees the old
        state or the new one, never part of one. Never raises (a failure is logged once)."""
        message = None if self._problem is None else str(self._problem)
        if message is not None and self._retry_error is not None:
            message += f"; no new session yet: {self._retry_error}"
        state = {"state": self.state, "reason": None if self._problem is None else self._problem.reason,
                 "message": message, "client_id": self.client_id, "rank": self.rank, "endpoint": self.endpoint,
                 "pid": os.getpid(), "proc_start": self._proc_start, "token": self._state_token, "since": time.time()}
        directory, name = os.path.split(self.state_path)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.state_path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            if not self._state_warned:
                self._state_warned = True
                logger.warning("FreeKV: cannot publish the host pool's state at %s (/health will not see it): %s",
                               self.state_path, e)
