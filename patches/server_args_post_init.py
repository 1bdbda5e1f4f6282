"""Seam: AROUND sglang.srt.server_args.ServerArgs.__post_init__. Written against sglang 0.5.16.

Every ServerArgs passes here: the CLI (through from_cli_args, which hands over the parsed FreeKV flags) and
sglang.Engine(**kwargs) / sgl.Runtime(**kwargs) (which read $SGLANG_KV_RETRIEVAL and $FREEKV_ARGS). With FreeKV on
it sets --page-size to --kv-page-size (or refuses a different one) and names the triton attention backend when none
was named, before SGLang resolves the rest; it refuses incompatible arguments before and after SGLang's resolution
(so SGLang's own defaults are checked too), checks the model when SGLang already loaded its config, and stores
server_args._freekv. With --kv-prefill tsp alone (no FreeKV retrieval) it names the flashinfer attention backend when
none was named, refuses what that mode cannot serve before and after resolution (freekv_sglang.server_args
.tsp_alone_problems) and stores server_args._freekv_tsp. With both off it only calls the original.
"""

from __future__ import annotations

from ._common import PENDING_FLAG_VALUES

TARGET = "sglang.srt.server_args.ServerArgs.__post_init__"
HOOK_TYPE = "AROUND"
PARAMS = ("self",)
PURPOSE = "validate FreeKV against the server args (CLI and Engine/env routes), preset --page-size, store _freekv"


def hook(orig, self):
    from freekv_sglang.server_args import (
        check_model,
        check_server_args,
        check_tsp_alone,
        tsp_alone_from_values,
        env_flag_values,
        preset_server_fields,
        settings_from_values,
    )

    values = PENDING_FLAG_VALUES.get()
    if values is None:
        values = env_flag_values()
    else:
        PENDING_FLAG_VALUES.set(None)  # one ServerArgs per hand-off (none built inside __post_init__ inherits it)
    settings = settings_from_values(values)
    tsp = tsp_alone_from_values(values)
    if tsp is not None:  # --kv-prefill tsp without FreeKV retrieval (freekv_sglang.tsp_backend)
        from . import require_hooks

        require_hooks("enabling --kv-prefill tsp")
        backends = ("attention_backend", "decode_attention_backend", "prefill_attention_backend")
        if all(getattr(self, k, None) is None for k in backends):
            self.attention_backend = "flashinfer"  # the later layers decode through FlashInfer in any case
        check_tsp_alone(self, tsp)
        result = orig(self)
        check_tsp_alone(self, tsp)
        self._freekv_tsp = tsp
        return result
    if settings is None:
        result = orig(self)
        if env_flag_values().get("kv_retrieval") == "freekv":
            self._freekv = None  # $SGLANG_KV_RETRIEVAL=freekv overridden by --kv-retrieval none: seen, and off
        return result

    from . import require_hooks

    require_hooks("enabling --kv-retrieval freekv")
    fields = {k: getattr(self, k, None) for k in ("page_size", "attention_backend", "decode_attention_backend",
                                                  "prefill_attention_backend")}
    for name, value in preset_server_fields(fields, settings).items():
        setattr(self, name, value)
    check_server_args(self, settings)  # what the user passed: fail before SGLang loads anything
    result = orig(self)
    check_server_args(self, settings)  # what SGLang resolved (its defaults and model-specific overrides)
    model_config = vars(self).get("model_config")  # cached by get_model_config() during resolution, if any
    if model_config is not None and getattr(model_config, "hf_config", None) is not None:
        check_model(model_config.hf_config, settings.config)
    self._freekv = settings
    return result
