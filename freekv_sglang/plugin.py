"""The SGLang plugin of FreeKV: the `sglang.srt.plugins` entry point `freekv = "freekv_sglang.plugin:register"`.

SGLang's load_plugins() calls register() in the launcher (`python -m sglang.launch_server`, `sglang serve`,
sglang.Engine) and again in every scheduler process; register() hands freekv_patches' hooks to HookRegistry, which
load_plugins() then applies. Installing the package adds the flags and nothing else: every hook is a no-op until
FreeKV is turned on, with `--kv-retrieval freekv` on the command line or, for sglang.Engine(...) / sgl.Runtime(...),
whose keyword arguments cannot carry unknown flags, through the environment:

    SGLANG_KV_RETRIEVAL=freekv
    FREEKV_ARGS="--kv-budget 2048 --kv-window 512 --kvstore-arena-gb 32"

FREEKV_ARGS is parsed by the same parser as the CLI flags (freekv_sglang.server_args) and gets the same checks.
On the command line, explicit flags override the environment. sgl.Runtime(...) builds its ServerArgs before SGLang
loads any plugin: call sglang.srt.plugins.load_plugins() first (the launch refuses otherwise rather than serve
without FreeKV). `SGLANG_PLUGINS=...` (SGLang's whitelist of plugin names) must include `freekv` when it is set.
"""

from __future__ import annotations


def register() -> None:
    from freekv_patches import register_hooks

    register_hooks()
