"""LouisKV's retrieval trigger: a semantic boundary per request and layer, from the adjacent queries' similarity."""

from .naive import naive_semantic_boundary
from .triton import semantic_boundary

__all__ = ["naive_semantic_boundary", "semantic_boundary"]
