"""Batched k-means over one prompt's keys per KV head on the GPU: LouisKV's semantic clusters of the prefill."""

from .naive import naive_assign, naive_kmeans_keys, naive_update
from .triton import kmeans_keys

__all__ = ["kmeans_keys", "naive_assign", "naive_kmeans_keys", "naive_update"]
