from .naive import naive_head_token_index
from .triton import head_token_index

__all__ = ["head_token_index", "naive_head_token_index"]
