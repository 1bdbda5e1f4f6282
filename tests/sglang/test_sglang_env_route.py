"""sglang.Engine(...) / sgl.Runtime(...) build ServerArgs(**kwargs): FreeKV comes from the environment."""

import pytest

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, settings_from_env


@pytest.fixture
def server_args_cls(plugins):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs


def test_env_turns_freekv_on(server_args_cls, monkeypatch):
    monkeypatch.setenv("SGLANG_KV_RETRIEVAL", "freekv")
    monkeypatch.setenv("FREEKV_ARGS", "--kv-budget 1024 --kv-window 256 --kvstore-arena-gb 2")
    sa = server_args_cls(model_path="dummy", disable_radix_cache=True)
    assert sa._freekv.config == FreeKVConfig(budget=1024, window=256)
    assert sa._freekv.kvstore_arena_gb == 2.0
    assert sa.page_size == 32 and sa.attention_backend == "triton"


def test_env_route_gets_the_same_checks(server_args_cls, monkeypatch):
    monkeypatch.setenv("SGLANG_KV_RETRIEVAL", "freekv")
    with pytest.raises(FreeKVArgsError, match="--disable-radix-cache"):
        server_args_cls(model_path="dummy", tp_size=2)
    with pytest.raises(FreeKVArgsError, match="--page-size"):
        server_args_cls(model_path="dummy", disable_radix_cache=True, page_size=16)
    with pytest.raises(FreeKVArgsError, match="--enable-mixed-chunk"):
        server_args_cls(model_path="dummy", disable_radix_cache=True, enable_mixed_chunk=True)
    monkeypatch.setenv("FREEKV_ARGS", "--kv-budget 33")
    with pytest.raises(FreeKVArgsError, match="--kv-budget"):
        server_args_cls(model_path="dummy", disable_radix_cache=True)


def test_engine_refuses_before_launching(plugins, monkeypatch):
    """sglang.Engine(**kwargs) loads the plugins, then builds ServerArgs: the refusal comes before any process."""
    import sglang

    monkeypatch.setenv("SGLANG_KV_RETRIEVAL", "freekv")
    # the first thing Engine._launch_subprocesses does: must not be reached
    monkeypatch.setattr("sglang.srt.entrypoints.engine.configure_logger", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(FreeKVArgsError, match="--attention-backend"):
        sglang.Engine(model_path="dummy", disable_radix_cache=True, attention_backend="fa3")


def test_freekv_args_alone_or_none_changes_nothing(server_args_cls, monkeypatch):
    monkeypatch.setenv("FREEKV_ARGS", "--kv-budget 1024")
    assert "_freekv" not in vars(server_args_cls(model_path="dummy"))
    monkeypatch.setenv("SGLANG_KV_RETRIEVAL", "none")
    assert "_freekv" not in vars(server_args_cls(model_path="dummy"))


def test_cli_overrides_env(plugins, monkeypatch):
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv("SGLANG_KV_RETRIEVAL", "freekv")
    monkeypatch.setenv("FREEKV_ARGS", "--kv-budget 1024 --kv-window 256")
    sa = prepare_server_args(["--model-path", "dummy", "--disable-radix-cache", "--kv-budget", "512"])
    assert sa._freekv.config == FreeKVConfig(budget=512, window=256)
    sa = prepare_server_args(["--model-path", "dummy", "--kv-retrieval", "none"])
    assert sa._freekv is None  # seen and off (the launch hooks then know the environment was overridden)


@pytest.mark.parametrize("env,match", [
    ({"SGLANG_KV_RETRIEVAL": "FreeKV"}, "SGLANG_KV_RETRIEVAL"),
    ({"SGLANG_KV_RETRIEVAL": "freekv", "FREEKV_ARGS": "--kv-budget"}, "FREEKV_ARGS"),
    ({"SGLANG_KV_RETRIEVAL": "freekv", "FREEKV_ARGS": "--page-size 32"}, "FREEKV_ARGS"),
    ({"SGLANG_KV_RETRIEVAL": "freekv", "FREEKV_ARGS": "--kv-budget 'unclosed"}, "FREEKV_ARGS"),
    ({"SGLANG_KV_RETRIEVAL": "none", "FREEKV_ARGS": "--kv-retrieval freekv"}, "contradicts"),
])
def test_bad_env_is_refused(env, match):
    with pytest.raises(FreeKVArgsError, match=match):
        settings_from_env(env)


def test_env_parsing_without_sglang():
    s = settings_from_env({"FREEKV_ARGS": "--kv-retrieval freekv --kv-correction-threshold 0"})
    assert s.config.tau == 0.0
    assert settings_from_env({}) is None


def test_runtime_route_without_plugins_is_refused(plugins, monkeypatch):
    """sgl.Runtime(...) builds ServerArgs before any plugin is loaded: with $SGLANG_KV_RETRIEVAL=freekv the launch
    must refuse rather than serve without FreeKV."""
    from types import SimpleNamespace

    from freekv_patches import engine_launch_scheduler_processes, engine_launch_subprocesses

    monkeypatch.setenv("SGLANG_KV_RETRIEVAL", "freekv")
    unseen = SimpleNamespace(model_path="dummy")  # never passed the __post_init__ hook
    for seam in (engine_launch_subprocesses, engine_launch_scheduler_processes):
        with pytest.raises(RuntimeError, match="load_plugins"):
            seam.hook(lambda *a, **k: pytest.fail("launched"), object, unseen)
    overridden = SimpleNamespace(model_path="dummy", _freekv=None)  # --kv-retrieval none on the CLI
    assert engine_launch_subprocesses.hook(lambda *a, **k: "plain", object, overridden) == "plain"
