"""Benchmarks only: a selection churn at a given rate (FreeKVConfig.replay_churn), in place of a model's."""

from .naive import naive_replay_churn
from .triton import replay_churn

__all__ = ["naive_replay_churn", "replay_churn"]
