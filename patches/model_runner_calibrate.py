"""Seam: AFTER sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends. Written against sglang
0.5.16.

Runs in every scheduler process once the FreeKV attention backend exists, before the CUDA graphs are captured. When
its selection needs a calibration (--kv-selection channels: which key channels to code and their ranges, once per
model, so radix-shared pages keep valid codes whoever wrote them), it runs one dense causal forward of the model's
decoder over the calibration ids with freekv_sglang.calibration.CalibrationAttention published as the attention
backend (SGLang's RadixAttention calls the published backend), and refuses to start if a sparse layer was not reached.
The ids are the first 4,096 tokens of Python's argparse source through the model's tokenizer, as the accuracy harness
and the HF adapter use, or seeded random ids for random weights (--load-format dummy). Every TP rank runs the same
pass (the model's collectives match) and calibrates its own heads. The calibration is copied into buffers the
selector allocated at construction, so graphs captured later read it in place.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from ._common import settings_of

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
HOOK_TYPE = "AFTER"
PARAMS = ("self",)
PURPOSE = "calibrate a selection that needs it (--kv-selection channels) with one dense pass, before graph capture"

logger = logging.getLogger("freekv_patches")


def hook(result, self):
    if settings_of(getattr(self, "server_args", None)) is None:
        return None
    from freekv_sglang.sglang_backend import FreeKVAttnBackend

    backend = getattr(self, "attn_backend", None)
    if not isinstance(backend, FreeKVAttnBackend):
        raise RuntimeError(f"FreeKV: the runner's attention backend is {type(backend).__name__}, not FreeKV's wrapper")
    if backend.needs_calibration:
        calibrate(self, backend)
    return None


def calibrate(runner, backend) -> None:
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from freekv_sglang.calibration import CALIBRATION_TOKENS, CalibrationAttention
    from freekv_sglang.server_args import FreeKVArgsError

    decoder = getattr(runner.model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise FreeKVArgsError(f"--kv-selection {backend.engine.cfg.selection}: {type(runner.model).__name__} has no "
                              "decoder model.model to run the calibration pass through; pick another --kv-selection")
    interleaved = [name for name, m in runner.model.named_modules() if getattr(m, "is_neox_style", True) is False]
    if interleaved:  # the calibration's ranges pair channel i with i + D/2, as rotate-half RoPE turns them
        raise FreeKVArgsError(f"--kv-selection {backend.engine.cfg.selection} assumes rotate-half RoPE; "
                              f"{interleaved[0]} rotates interleaved pairs: pick another --kv-selection")
    num_tokens = min(CALIBRATION_TOKENS, runner.model_config.context_len)
    ids = _ids(runner, num_tokens)
    start = time.perf_counter()
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND)  # what decoder layers and RadixAttention read
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=CalibrationAttention(backend.calibrate_layer))):
        decoder(torch.tensor(ids, device=runner.device), torch.arange(len(ids), device=runner.device), fb)
    if torch.device(runner.device).type == "cuda":
        torch.cuda.empty_cache()  # the pass's activations: SGLang sizes its pools from free memory after capture
    missing = backend.uncalibrated_layers()
    if missing:
        raise RuntimeError(f"FreeKV: the calibration pass reached no attention of layers {missing}")
    logger.info("FreeKV: calibrated --kv-selection %s from %d tokens in %.2f s", backend.engine.cfg.selection,
                len(ids), time.perf_counter() - start)


def _ids(runner, num_tokens: int) -> list[int]:
    from freekv_sglang.calibration import calibration_ids, random_calibration_ids
    from freekv_sglang.server_args import FreeKVArgsError

    sa = runner.server_args
    if str(sa.load_format) == "dummy":
        logger.info("FreeKV: random weights (--load-format dummy): calibrating from seeded random token ids")
        return random_calibration_ids(runner.model_config.vocab_size, num_tokens)
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    try:
        tokenizer = get_tokenizer(sa.tokenizer_path, tokenizer_mode=sa.tokenizer_mode,
                                  trust_remote_code=sa.trust_remote_code, revision=sa.revision,
                                  tokenizer_backend=sa.tokenizer_backend)
    except Exception as e:  # noqa: BLE001 - any load failure is the same refusal
        raise FreeKVArgsError(f"--kv-selection {runner.server_args._freekv.config.selection} calibrates from text "
                              f"through the model's tokenizer, which did not load from {sa.tokenizer_path!r} ({e}): "
                              "pass --tokenizer-path, or pick another --kv-selection") from e
    return calibration_ids(tokenizer, num_tokens)
