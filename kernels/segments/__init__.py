"""LouisKV's temporal segments: each page leaving the window joins the open segment or starts one."""

from .naive import naive_segment_pages
from .triton import segment_pages

__all__ = ["naive_segment_pages", "segment_pages"]
