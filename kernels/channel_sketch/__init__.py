"""Page selection from 4-bit codes of a few key channels calibrated per (layer, KV head), with the same steps for
every page: one tensor-core product per (request, KV head, block of pages)."""

from .naive import (
    ChannelCalibration,
    calibrate_channels,
    channel_weights,
    decode_channels,
    naive_channel_sketch_pages,
    naive_write_channel_codes,
    quantize_channels,
)
from .triton import channel_sketch_pages

__all__ = [
    "ChannelCalibration",
    "calibrate_channels",
    "channel_sketch_pages",
    "channel_weights",
    "decode_channels",
    "naive_channel_sketch_pages",
    "naive_write_channel_codes",
    "quantize_channels",
]
