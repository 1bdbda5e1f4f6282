from .naive import naive_pages_from_host, naive_pages_to_host, naive_staged_to_slots
from .triton import pages_from_host, pages_to_host, staged_to_slots

__all__ = ["pages_from_host", "pages_to_host", "staged_to_slots", "naive_pages_from_host", "naive_pages_to_host",
           "naive_staged_to_slots"]
