"""Two-stage page selection from 2-bit per-channel key codes (KIVI-style, in the page's own min / max range, written
by offload_pages): a sketch scores every page from the few code bytes the query weighs most, the best candidates
are rescored from all their codes."""

from .naive import (
    CODE_BITS,
    dequantize_keys,
    empty_codes,
    naive_rerank_pages,
    naive_sketch_pages,
    naive_sketch_picks,
    naive_top_pages,
    quantize_keys,
    sketch_bytes,
)
from .triton import rerank_pages, sketch_pages, top_pages

__all__ = [
    "CODE_BITS",
    "dequantize_keys",
    "empty_codes",
    "naive_rerank_pages",
    "naive_sketch_pages",
    "naive_sketch_picks",
    "naive_top_pages",
    "quantize_keys",
    "rerank_pages",
    "sketch_bytes",
    "sketch_pages",
    "top_pages",
]
