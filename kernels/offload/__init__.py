from .naive import naive_offload_pages
from .triton import offload_pages

__all__ = ["naive_offload_pages", "offload_pages"]
