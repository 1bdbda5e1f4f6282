"""Host memory registered with CUDA, so GPU kernels read and write it in place over UVA: the kvstore client's
shared-memory arena and the engine's in-process host pool. torch is imported on use: the daemon needs none."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from .config import GiB

log = logging.getLogger("freekv_kvstore")

# Portable | Mapped: every CUDA context sees the pages as pinned and can address them over UVA.
_PORTABLE_MAPPED = 3


# Releases that a finalizer made while this thread captured a CUDA graph, each holding what it releases.
_deferred: list[Callable[[], None]] = []


def register(ptr: int, nbytes: int, what: str) -> None:
    import torch

    if not _capturing():
        release_deferred()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE_MAPPED))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes / GiB:.2f} GiB {what} failed: CUDA error {err}")


def unregister(ptr: int, what: str) -> None:
    import torch

    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        log.warning("cudaHostUnregister of the %s failed: CUDA error %d", what, err)


def when_safe(release: Callable[[], None]) -> None:
    """Run a finalizer's release that may call unregister, which the garbage collector may run inside a CUDA graph's
    capture: there cudaHostUnregister is not permitted (error 900), breaks the capture, and leaves the range
    registered, so the next registration of that memory fails (error 712). Inside a capture on this thread the release
    waits (holding the memory alive) for the next registration or release outside one."""
    _deferred.append(release)
    if not _capturing():
        release_deferred()


def release_deferred() -> None:
    while _deferred:
        _deferred.pop(0)()


def _capturing() -> bool:
    torch = sys.modules.get("torch")  # never imported: nothing is captured (a client need not use torch)
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
