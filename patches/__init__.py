"""freekv_patches: every place FreeKV touches SGLang internals, written against sglang 0.5.16.

One module per seam (one hooked SGLang symbol); each names its target, hook type, the target's parameters in
0.5.16 (PARAMS, checked by tests/sglang/test_sglang_targets.py) and its purpose. SEAMS is the table of all of them.
register_hooks() registers them with sglang.srt.plugins.hook_registry.HookRegistry (the plugin entry point
freekv_sglang.plugin:register calls it; load_plugins() then applies them in the launcher and in every scheduler
process). Every hook is a no-op unless the server runs FreeKV (server_args._freekv set).

HookRegistry.apply_hooks() logs and skips a target it cannot patch, and load_plugins() swallows plugin errors, so
a FreeKV server calls require_hooks() at every stage (parsing --kv-retrieval freekv, ServerArgs, launch, each
scheduler's ModelRunner, the attention backend) and refuses to run with any hook missing.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil

from ._common import Seam

logger = logging.getLogger("freekv_patches")

SGLANG_VERSION = "0.5.16"

_SEAM_MODULES = (
    "server_args_add_cli_args",
    "server_args_from_cli_args",
    "server_args_post_init",
    "engine_launch_subprocesses",
    "engine_launch_scheduler_processes",
    "scheduler_metrics_collector",
    "scheduler_update_running_batch",
    "scheduler_process_batch_result",
    "scheduler_get_new_batch_prefill",
    "schedule_policy_calc_priority",
    "prefill_adder_add_one_req",
    "kv_pool_config",
    "kv_pool_build",
    "tree_cache_create",
    "model_runner_post_pool",
    "model_runner_dummy_batch",
    "attn_backend_wrapper",
    "model_runner_calibrate",
    "req_pool_free",
    "forward_batch_init_new",
    "eager_runner_load_batch",
    "prefill_graph_load_batch",
    "prefill_graph_capture_prepare",
    "decode_graph_capture_prepare",
    "decode_graph_replay_view",
    "graph_capture_stream",
    "weight_update_refresh",
)

SEAMS: tuple[Seam, ...] = tuple(Seam.of(importlib.import_module(f"{__name__}.{m}")) for m in _SEAM_MODULES)

_registered = False


def register_hooks() -> None:
    """Register every seam with SGLang's HookRegistry (idempotent per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    version = _sglang_version()
    if version != SGLANG_VERSION:
        logger.warning("freekv_patches is written against sglang %s, found %s: FreeKV will refuse to run",
                       SGLANG_VERSION, version)
    for seam in SEAMS:
        HookRegistry.register(seam.target, seam.hook, HookType[seam.hook_type])
    _registered = True


def _sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return None


def resolve_target(target: str):
    """The object currently bound at target (unwrapping classmethod/staticmethod from the class __dict__)."""
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    value = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if isinstance(value, (classmethod, staticmethod)):
        value = value.__func__
    return value


def _wraps_hook(fn, hook) -> bool:
    """True when fn is a HookRegistry wrapper chain (linked by __wrapped__) holding hook in a closure."""
    seen = 0
    while fn is not None and seen < 32:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                pass
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def missing_hooks() -> list[str]:
    """Targets whose FreeKV hook is not in place in this process (empty when all are)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
    except Exception as e:  # noqa: BLE001
        return [f"sglang.srt.plugins.hook_registry ({e})"]
    missing = []
    for seam in SEAMS:
        try:
            ok = seam.target in HookRegistry._patched and _wraps_hook(resolve_target(seam.target), seam.hook)
        except Exception:  # noqa: BLE001 - an unresolvable target is a missing hook
            ok = False
        if not ok:
            missing.append(seam.target)
    return missing


def require_hooks(context: str) -> None:
    """Raise RuntimeError naming every missing hook (and a wrong sglang version) while doing context."""
    problems = []
    version = _sglang_version()
    if version != SGLANG_VERSION:
        problems.append(f"sglang {version} is installed; freekv_patches is written against sglang {SGLANG_VERSION}")
    if not _registered:
        problems.append("the freekv plugin was not loaded (is freekv-sglang installed, and SGLANG_PLUGINS unset "
                        "or naming 'freekv'?)")
    missing = missing_hooks()
    if missing:
        problems.append("hooks not applied (see HookRegistry's log for why): " + ", ".join(missing))
    if problems:
        raise RuntimeError(f"FreeKV cannot run ({context}):\n" + "\n".join(f"  - {p}" for p in problems))


__all__ = ["SEAMS", "SGLANG_VERSION", "Seam", "missing_hooks", "register_hooks", "require_hooks", "resolve_target"]
