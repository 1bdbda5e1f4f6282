"""Decode attention in two launches around a recall: the pages that stay first (beside the recall), then the recalled
slots merged in (after it); or in one launch (attend_pages) when nothing is recalled before it."""

from .naive import Partials, naive_attend_kept, naive_attend_pages, naive_attend_recalled
from .triton import attend_kept, attend_pages, attend_recalled

__all__ = ["Partials", "attend_kept", "attend_pages", "attend_recalled", "naive_attend_kept", "naive_attend_pages",
           "naive_attend_recalled"]
