"""Seam: AROUND sglang.srt.layers.attention.attention_registry.attn_backend_wrapper. Written against sglang 0.5.16.

Every attention backend a ModelRunner builds passes through attn_backend_wrapper (model_executor/
model_runner_components/attention_backend_setup.py imports it by name; HookRegistry's _propagate_patch rewrites
that binding, and a later import reads the patched module attribute). With FreeKV on, the backend SGLang built
(triton, flashinfer, or a HybridAttnBackend of the two when prefill and decode differ) is wrapped in
freekv_sglang.sglang_backend.FreeKVAttnBackend(runner, backend, settings); with --kv-prefill tsp alone, in
freekv_sglang.tsp_backend.TSPAttnBackend. The wrapper object is what ModelRunner publishes for eager runs, CUDA-graph
capture and replay.
"""

from __future__ import annotations

from ._common import settings_of, tsp_alone_of

TARGET = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"
HOOK_TYPE = "AROUND"
PARAMS = ("runner", "full_attn_backend")
PURPOSE = "wrap the attention backend SGLang built in FreeKVAttnBackend"


def hook(orig, runner, full_attn_backend):
    backend = orig(runner, full_attn_backend)
    settings = settings_of(getattr(runner, "server_args", None))
    if settings is None:
        tsp = tsp_alone_of(getattr(runner, "server_args", None))
        if tsp is None:
            return backend
        from freekv_sglang.tsp_backend import TSPAttnBackend

        return TSPAttnBackend(runner, backend, tsp.tsp_layer, tsp.tsp_keep)
    from . import require_hooks

    require_hooks("building the FreeKV attention backend")
    from freekv_sglang.sglang_backend import FreeKVAttnBackend

    return FreeKVAttnBackend(runner, backend, runner.server_args._freekv)
