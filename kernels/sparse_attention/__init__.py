"""Paged sparse decode attention: one query token per row over the row's listed pages (GQA)."""

from .naive import naive_sparse_decode_attention
from .triton import sparse_decode_attention

__all__ = ["naive_sparse_decode_attention", "sparse_decode_attention"]
