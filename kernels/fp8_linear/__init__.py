"""x @ W^T + bias with W stored as e4m3 rows and a power-of-two scale a row (fp8_rows' codec)."""

from .naive import naive_fp8_linear
from .triton import fp8_linear

__all__ = ["fp8_linear", "naive_fp8_linear"]
