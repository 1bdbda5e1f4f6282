"""Shared pieces of the seams: the Seam record, FreeKV settings lookup, the launcher-to-__post_init__ hand-off."""

from __future__ import annotations

import contextvars
import dataclasses
import types
from collections.abc import Callable
from typing import Any

# The flag values parsed by the from_cli_args hook, read by the __post_init__ hook of the ServerArgs it builds.
PENDING_FLAG_VALUES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "freekv_pending_flag_values", default=None
)


@dataclasses.dataclass(frozen=True)
class Seam:
    """One hook on one SGLang symbol.

    target: dotted path HookRegistry patches. hook_type: a HookType member name. hook: the function registered.
    params: the parameter names the target has in sglang 0.5.16 (checked by tests/sglang). purpose: one line.
    """

    target: str
    hook_type: str
    hook: Callable
    params: tuple[str, ...]
    purpose: str
    module: str

    @classmethod
    def of(cls, module: types.ModuleType) -> Seam:
        return cls(
            target=module.TARGET,
            hook_type=module.HOOK_TYPE,
            hook=module.hook,
            params=tuple(module.PARAMS),
            purpose=module.PURPOSE,
            module=module.__name__,
        )


def settings_of(server_args: Any):
    """The FreeKVServerSettings a ServerArgs carries, or None when FreeKV is off."""
    return getattr(server_args, "_freekv", None) if server_args is not None else None


def tsp_alone_of(server_args: Any):
    """The FreeKVConfig of --kv-prefill tsp without FreeKV retrieval a ServerArgs carries (freekv_sglang.tsp_backend),
    or None."""
    return getattr(server_args, "_freekv_tsp", None) if server_args is not None else None


def batch_hooks_on(server_args: Any) -> bool:
    """Whether the backend needs FreeKV's per-batch attributes: FreeKV on, or --kv-prefill tsp alone."""
    return settings_of(server_args) is not None or tsp_alone_of(server_args) is not None


def copy_batch_attrs(src: Any, dst: Any) -> None:
    """Carry FreeKV's per-batch attributes from one ForwardBatch (or view) to another built from it."""
    if dst is None or dst is src or not hasattr(src, "__dict__") or "_freekv_req_slots_cpu" not in vars(src):
        return
    dst._freekv_req_slots_cpu = src._freekv_req_slots_cpu
    dst._freekv_raw_bs = getattr(src, "_freekv_raw_bs", None)
    dst._freekv_prefill_done_cpu = getattr(src, "_freekv_prefill_done_cpu", None)
    dst._freekv_prefix_pins = getattr(src, "_freekv_prefix_pins", None)


def check_env_request_was_seen(server_args: Any) -> None:
    """$SGLANG_KV_RETRIEVAL=freekv asks for FreeKV, but these ServerArgs never passed the __post_init__ hook (built in
    a process that had not loaded the plugins, as sgl.Runtime(...) does): refuse instead of serving without FreeKV."""
    if server_args is None or "_freekv" in vars(server_args):
        return
    from freekv_sglang.server_args import ENV_KV_RETRIEVAL, env_flag_values

    if env_flag_values().get("kv_retrieval") == "freekv":
        raise RuntimeError(
            f"${ENV_KV_RETRIEVAL}=freekv is set, but these server arguments were built before the FreeKV plugin was "
            "loaded, so FreeKV would be silently off. sgl.Runtime(...) builds them that way: call "
            "sglang.srt.plugins.load_plugins() before sgl.Runtime(...), or use sglang.Engine(...) / "
            "python -m sglang.launch_server"
        )
