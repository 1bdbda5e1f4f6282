"""Seam: AFTER sglang.srt.server_args.ServerArgs.add_cli_args (staticmethod). Written against sglang 0.5.16.

Adds FreeKV's flags (--kv-retrieval, --kv-budget, ..., --kvstore-arena-gb) to SGLang's parser, so they appear in
`python -m sglang.launch_server --help` and in `sglang serve`. --kv-retrieval freekv also checks, while the command
line is parsed, that every FreeKV hook is in place (HookRegistry only logs a hook it could not apply).
"""

from __future__ import annotations

import argparse

TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
HOOK_TYPE = "AFTER"
PARAMS = ("parser",)
PURPOSE = "add the --kv-* and --kvstore-* flags to SGLang's CLI"


class _KVRetrievalAction(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):
        if values == "freekv":
            from . import missing_hooks

            missing = missing_hooks()
            if missing:
                parser.error(f"--kv-retrieval freekv: FreeKV hooks not applied: {', '.join(missing)}")
        super().__call__(parser, namespace, values, option_string)


def hook(result, parser):
    from freekv_sglang.server_args import add_freekv_args

    if any("--kv-retrieval" in a.option_strings for a in parser._actions):
        return None  # already added (the hook is idempotent per parser)
    add_freekv_args(parser, retrieval_action=_KVRetrievalAction)
    return None
