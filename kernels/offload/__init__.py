from .naive import naive_offload_pages
from .triton import offload_pages

__all__ = ["offload_pages", "naive_offload_pages"]
