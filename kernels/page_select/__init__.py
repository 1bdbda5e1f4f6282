"""Page scoring (FreeKV group-consistent MeanS, or Quest-style max pooling), top-k selection, slot assignment."""

from .naive import PHASE_LATER, PHASE_NOW, naive_score_pages, naive_select_pages, naive_slot_delta
from .triton import score_pages, select_pages, slot_delta

__all__ = [
    "PHASE_LATER",
    "PHASE_NOW",
    "score_pages",
    "select_pages",
    "slot_delta",
    "naive_score_pages",
    "naive_select_pages",
    "naive_slot_delta",
]
