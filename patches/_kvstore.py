"""The embedded kvstore daemon of a FreeKV server: started by the launcher before the schedulers spawn."""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from ._common import settings_of
from ._health import install_kvstore_health

logger = logging.getLogger("freekv_patches")

# Each daemon this process started -> the settings its server had before (restored when the launch fails).
_STARTED: dict[Any, Any] = {}
# The daemons whose restarts are exported (--enable-metrics), by id.
_EXPORTED: set[int] = set()


def ensure_kvstore(server_args: Any):
    """With FreeKV on and no endpoint yet, start an embedded daemon, store its endpoint in server_args._freekv and
    $FREEKV_KVSTORE_ENDPOINT (inherited by the spawned schedulers) and stop it at exit. Returns the handle it
    started, or None (FreeKV off, or the endpoint already known: then only the environment is set)."""
    from freekv_sglang.server_args import ENV_KVSTORE_ENDPOINT, check_arena_fits

    settings = settings_of(server_args)
    if settings is None:
        return None
    if not settings.embedded_kvstore:
        os.environ[ENV_KVSTORE_ENDPOINT] = settings.kvstore_endpoint
        return None
    check_arena_fits(settings.kvstore_arena_gb)
    from freekv_kvstore import start_embedded
    from freekv_kvstore.config import TOKEN_ENV

    handle = start_embedded(arena_gb=settings.kvstore_arena_gb)
    atexit.register(handle.stop)
    _STARTED[handle] = settings
    server_args._freekv = settings.with_endpoint(handle.endpoint)
    os.environ[ENV_KVSTORE_ENDPOINT] = handle.endpoint
    if handle.token is not None:
        os.environ[TOKEN_ENV] = handle.token
    logger.info("FreeKV: embedded kvstore at %s (arena %g GiB, pid %d)", handle.endpoint,
                settings.kvstore_arena_gb, handle.pid)
    return handle


def abandon_kvstore(server_args: Any, handle) -> None:
    """The launch failed after ensure_kvstore started handle: stop it and forget its endpoint."""
    from freekv_sglang.server_args import ENV_KVSTORE_ENDPOINT

    if handle is None:
        return
    try:
        handle.stop()
    except Exception:  # noqa: BLE001 - the launch error is the one to report
        logger.exception("FreeKV: stopping the embedded kvstore failed")
    if os.environ.get(ENV_KVSTORE_ENDPOINT) == handle.endpoint:
        del os.environ[ENV_KVSTORE_ENDPOINT]
    server_args._freekv = _STARTED.pop(handle, settings_of(server_args))


def launcher_metric_labels(server_args: Any) -> dict[str, Any]:
    """The labels of SGLang's launcher-side (tokenizer) series: model_name, engine_type, --extra-metric-labels."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    labels = {"model_name": server_args.served_model_name,
              "engine_type": DisaggregationMode.to_engine_type(server_args.disaggregation_mode)}
    labels.update(getattr(server_args, "extra_metric_labels", None) or {})
    return labels


def export_kvstore_restarts(server_args: Any) -> None:
    """With --enable-metrics, export the restarts of the embedded daemons this launcher supervises, once SGLang has
    set up its Prometheus directory (_set_envs_and_config, inside Engine._launch_subprocesses: the
    _launch_scheduler_processes hook is past it)."""
    if not getattr(server_args, "enable_metrics", False) or "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return
    from freekv_sglang.metrics import watch_kvstore_restarts

    for handle in list(_STARTED):
        if id(handle) not in _EXPORTED:
            watch_kvstore_restarts(handle, launcher_metric_labels(server_args))
            _EXPORTED.add(id(handle))


def launch_with_kvstore(orig, cls, server_args: Any, *args, **kwargs):
    """Run a launch step with the kvstore endpoint known (and watched by /health); stop a daemon started here if the
    launch fails."""
    handle = ensure_kvstore(server_args)
    export_kvstore_restarts(server_args)
    install_kvstore_health(settings_of(server_args).kvstore_endpoint)
    try:
        return orig(cls, server_args, *args, **kwargs)
    except BaseException:
        abandon_kvstore(server_args, handle)
        raise
