"""The launcher starts the embedded kvstore daemon before the schedulers spawn, hands its endpoint to them, and
stops it when the launch fails (the hooks called with a stand-in for SGLang's launch; the daemon is real)."""

import os
from types import SimpleNamespace

import pytest

from freekv_kvstore import ping_daemon
from freekv_kvstore.errors import DaemonUnavailable
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, FreeKVServerSettings, check_arena_fits

ENV = "FREEKV_KVSTORE_ENDPOINT"


def _server_args(**kw):
    return SimpleNamespace(_freekv=FreeKVServerSettings(config=FreeKVConfig(), kvstore_arena_gb=0.05, **kw))


def test_embedded_kvstore_starts_before_the_schedulers(plugins):
    from freekv_patches import engine_launch_subprocesses, engine_launch_scheduler_processes

    sa = _server_args()
    seen = {}

    def spawn_schedulers(cls, server_args, *args):
        seen["endpoint"] = server_args._freekv.kvstore_endpoint
        seen["env"] = os.environ.get(ENV)
        ping_daemon(seen["endpoint"], timeout_s=5)  # up before any scheduler starts
        return "launched"

    def launch(cls, server_args, **kwargs):
        # what Engine._launch_subprocesses does after load_plugins(): cls._launch_scheduler_processes(...)
        return engine_launch_scheduler_processes.hook(spawn_schedulers, cls, server_args, None, None)

    assert engine_launch_subprocesses.hook(launch, object, sa, run_scheduler_process_func=None) == "launched"
    assert seen["endpoint"] and seen["endpoint"] == seen["env"] == sa._freekv.kvstore_endpoint
    from freekv_patches import _kvstore

    handle = next(h for h in _kvstore._STARTED if h.endpoint == seen["endpoint"])
    handle.stop()  # what atexit does
    with pytest.raises(DaemonUnavailable):
        ping_daemon(seen["endpoint"], timeout_s=0.5)


def test_failed_launch_stops_the_daemon(plugins):
    from freekv_patches import engine_launch_subprocesses

    sa = _server_args()
    seen = {}

    def launch(cls, server_args, **kwargs):
        seen["endpoint"] = server_args._freekv.kvstore_endpoint
        raise RuntimeError("scheduler died")

    with pytest.raises(RuntimeError, match="scheduler died"):
        engine_launch_subprocesses.hook(launch, object, sa)
    assert seen["endpoint"] is not None
    assert sa._freekv.kvstore_endpoint is None and os.environ.get(ENV) is None
    with pytest.raises(DaemonUnavailable):
        ping_daemon(seen["endpoint"], timeout_s=0.5)


def test_external_endpoint_and_freekv_off(plugins):
    from freekv_patches import engine_launch_subprocesses

    sa = _server_args(kvstore_endpoint="ipc:///tmp/freekv-external.sock")
    assert engine_launch_subprocesses.hook(lambda cls, s, **k: s._freekv.kvstore_endpoint, object, sa) == \
        "ipc:///tmp/freekv-external.sock"
    assert os.environ[ENV] == "ipc:///tmp/freekv-external.sock"
    os.environ.pop(ENV)
    assert engine_launch_subprocesses.hook(lambda cls, s, **k: "plain", object, SimpleNamespace()) == "plain"
    assert ENV not in os.environ


def test_arena_must_fit_the_host(plugins):
    from freekv_patches import engine_launch_subprocesses

    with pytest.raises(FreeKVArgsError, match="--kvstore-arena-gb"):
        check_arena_fits(1 << 20)
    sa = SimpleNamespace(_freekv=FreeKVServerSettings(config=FreeKVConfig(), kvstore_arena_gb=float(1 << 20)))
    with pytest.raises(FreeKVArgsError, match="--kvstore-arena-gb"):
        engine_launch_subprocesses.hook(lambda *a, **k: pytest.fail("launched"), object, sa)
    check_arena_fits(0.5)
