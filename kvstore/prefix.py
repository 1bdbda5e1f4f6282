"""Prefix keys: a hash chain over full pages of token ids, so equal prefixes give equal keys.

key[i] = blake2b(key[i-1] || tokens of page i as little-endian int64), with key[-1] derived from a
namespace (e.g. the model name and revision) so that different models never share cached pages.
key[i] names the prefix made of pages 0..i; a partial last page gets no key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16


def prefix_keys(token_ids: Sequence[int] | np.ndarray, page_size: int, *, namespace: bytes = b"",
                parent: bytes | None = None) -> list[bytes]:
    """The keys of token_ids' full pages. parent: the key of the page just before token_ids[0], to continue a chain
    from it (its namespace is in it, so namespace must stay empty); the keys equal those of the whole sequence's
    later pages."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(f"token_ids must be a 1-D sequence of integers, got shape {tokens.shape} of {tokens.dtype}")
    data = tokens.astype("<i8", copy=False).tobytes()
    page = page_size * 8
    if parent is None:
        key = hashlib.blake2b(bytes(namespace), digest_size=KEY_BYTES, person=b"freekv-prefix").digest()
    elif namespace or len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key and comes without a namespace")
    else:
        key = bytes(parent)
    keys = []
    for start in range(0, len(tokens) // page_size * page, page):
        key = hashlib.blake2b(key + data[start : start + page], digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys
