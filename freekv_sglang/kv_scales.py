"""A checkpoint's KV scales on SGLang's attention layers, as FreeKV's own attention applies them."""

from __future__ import annotations


def kv_scales(layer) -> tuple[float, float]:
    """(k_scale, v_scale) of an SGLang attention layer, applied as SGLang's decode kernels apply them: the logits times
    k_scale, the output times v_scale. Quantized checkpoints carry them even over a 16-bit cache (1.0 where the
    checkpoint has none); a layer without scales gives (1.0, 1.0)."""
    if getattr(layer, "k_scale", None) is None or getattr(layer, "v_scale", None) is None:
        return 1.0, 1.0
    k, v = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    if k is None or v is None:  # SGLang sets the floats once the checkpoint's scales are loaded
        raise RuntimeError(f"layer {layer.layer_id}: KV scales without their float values (k_scale_float / "
                           "v_scale_float), which FreeKV's own attention reads: serve with --kv-attention backend")
    return k, v
