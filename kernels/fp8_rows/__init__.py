from .naive import FP8_DTYPE, naive_dequantize_rows, naive_quantize_rows
from .triton import dequantize_rows, quantize_rows

__all__ = ["FP8_DTYPE", "naive_quantize_rows", "naive_dequantize_rows", "quantize_rows", "dequantize_rows"]
