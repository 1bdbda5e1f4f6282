"""Query-based identification (FreeKV fine-grained correction): which KV heads need a corrective recall."""

from .naive import naive_query_similarity
from .triton import query_similarity

__all__ = ["query_similarity", "naive_query_similarity"]
