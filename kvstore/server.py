"""The daemon process: a ZMQ ROUTER loop around KVStoreCore, the endpoint lock, signals and cleanup.

One thread serves every client: decode, dispatch, reply. Any request, however broken, gets exactly one
reply, a typed result or a typed error, and nothing raised while serving one request can stop the loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import logging
import os
import signal
import time

import zmq

from . import codec
from .config import DaemonConfig, GiB, ensure_private_dir, ipc_path, runtime_dir
from .core import KVStoreCore
from .errors import EndpointInUse, KVStoreError, ProtocolError, ShuttingDown, UnknownOpcode, VersionMismatch
from .journal import remove_orphaned_stores
from .protocol import MAX_BODY_BYTES, MESSAGES, PROTOCOL_VERSION, ErrorCode, Opcode

log = logging.getLogger("freekv_kvstore")

# Past this ZMQ drops the connection without a reply; below it, MAX_BODY_BYTES gets a typed error.
_HARD_MESSAGE_LIMIT = 64 * MAX_BODY_BYTES
_BATCH = 256  # requests served between two housekeeping ticks
# Python's collections of its oldest generation scan every live object, and the page tables hold a bytes key and a
# tuple of pages for each retained prefix page: at 80K retained keys such a collection took 23-37 ms on a 2-core
# host, inside whichever call allocated past the threshold (benchmarks/kvstore_prompts.py). A daemon process leaves
# the young generations to Python and collects the oldest one itself: once idle, or at the latest every few minutes.
_IDLE_S = 1.0  # no message for this long: the daemon is idle (for its collections and its journal's compaction)
_GC_IDLE_GAP_S = 30.0  # idle collections at most this often
_GC_MAX_GAP_S = 300.0  # and one at least this often, idle or not (cyclic garbage is not kept longer)
_GC_NEVER = 2**31 - 1  # an oldest-generation threshold Python never reaches


class OldGenerationCollector:
    """Full collections between calls: when the daemon has been idle for _IDLE_S (at most every _GC_IDLE_GAP_S),
    and at least every _GC_MAX_GAP_S."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self.busy = self.last = clock()
        self.collections = 0

    def served(self) -> None:
        self.busy = self._clock()

    def idle(self) -> bool:
        return self._clock() - self.busy >= _IDLE_S

    def tick(self) -> None:
        now = self._clock()
        if (self.idle() and now - self.last >= _GC_IDLE_GAP_S) or now - self.last >= _GC_MAX_GAP_S:
            gc.collect()
            self.last, self.collections = now, self.collections + 1


