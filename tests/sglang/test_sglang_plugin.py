"""The plugin is discoverable, load_plugins() applies every seam, and the patched symbols are what SGLang calls."""

import importlib.metadata
import pickle

import pytest


def test_entry_point_is_discoverable():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "freekv"]
    assert [ep.value for ep in ours] == ["freekv_sglang.plugin:register"]
    from freekv_sglang.plugin import register

    assert ours[0].load() is register


def test_load_plugins_applies_every_hook(plugins):
    from sglang.srt.plugins.hook_registry import HookRegistry

    targets = [seam.target for seam in plugins.SEAMS]
    assert len(set(targets)) == len(targets)
    assert set(targets) <= HookRegistry._patched
    assert plugins.missing_hooks() == []
    plugins.require_hooks("test")  # no raise


def test_register_is_idempotent(plugins):
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {t: len(HookRegistry._hooks[t]) for t in (s.target for s in plugins.SEAMS)}
    plugins.register_hooks()
    from freekv_sglang.plugin import register

    register()
    assert {t: len(HookRegistry._hooks[t]) for t in before} == before


def test_stale_bindings_see_the_patch(plugins):
    """attention_backend_setup did `from attention_registry import attn_backend_wrapper`: it must get the wrapper."""
    import sglang.srt.layers.attention.attention_registry as registry
    import sglang.srt.model_executor.model_runner_components.attention_backend_setup as setup
    from freekv_patches import attn_backend_wrapper

    assert setup.attn_backend_wrapper is registry.attn_backend_wrapper
    assert plugins._wraps_hook(setup.attn_backend_wrapper, attn_backend_wrapper.hook)


def test_missing_hook_is_detected(plugins, monkeypatch):
    import sglang.srt.mem_cache.memory_pool as memory_pool

    wrapped = memory_pool.ReqToTokenPool.free
    monkeypatch.setattr(memory_pool.ReqToTokenPool, "free", wrapped.__wrapped__)
    assert plugins.missing_hooks() == ["sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free"]
    with pytest.raises(RuntimeError, match="ReqToTokenPool.free"):
        plugins.require_hooks("test")


def test_scheduler_entry_still_pickles(plugins):
    """mp.Process(target=Engine.run_scheduler_process_func) pickles that function by name; the seams must not
    replace it (a hook on run_scheduler_process would: 'not the same object as ...run_scheduler_process')."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.scheduler import run_scheduler_process

    assert pickle.loads(pickle.dumps(Engine.run_scheduler_process_func)) is run_scheduler_process
    assert not any(seam.target.endswith("run_scheduler_process") for seam in plugins.SEAMS)
