from .naive import naive_recall_pages
from .triton import recall_pages

__all__ = ["recall_pages", "naive_recall_pages"]
