"""Seam: AFTER sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components. Written against
sglang 0.5.16.

Runs in every scheduler process (one per TP/PP rank) once the model is loaded and the memory pools exist, before
the attention backends are built and the CUDA graphs captured. With FreeKV on it:
  - refuses to start when any FreeKV hook is missing in this process (HookRegistry.apply_hooks only logs a target
    it cannot patch, and run_scheduler_process's load_plugins() swallows plugin errors);
  - refuses models FreeKV cannot serve (freekv_sglang.server_args.check_model on the HF config, plus SGLang's own
    view: an MLA backend, hybrid sliding-window pools, a draft worker);
  - takes the kvstore endpoint from $FREEKV_KVSTORE_ENDPOINT if server_args._freekv has none, and refuses without;
  - marks the ReqToTokenPool so the free() hook reports freed slots, and gives ForwardBatch class-level None
    defaults for _freekv_req_slots_cpu / _freekv_raw_bs / _freekv_prefill_done_cpu (batches no hook saw read
    None, not AttributeError);
  - with --kv-correct-at previous_mlp(_only), wraps the decoder layers and their post-attention norms so each sparse
    layer's query is predicted from the previous layer's mid residual (freekv_sglang.early_query; state on the
    runner, runner._freekv_early, for the FreeKV backend): the next layer's input norm, the Q rows of its qkv_proj and
    its rotary embedding, as Llama's and Qwen2's attention hold them; unquantized weights and no QK norm; with
    --kv-early-weights fp8, an e4m3 copy of each Q block made here (the memory plan counted it), which the
    backend's next decode re-derives after a weight update (weight_update_refresh marks them stale);
  - with --kv-prefill tsp (with FreeKV or alone), wraps the model's decoder layers (model.model.layers, called as Llama's and Qwen2's are)
    for token-selective propagation (freekv_sglang.tsp_propagation) and leaves their shared state on the runner
    (runner._freekv_tsp) for the FreeKV backend.
(An AROUND hook on run_scheduler_process cannot do this: Engine passes its own reference to the original function to
mp.Process, and pickling that reference fails once the module attribute is a wrapper.)
"""

from __future__ import annotations

import os

from ._common import settings_of, tsp_alone_of

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components"
HOOK_TYPE = "AFTER"
PARAMS = ("self",)
PURPOSE = "scheduler-side self-check (hooks, model, kvstore endpoint); mark the request pool"


def hook(result, self):
    server_args = getattr(self, "server_args", None)
    settings = settings_of(server_args)
    if settings is None:
        tsp = tsp_alone_of(server_args)
        if tsp is not None:
            from . import require_hooks

            require_hooks("starting a --kv-prefill tsp scheduler")
            _install_tsp(self, tsp.tsp_layer)
            _batch_defaults()
        return None
    from freekv_sglang.server_args import ENV_KVSTORE_ENDPOINT, FreeKVArgsError, check_model

    from . import require_hooks

    require_hooks("starting a FreeKV scheduler")
    problems = []
    if getattr(self, "is_draft_worker", False):
        problems.append("a speculative draft worker was started; drop --speculative-algorithm")
    if getattr(self, "use_mla_backend", False):
        problems.append("the model runs on an MLA attention backend; FreeKV serves MHA/GQA models only")
    model_config = getattr(self, "model_config", None)
    if getattr(model_config, "is_hybrid_swa", False):
        problems.append("the model has sliding-window layers (hybrid SWA pools); FreeKV serves full-attention "
                        "models only")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise FreeKVArgsError(f"--kv-retrieval freekv cannot serve this model:\n{lines}")
    if model_config is not None and getattr(model_config, "hf_config", None) is not None:
        check_model(model_config.hf_config, settings.config)
    if settings.kvstore_endpoint is None:
        endpoint = os.environ.get(ENV_KVSTORE_ENDPOINT)
        if not endpoint:
            raise RuntimeError(
                "FreeKV: no kvstore endpoint reached this scheduler (server_args._freekv.kvstore_endpoint and "
                f"${ENV_KVSTORE_ENDPOINT} are unset); pass --kvstore-endpoint or launch through "
                "sglang.launch_server / sglang.Engine so the embedded daemon starts"
            )
        server_args._freekv = settings = settings.with_endpoint(endpoint)
    if settings.config.prefill == "tsp":
        _install_tsp(self, settings.config.tsp_layer)
    if settings.config.anticipates:
        _install_early(self, settings.config.dense_layers, settings.config.correct_at, settings.config.early_weights)
    pool = getattr(self, "req_to_token_pool", None)
    if pool is not None:
        pool._freekv_enabled = True
    _batch_defaults()
    return None


def _batch_defaults() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    for name in ("_freekv_req_slots_cpu", "_freekv_raw_bs", "_freekv_prefill_done_cpu", "_freekv_prefix_pins"):
        if not hasattr(ForwardBatch, name):
            setattr(ForwardBatch, name, None)


