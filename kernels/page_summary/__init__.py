from .naive import naive_page_summary
from .triton import page_summary

__all__ = ["page_summary", "naive_page_summary"]
