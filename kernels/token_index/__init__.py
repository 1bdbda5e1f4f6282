from .naive import naive_head_pages, naive_head_token_index
from .triton import head_pages, head_token_index

__all__ = ["head_pages", "head_token_index", "naive_head_pages", "naive_head_token_index"]
