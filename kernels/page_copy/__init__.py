from .naive import naive_pages_from_host, naive_pages_to_host
from .triton import pages_from_host, pages_to_host

__all__ = ["pages_from_host", "pages_to_host", "naive_pages_from_host", "naive_pages_to_host"]
