"""Host memory registered with CUDA, so GPU kernels read and write it in place over UVA: the kvstore client's
shared-memory arena and the engine's in-process host pool. torch is imported on use: the daemon needs none."""

from __future__ import annotations

import logging

from .config import GiB

log = logging.getLogger("freekv_kvstore")

# Portable | Mapped: every CUDA context sees the pages as pinned and can address them over UVA.
_PORTABLE_MAPPED = 3


def register(ptr: int, nbytes: int, what: str) -> None:
    import torch

    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE_MAPPED))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes / GiB:.2f} GiB {what} failed: CUDA error {err}")


def unregister(ptr: int, what: str) -> None:
    import torch

    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        log.warning("cudaHostUnregister of the %s failed: CUDA error %d", what, err)