@contextlib.contextmanager
def daemon_gc():
    """This process's automatic collections stop at the young generations (OldGenerationCollector does the rest)."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], _GC_NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*before)


class KVStoreServer:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.endpoint = config.endpoint
        self._stop = False
        self._lock_fd: int | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._core: KVStoreCore | None = None
        self.collector = OldGenerationCollector()
        try:
            self._bind()
        except BaseException:
            self.close()
            raise

    def request_stop(self, *_: object) -> None:
        """Signal-safe: the loop notices within one poll interval."""
        self._stop = True

    def serve_forever(self) -> None:
        core = self._core
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop and not core.stop_requested:
            timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
            if poller.poll(timeout_ms):
                for _ in range(_BATCH):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve(frames)
                    if core.stop_requested:
                        break
                self.collector.served()
            if time.monotonic() >= next_tick:
                try:
                    core.tick(idle=self.collector.idle())
                except Exception:  # housekeeping must not take the pages of every client down with it
                    log.exception("housekeeping failed; retrying at the next tick")
                self.collector.tick()
                next_tick = time.monotonic() + self.config.reap_interval_s

    def close(self) -> None:
        """Unlink every arena, the journal and the socket; safe to call more than once and after a failed start
        (which leaves a journal it could not re-adopt as it was)."""
        if self._core is not None:
            self._core.close()
            self._core = None
        if not self._sock.closed:
            self._sock.close(linger=500)  # long enough for the SHUTDOWN reply to leave
        self._ctx.term()
        if self._lock_fd is not None:  # only a daemon that got the lock owns the socket file
            path = ipc_path(self.endpoint)
            _unlink_quietly(path)
            _unlink_quietly(f"{path}.lock")
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.config.ready_file:
            _unlink_quietly(self.config.ready_file)

    def _bind(self) -> None:
        sock = self._sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _HARD_MESSAGE_LIMIT)
        path = ipc_path(self.endpoint)
        if path is not None:
            self._lock_ipc(path)
        removed = remove_orphaned_stores(self.config.shm_dir)
        if removed:
            log.warning("removed %d files of kvstores whose daemon and server are both gone: %s", len(removed), removed)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            if e.errno == errno.EADDRINUSE:
                raise EndpointInUse(f"{self.endpoint} is already in use; pick another --endpoint") from None
            raise
        if path is not None:
            os.chmod(path, 0o600)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp port 0 / * resolved
        self._core = KVStoreCore(self.config, self.endpoint)  # re-adopts what a killed daemon here left
        if self.config.ready_file:
            tmp = f"{self.config.ready_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(self.endpoint + "\n")
            os.replace(tmp, self.config.ready_file)

    def _lock_ipc(self, path: str) -> None:
        """Hold <socket>.lock for the daemon's life. ZMQ would silently take over a live daemon's socket
        file; the lock tells a live daemon from a dead one's leftover socket, which is then removed."""
        directory = os.path.dirname(path)
        if directory == runtime_dir():
            ensure_private_dir(directory)
        elif not os.path.isdir(directory):
            raise FileNotFoundError(f"directory {directory} of the endpoint {self.endpoint} does not exist")
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise EndpointInUse(
                f"{self.endpoint} is taken by a running kvstore (pid {holder}); stop it with "
                f"`freekv-kvstore --stop --endpoint {self.endpoint}` or pick another --endpoint"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if os.path.exists(path):
            log.warning("removing the stale socket %s of a kvstore that did not shut down cleanly", path)
            os.unlink(path)

    def _serve(self, frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[1:]
        reply = self._answer(payload)
        try:
            self._sock.send_multipart([identity, *reply], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a client that stopped reading; its replies are dropped, not queued forever
            log.debug("reply dropped: %s", e)

    def _answer(self, payload: list[bytes]) -> list[bytes]:
        core = self._core
        core.messages += 1
        opcode, call_id = 0, 0
        try:
            if not payload:
                raise ProtocolError("empty request")
            version, opcode, call_id, session = codec.parse_request_header(payload[0])
            if version != PROTOCOL_VERSION:
                raise VersionMismatch(
                    f"client speaks kvstore protocol {version}, this daemon speaks {PROTOCOL_VERSION}: "
                    "run the same freekv-sglang version on both sides"
                )
            if len(payload) != 2:
                raise ProtocolError(f"a request is 2 frames [header, body], got {len(payload)}")
            try:
                op = Opcode(opcode)
            except ValueError:
                raise UnknownOpcode(f"unknown opcode {opcode:#04x}") from None
            request = codec.decode(MESSAGES[op].request, payload[1])
            if core.stop_requested or self._stop:
                raise ShuttingDown("the kvstore is shutting down")
            return codec.reply_frames(opcode, call_id, core.handle(op, session, request, call_id))
        except KVStoreError as e:
            core.errors += 1
            log.debug("request %#x/%d refused: %s", opcode, call_id, e)
            return codec.error_frames(opcode, call_id, e.code or ErrorCode.INTERNAL, str(e))
        except Exception as e:  # a bug: answer it and keep serving everyone else
            core.errors += 1
            log.exception("internal error serving opcode %#x", opcode)
            return codec.error_frames(opcode, call_id, ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def serve(config: DaemonConfig) -> None:
    """Run a daemon in this process until SHUTDOWN, SIGTERM/SIGINT, or the end of config.parent_pid."""
    server = KVStoreServer(config)
    try:
        previous = {sig: signal.signal(sig, server.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        print(
            f"freekv-kvstore listening on {server.endpoint} (pid {os.getpid()}, protocol {PROTOCOL_VERSION}, "
            f"arena budget {config.arena_bytes / GiB:.2f} GiB)",
            flush=True,
        )
        try:
            with daemon_gc():
                server.serve_forever()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        server.close()
        log.info("stopped; arenas unlinked")
