"""Arenas: page geometry, the shared-memory segment that holds one client's pages, and process liveness.

Geometry. An arena of P pages is one C-contiguous array of shape [P, L, H, 2, p, D] (pages, layers, KV
heads, K/V, tokens in a page, head dim) in bf16, fp16 or fp32. Host page i is one token-page of one request
across all layers; for every (page, layer, head) its K then its V are 2*p*D contiguous elements, so a page
is page_bytes = L*H*2*p*D*itemsize bytes at byte offset i*page_bytes.

In float8_e4m3fn (FP8 host pages, half of bf16's bytes), each row of D values (one token of one head, K or V)
is e4m3 values times 2**e (freekv_kernels.fp8_rows), and a page holds its L*H*2*p int8 exponents [L, H, 2, p]
after its values: page_bytes = L*H*2*p*(D + 1), the page still one contiguous byte range.

Segments are files under a shared-memory directory (/dev/shm), mode 0600, named by the store of their
daemon's endpoint (journal.py), so a daemon restarted on that endpoint finds and re-adopts them. This module
needs no torch; the client builds its torch view on top of ``map_segment``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import errno
import mmap
import operator
import os
import stat
import threading

import psutil

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
SCALED_DTYPES = ("float8_e4m3fn",)  # pages that carry an int8 exponent per row after their values
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                  "fp8_e4m3": "float8_e4m3fn"}
_MAX_DIM = 1 << 16
_MAX_PAGE_BYTES = 1 << 30
_POPULATE_CHUNK = 256 << 20  # a multiple of the mmap granularity
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in on first touch
_MAP_FIXED = 0x10  # Linux (and the BSDs); Python's mmap module does not export it


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaGeometry:
    """Per-page shape of an arena. dtype accepts "bfloat16"/"float16"/"float32"/"float8_e4m3fn", short aliases
    ("fp8_e4m3" among them), or a torch dtype."""

    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "page_size", "head_dim"):
            value = getattr(self, name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None
            if not 1 <= value <= _MAX_DIM:
                raise ValueError(f"{name} must be in [1, {_MAX_DIM}], got {value}")
            object.__setattr__(self, name, value)
        dtype = str(self.dtype).removeprefix("torch.")
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.page_bytes > _MAX_PAGE_BYTES:
            raise ValueError(f"one page would take {self.page_bytes} bytes, more than {_MAX_PAGE_BYTES}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def page_elems(self) -> int:
        return self.num_layers * self.num_kv_heads * 2 * self.page_size * self.head_dim

    @property
    def scaled(self) -> bool:
        return self.dtype in SCALED_DTYPES

    @property
    def value_bytes(self) -> int:
        """Bytes of a page's K / V values; its row exponents (scaled dtypes) follow them."""
        return self.page_elems * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.value_bytes + (self.page_elems // self.head_dim if self.scaled else 0)

    def shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        return (num_pages, self.num_layers, self.num_kv_heads, 2, self.page_size, self.head_dim)


def process_start_ms(pid: int) -> int | None:
    """Start time of a live process in ms since the epoch, None if there is none (pids are reused; this is not)."""
    try:
        return round(psutil.Process(pid).create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def process_alive(pid: int, start_ms: int) -> bool:
    """Whether the process that had this pid and start time still runs (a zombie does not). When in doubt
    (no permission to look), it counts as alive: callers then fall back to slower but certain evidence."""
    try:
        proc = psutil.Process(pid)
        return abs(round(proc.create_time() * 1000) - start_ms) <= 20 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:
        return True
    except (psutil.NoSuchProcess, ValueError):
        return False


def free_shm_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


ARENA_ID_BYTES = 16  # a random id after the pages: a restarted daemon re-adopts this very file, not a stand-in


class Segment:
    """One arena's file: `size` bytes of pages, then the arena's id. The daemon creates, pre-faults and unlinks
    it; it never maps it for long."""

    def __init__(self, path: str, size: int, arena_id: bytes) -> None:
        self.path = path
        self.size = size
        self.arena_id = arena_id

    @classmethod
    def create(cls, path: str, size: int) -> Segment:
        arena_id = os.urandom(ARENA_ID_BYTES)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: the pages of a request are nobody else's business
            os.ftruncate(fd, size + ARENA_ID_BYTES)
            os.pwrite(fd, arena_id, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(path, size, arena_id)

    def mismatch(self) -> str | None:
        """Why the file at self.path is not this arena (gone, resized, replaced), or None."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return f"{self.path} is gone"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return f"{self.path} is not a regular file of uid {os.getuid()}"
            if st.st_size != self.size + ARENA_ID_BYTES:
                return f"{self.path} has {st.st_size} bytes, the arena {self.size + ARENA_ID_BYTES}"
            if os.pread(fd, ARENA_ID_BYTES, self.size) != self.arena_id:
                return f"{self.path} carries another arena id: it is not the file the journal describes"
            return None
        finally:
            os.close(fd)

    def prefault(self, threads: int, cancel: threading.Event | None = None) -> None:
        """Reserve and fault in every page, so clients never fault a fresh one and a full filesystem fails
        here with ENOSPC instead of killing a process with SIGBUS on first touch. Works in chunks, on
        `threads` threads (tmpfs zeroes a page on its first fault, well under 1 GB/s per thread), and stops
        with InterruptedError between chunks once `cancel` is set."""
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        file_bytes = self.size + ARENA_ID_BYTES

        def fault_in(offset: int) -> None:
            if cancel is not None and cancel.is_set():
                raise InterruptedError(f"pre-faulting {self.path} was cancelled")
            length = min(_POPULATE_CHUNK, file_bytes - offset)
            try:
                os.posix_fallocate(fd, offset, length)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            mmap.mmap(fd, length, offset=offset, flags=mmap.MAP_SHARED | _MAP_POPULATE).close()

        try:
            offsets = range(0, file_bytes, _POPULATE_CHUNK)
            with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(offsets)))) as pool:
                list(pool.map(fault_in, offsets))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def map_segment(path: str, size: int) -> mmap.mmap:
    """Map an arena read-write for a client; its page tables are populated up front."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != size + ARENA_ID_BYTES:
            raise ValueError(f"arena {path} has {actual} bytes, the daemon announced {size} + {ARENA_ID_BYTES}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
    finally:
        os.close(fd)


def mapping_address(mapped: mmap.mmap) -> int:
    """The address of a mapping made by map_segment."""
    view = ctypes.c_char.from_buffer(mapped)  # an export of the mapping, released below
    try:
        return ctypes.addressof(view)
    finally:
        del view


def remap_segment(path: str, size: int, address: int) -> None:
    """Map the arena at path over this process's mapping [address, address + size) in one step (MAP_FIXED), so
    every pointer into the old arena (tensor views, CUDA graphs that captured it) now reaches the new one. The old
    arena's bytes are no longer reachable through it."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != size + ARENA_ID_BYTES:
            raise ValueError(f"arena {path} has {actual} bytes, expected {size} + {ARENA_ID_BYTES}")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        got = libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd, 0)
        if got != address:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping arena {path} over the old one at {address:#x} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
