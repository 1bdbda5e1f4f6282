"""Seam: AROUND sglang.srt.server_args.ServerArgs.from_cli_args (classmethod). Written against sglang 0.5.16.

from_cli_args keeps only the argparse attributes that are ServerArgs fields, so FreeKV's flags would be dropped.
This hook reads them from the namespace (over $SGLANG_KV_RETRIEVAL / $FREEKV_ARGS) and hands them to the
ServerArgs.__post_init__ hook, which validates them, presets --page-size and stores server_args._freekv. Afterwards
it checks that this happened (a FreeKV request must never be silently dropped).
"""

from __future__ import annotations

from ._common import PENDING_FLAG_VALUES, settings_of

TARGET = "sglang.srt.server_args.ServerArgs.from_cli_args"
HOOK_TYPE = "AROUND"
PARAMS = ("cls", "args")
PURPOSE = "read the FreeKV flags from the argparse namespace and hand them to __post_init__"


def hook(orig, cls, args):
    from freekv_sglang.server_args import env_flag_values, flag_values, merge_flag_values, settings_from_values

    values = merge_flag_values(flag_values(args), env_flag_values())
    wanted = settings_from_values(values)  # raises on bad values before SGLang does any work
    token = PENDING_FLAG_VALUES.set(values)
    try:
        server_args = orig(cls, args)
    finally:
        PENDING_FLAG_VALUES.reset(token)
    if wanted is not None and settings_of(server_args) is None:
        from . import require_hooks

        require_hooks("parsing --kv-retrieval freekv")
        raise RuntimeError("--kv-retrieval freekv was parsed but ServerArgs carries no FreeKV settings")
    return server_args
