"""The daemon's journal: its page tables, sessions and arenas kept in shared memory, so a daemon restarted on
the same endpoint (after a crash or kill -9) re-adopts them instead of losing every client's pages.

A store is what one endpoint's daemons share across restarts, in the shared-memory directory:
    freekv.<uid>.<store>.lock      flock-ed by the live daemon; holds "pid epoch parent_pid parent_start_ms"
    freekv.<uid>.<store>.journal   header, snapshot, then one record per change since the snapshot
    freekv.<uid>.<store>.<n>       arena segments
where <store> is a digest of the bound endpoint. The journal is write-ahead: a change is appended before the
daemon acts on it and answers, so a daemon killed at any point leaves a journal that describes every reply it
sent. The header carries a format version, the epoch (one more at every adoption) and a checksum of the
snapshot; each record carries a sequence number and a checksum. A torn last record (the daemon died while
appending it) was never acted on and is dropped; anything else that does not check out is refused, and so is
a journal whose epoch is behind the lock file's (an old copy put back).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import struct
import zlib
from typing import Any

import msgpack

from .arena import process_alive, process_start_ms
from .errors import EndpointInUse, StateRejected

log = logging.getLogger("freekv_kvstore")

FORMAT_VERSION = 2  # 2: chain keys (parents in the table state, RETAIN_CHAIN calls)
READABLE_FORMATS = (1, 2)
_MAGIC = b"FKVJ"
_HEADER = struct.Struct("!4sHHQQI")  # magic, format, reserved, epoch, snapshot bytes, snapshot crc32
_HEADER_CRC = struct.Struct("!I")  # crc32 of the header fields above
_RECORD = struct.Struct("!IQI")  # payload bytes, sequence number, crc32 of sequence number and payload
_LOCK_BYTES = 128


def store_prefix(shm_dir: str, endpoint: str) -> str:
    """Path prefix of every file of the store of this (bound) endpoint."""
    digest = hashlib.blake2b(endpoint.encode(), digest_size=8).hexdigest()
    return os.path.join(shm_dir, f"freekv.{os.getuid()}.{digest}.")


def store_segments(prefix: str) -> dict[int, str]:
    """The store's arena segment files by number."""
    directory, base = os.path.split(prefix)
    pattern = re.compile(re.escape(base) + r"(\d+)$")
    with os.scandir(directory) as entries:
        return {int(m[1]): e.path for e in entries if (m := pattern.match(e.name))}


def discard_store(shm_dir: str, endpoint: str) -> list[str]:
    """Remove the files a killed daemon of this endpoint left behind (unless a live daemon holds them)."""
    return _discard(store_prefix(shm_dir, endpoint), lambda fields: True)


def remove_orphaned_stores(shm_dir: str) -> list[str]:
    """Remove this user's stores that nobody can re-adopt: their daemon is gone and so is the server it was
    embedded in (whose supervisor would have restarted it). An external daemon's store stays for its restart."""
    pattern = re.compile(rf"^(freekv\.{os.getuid()}\.[0-9a-f]{{16}}\.)lock$")
    with os.scandir(shm_dir) as entries:
        prefixes = [os.path.join(shm_dir, m[1]) for e in entries if (m := pattern.match(e.name))]
    return [path for prefix in prefixes for path in _discard(prefix, _parent_gone)]


def _parent_gone(fields: list[str]) -> bool:
    return len(fields) == 4 and fields[2] != "0" and not process_alive(int(fields[2]), int(fields[3]))


