"""FastKV token-selective propagation (TSP): which prompt tokens propagate past the TSP layer."""

from .naive import POOL, WINDOW, naive_tsp_scores, naive_tsp_select, pick_tokens
from .triton import tsp_scores, tsp_select

__all__ = ["tsp_select", "tsp_scores", "naive_tsp_select", "naive_tsp_scores", "pick_tokens", "WINDOW", "POOL"]
