"""The selection of a phase in one launch: pooling a scoring's log-sum-exps into page scores, the benchmarks' churn
replay and select_slots (top-k, slot delta, commit, recall codes), which otherwise run as three launches in a row."""

from .naive import LsePool, Replay, naive_select_chain
from .triton import select_chain

__all__ = ["LsePool", "Replay", "naive_select_chain", "select_chain"]
