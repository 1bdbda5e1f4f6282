"""Two-stage page selection's second stage: the best candidates of a coarse page score, rescored from 2-bit
per-channel key codes (a KIVI-style sketch in the page's own min / max range, written by offload_pages)."""

from .naive import CODE_BITS, dequantize_keys, naive_rerank_pages, naive_top_pages, quantize_keys
from .triton import rerank_pages, top_pages

__all__ = [
    "CODE_BITS",
    "dequantize_keys",
    "naive_rerank_pages",
    "naive_top_pages",
    "quantize_keys",
    "rerank_pages",
    "top_pages",
]
