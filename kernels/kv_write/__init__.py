"""The decode step's KV write: each row's new K/V token into its cache row."""

from .naive import naive_write_kv
from .triton import write_kv

__all__ = ["naive_write_kv", "write_kv"]
