"""LouisKV's unit scoring: group-mean softmax of the query over cluster and segment centroids, as page scores."""

from .naive import naive_unit_page_scores
from .triton import unit_page_scores, unit_scratch_size

__all__ = ["naive_unit_page_scores", "unit_page_scores", "unit_scratch_size"]
