"""The ops the engine and its retrieval policies call, from the Triton kernels or from their torch references."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

_OPS = {
    "write_kv": ("kv_write", "write_kv"),
    "offload_pages": ("offload", "offload_pages"),
    "recall_pages": ("recall", "recall_pages"),
    "pages_from_host": ("page_copy", "pages_from_host"),  # whole prompts: radix prefix sharing
    "pages_to_host": ("page_copy", "pages_to_host"),
    "staged_to_slots": ("page_copy", "staged_to_slots"),  # engine.fill_slots: a prefill's slots from its staging
    "query_similarity": ("query_similarity", "query_similarity"),
    "score_pages": ("page_select", "score_pages"),
    "select_chain": ("select_chain", "select_chain"),  # pooling, churn replay and select_slots in one launch
    "sketch_pages": ("page_rerank", "sketch_pages"),
    "top_pages": ("page_rerank", "top_pages"),
    "rerank_pages": ("page_rerank", "rerank_pages"),
    "sparse_decode_attention": ("sparse_attention", "sparse_decode_attention"),  # dense layers
    "attend_kept": ("split_attention", "attend_kept"),  # sparse layers: beside the recall before attention
    "attend_recalled": ("split_attention", "attend_recalled"),  # and after it
    "attend_pages": ("split_attention", "attend_pages"),  # or both in one launch after it (--kv-attention fused)
    "plan_step": ("plan_step", "plan_step"),
    "fp8_linear": ("fp8_linear", "fp8_linear"),  # --kv-early-weights fp8: the early lane's query projection
    "channel_sketch_pages": ("channel_sketch", "channel_sketch_pages"),
    "tsp_select": ("tsp_select", "tsp_select"),  # FastKV prefill (the HF adapter)
    # LouisKV (freekv_sglang/louiskv.py)
    "kmeans_keys": ("kmeans", "kmeans_keys"),
    "semantic_boundary": ("semantic_boundary", "semantic_boundary"),
    "unit_page_scores": ("unit_scores", "unit_page_scores"),
    "segment_pages": ("segments", "segment_pages"),
}

BACKENDS = ("triton", "torch")


def load_ops(backend: str) -> SimpleNamespace:
    """backend "triton": the kernels (CUDA, or CPU under TRITON_INTERPRET=1); "torch": the references."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown ops backend {backend!r}; choose one of {BACKENDS}")
    ops = {}
    for name, (module, fn) in _OPS.items():
        mod = importlib.import_module(f"freekv_kernels.{module}")
        ops[name] = getattr(mod, fn if backend == "triton" else f"naive_{fn}")
    return SimpleNamespace(**ops)
