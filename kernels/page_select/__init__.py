"""Page scoring (FreeKV group-consistent MeanS, or Quest-style max pooling), then top-k selection, slot assignment
and commit in one op."""

from .naive import PHASE_LATER, PHASE_NOW, naive_score_pages, naive_select_slots
from .triton import score_pages, select_slots

__all__ = [
    "PHASE_LATER",
    "PHASE_NOW",
    "naive_score_pages",
    "naive_select_slots",
    "score_pages",
    "select_slots",
]