def _discard(prefix: str, condition) -> list[str]:
    """Unlink a store's files if its lock is free and condition(the lock file's fields) holds."""
    try:
        fd = os.open(f"{prefix}lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return []  # a live daemon holds it
            if not condition(os.pread(fd, _LOCK_BYTES, 0).decode(errors="replace").split()):
                return []
        removed = []
        for path in [*store_segments(prefix).values(), f"{prefix}journal", f"{prefix}lock"]:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed
    finally:
        if fd is not None:
            os.close(fd)


class Journal:
    """The journal and lock of one store, held by the live daemon. Open with Journal.open."""

    def __init__(self, prefix: str, endpoint: str, lock_fd: int, parent: str) -> None:
        self.prefix = prefix
        self.endpoint = endpoint
        self._parent = parent
        self.path = f"{prefix}journal"
        self._lock_fd = lock_fd
        self._fd: int | None = None
        self._seq = 0
        self.log_bytes = 0
        self.snapshot_bytes = 0

    @classmethod
    def open(cls, shm_dir: str, endpoint: str, parent_pid: int | None = None) -> Journal:
        """Take the store of endpoint. parent_pid: the server an embedded daemon serves (its store is orphaned,
        and removed by the next daemon to start, once both are gone)."""
        prefix = store_prefix(shm_dir, endpoint)
        fd = os.open(f"{prefix}lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, _LOCK_BYTES, 0).decode(errors="replace").split()
            os.close(fd)
            raise EndpointInUse(
                f"the kvstore state of {endpoint} ({prefix}*) is held by a running daemon "
                f"(pid {holder[0] if holder else 'unknown'})"
            ) from None
        parent = "0 0" if parent_pid is None else f"{parent_pid} {process_start_ms(parent_pid) or 0}"
        return cls(prefix, endpoint, fd, parent)

    def load(self) -> tuple[int, Any, list[Any]]:
        """(epoch, snapshot, records) of the journal; (0, None, []) for a new store. Raises StateRejected for a
        journal that is corrupt, of another format, or older than its lock file says."""
        lock_epoch = self._lock_epoch()
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            orphans = store_segments(self.prefix)
            if orphans:
                raise self.rejected(f"{len(orphans)} arena files but no journal") from None
            return 0, None, []
        fixed = _HEADER.size + _HEADER_CRC.size
        if len(data) < fixed or data[:4] != _MAGIC:
            raise self.rejected("the journal has no valid header")
        _, version, _, epoch, snap_len, snap_crc = _HEADER.unpack_from(data)
        if _HEADER_CRC.unpack_from(data, _HEADER.size)[0] != zlib.crc32(data[: _HEADER.size]):
            raise self.rejected("the journal header fails its checksum")
        if version not in READABLE_FORMATS:
            raise self.rejected(f"the journal has format {version}, this daemon reads formats "
                                f"{', '.join(map(str, READABLE_FORMATS))}")
        if lock_epoch is None or epoch not in (lock_epoch, lock_epoch + 1):
            raise self.rejected(
                f"the journal is stale: it is at epoch {epoch}, the store's lock file at "
                f"{'no epoch' if lock_epoch is None else f'epoch {lock_epoch}'}"
            )
        snapshot = data[fixed : fixed + snap_len]
        if len(snapshot) != snap_len or zlib.crc32(snapshot) != snap_crc:
            raise self.rejected("the journal's snapshot fails its checksum")
        records, pos = [], fixed + snap_len
        while pos < len(data):
            if len(data) - pos < _RECORD.size:
                log.warning("dropping the torn last journal record (%d bytes)", len(data) - pos)
                break
            size, seq, crc = _RECORD.unpack_from(data, pos)
            payload = data[pos + _RECORD.size : pos + _RECORD.size + size]
            intact = len(payload) == size and seq == len(records) + 1 and zlib.crc32(payload, seq) == crc
            if not intact:
                if pos + _RECORD.size + size < len(data):  # only the last record can be torn by a crash
                    raise self.rejected(f"journal record {len(records) + 1} is corrupt")
                log.warning("dropping the torn last journal record %d", len(records) + 1)
                break
            records.append(payload)
            pos += _RECORD.size + size
        try:
            return epoch, _unpack(snapshot), [_unpack(r) for r in records]
        except ValueError as e:  # checksums match, so the writer wrote this: a bug, not a crash
            raise self.rejected(f"the journal does not decode: {e}") from None

    def compact(self, epoch: int, snapshot: Any) -> None:
        """Replace the journal by a snapshot of the whole state, atomically (a new file renamed over it)."""
        body = msgpack.packb(snapshot, use_bin_type=True)
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, 0, epoch, len(body), zlib.crc32(body))
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, header + _HEADER_CRC.pack(zlib.crc32(header)) + body)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._seq, self.log_bytes, self.snapshot_bytes = 0, 0, len(body)
        # After the journal: a crash in between leaves the journal one epoch ahead, which load accepts. One write
        # of a fixed width, so no crash leaves the lock file half old, half new.
        os.pwrite(self._lock_fd, f"{os.getpid()} {epoch} {self._parent}".ljust(_LOCK_BYTES - 1).encode() + b"\n", 0)

    def append(self, record: Any) -> None:
        payload = msgpack.packb(record, use_bin_type=True)
        self._seq += 1
        _write_all(self._fd, _RECORD.pack(len(payload), self._seq, zlib.crc32(payload, self._seq)) + payload)
        self.log_bytes += _RECORD.size + len(payload)

    def discard(self) -> None:
        """A clean stop: the state goes with the daemon (its arenas are already unlinked)."""
        for path in (self.path, f"{self.prefix}lock"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.close()

    def close(self) -> None:
        """Let go of the store and leave its files (what a crash does)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def rejected(self, why: str) -> StateRejected:
        return StateRejected(
            f"cannot re-adopt the kvstore state of {self.endpoint} ({self.prefix}*): {why}. Nothing was changed; "
            f"to start this endpoint afresh (its pages are lost), remove {self.prefix}*"
        )

    def _lock_epoch(self) -> int | None:
        fields = os.pread(self._lock_fd, _LOCK_BYTES, 0).decode(errors="replace").split()
        return int(fields[1]) if len(fields) == 4 and fields[1].isdigit() else None


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"{type(e).__name__}: {e}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