def _whole_layers(runner, setting: str, flag: str):
    """The model's decoder layers (model.model.layers), which `setting` wraps; refused naming `flag` unless one rank
    runs them all."""
    from freekv_sglang.server_args import FreeKVArgsError

    model = getattr(runner, "model", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or getattr(model.model, "start_layer", 0) != 0 or \
            getattr(model.model, "end_layer", len(layers)) != len(layers):
        raise FreeKVArgsError(f"{setting}: {type(model).__name__} has no decoder-layer list model.model.layers "
                              f"that one rank runs whole; drop {flag}")
    return layers


def _install_tsp(runner, tsp_layer: int) -> None:
    from freekv_sglang.tsp_propagation import Propagation, install

    layers = _whole_layers(runner, "--kv-prefill tsp", "--kv-prefill")
    runner._freekv_tsp = state = Propagation()
    install(layers, tsp_layer, state)


def _install_early(runner, dense_layers: int, correct_at: str, weights: str = "model") -> None:
    import inspect

    import torch
    import torch.nn.functional as F

    from freekv_sglang.early_query import EarlyQuery, install, predicted_layers, quantize_rows_into
    from freekv_sglang.server_args import FreeKVArgsError

    flag = f"--kv-correct-at {correct_at}"
    layers = _whole_layers(runner, flag, "--kv-correct-at")
    model = runner.model
    fp8_copies = []  # (qkv_proj, q_size, e4m3 rows, exponents): what EarlyQuery.refresh_weights re-derives
    if weights == "fp8":
        from freekv_kernels.fp8_rows import FP8_DTYPE
        from freekv_sglang.ops import load_ops

        device = torch.device(getattr(runner, "device", "cpu"))
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise FreeKVArgsError("--kv-early-weights fp8 needs FP8 arithmetic (compute capability 8.9 or newer), "
                                  f"this GPU is {torch.cuda.get_device_name(device)}: drop --kv-early-weights")
        # The Triton kernel on a GPU; its torch reference (the same sums) where the model runs on the CPU.
        fp8_linear = load_ops("triton" if device.type == "cuda" else "torch").fp8_linear

        def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """e4m3 rows and exponents of w, 1,024 rows at a time (the codec's fp32 temporaries stay small)."""
            if w.device.type != device.type:
                raise FreeKVArgsError(f"--kv-early-weights fp8: W_q lies on {w.device}, not on the model's "
                                      f"{device} (offloaded weights?): drop --kv-early-weights")
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            e = torch.empty(w.shape[0], dtype=torch.int8, device=w.device)
            quantize_rows_into(w, q, e)
            return q, e

    def fused_norm(layer, norm: str) -> bool:  # SGLang's Llama/Qwen2 call: the norm adds the residual itself
        try:
            return f"self.{norm}(hidden_states, residual)" in inspect.getsource(type(layer).forward)
        except (OSError, TypeError):
            return False

    def predictor(j: int):
        if not fused_norm(layers[j - 1], "post_attention_layernorm"):
            raise FreeKVArgsError(f"{flag}: decoder layer {j - 1} of {type(model).__name__} "
                                  "does not call its post-attention norm with the residual (SGLang's fused "
                                  "add-and-norm, which gives the mid residual the prediction reads): drop "
                                  "--kv-correct-at")
        if not fused_norm(layers[j], "input_layernorm"):  # early_query releases the mid residual there
            raise FreeKVArgsError(f"{flag}: decoder layer {j} of {type(model).__name__} does not call its input "
                                  "norm with the residual (SGLang's fused add-and-norm, before which the prediction "
                                  "must have read the mid residual): drop --kv-correct-at")
        layer = layers[j]
        attn, norm = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
        qkv, rope = getattr(attn, "qkv_proj", None), getattr(attn, "rotary_emb", None)
        weight, q_size = getattr(qkv, "weight", None), getattr(attn, "q_size", None)
        if norm is None or rope is None or q_size is None or getattr(attn, "kv_size", None) is None or \
                not isinstance(weight, torch.Tensor) or \
                not hasattr(layers[j - 1], "post_attention_layernorm"):
            raise FreeKVArgsError(f"{flag}: decoder layer {j} of {type(model).__name__} has "
                                  "no input_layernorm, self_attn.qkv_proj.weight, q_size, kv_size and rotary_emb as "
                                  "Llama's "
                                  "and Qwen2's do, to predict its query from; drop --kv-correct-at")
        if not weight.is_floating_point() or weight.element_size() < 2 or \
                type(getattr(qkv, "quant_method", None)).__name__ not in ("UnquantizedLinearMethod", "NoneType"):
            raise FreeKVArgsError(f"{flag}: decoder layer {j}'s QKV projection is quantized "
                                  f"({weight.dtype}); its query is predicted from unquantized weights only: drop "
                                  "--kv-correct-at")
        if getattr(attn, "q_norm", None) is not None:
            raise FreeKVArgsError(f"{flag}: decoder layer {j} normalises its queries (QK "
                                  "norm), which the prediction does not: drop --kv-correct-at")
        w = weight[:q_size]
        bias = getattr(qkv, "bias", None)
        b = None if bias is None else bias[:q_size]
        if weights == "fp8":  # a copy (planned in the memory plan's early W_q): half the bytes each step reads
            w8, e = quantize(w)
            fp8_copies.append((qkv, q_size, w8, e))
            project = lambda x: fp8_linear(x, w8, e, b)  # noqa: E731
        else:
            project = lambda x: F.linear(x, w, b)  # noqa: E731

        normalize = norm.forward  # not early_query's wrapper of it, which releases the mid residual

        def predict(mid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            q = project(normalize(mid))
            # rope rotates a key too: an unwritten one (its result is dropped), so no fill kernel joins the lane
            q, _ = rope(positions, q, torch.empty_like(q[:, :attn.kv_size]))
            return q
        return predict

    runner._freekv_early = state = EarlyQuery()
    install(layers, state, {j: predictor(j) for j in predicted_layers(len(layers), dense_layers)})
    state.fp8_weights = fp8_copies

