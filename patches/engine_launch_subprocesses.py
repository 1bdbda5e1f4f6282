"""Seam: AROUND sglang.srt.entrypoints.engine.Engine._launch_subprocesses (classmethod). Written against sglang 0.5.16.

Both `python -m sglang.launch_server` (http_server.launch_server) and sglang.Engine(...) launch through here, once
per node. With FreeKV on and no --kvstore-endpoint, the embedded kvstore daemon starts here, before any scheduler
spawns; its endpoint goes into server_args._freekv (pickled to the schedulers) and $FREEKV_KVSTORE_ENDPOINT
(inherited through spawn). It stops at interpreter exit, and at once when the launch fails.

sgl.Runtime runs http_server.launch_server in a fresh spawned process that loads the plugins only inside this
method, so this hook is not yet in place there: Engine._launch_scheduler_processes (patches/engine_launch_scheduler_
processes.py) starts the daemon in that case. ServerArgs that ask for FreeKV through $SGLANG_KV_RETRIEVAL but never
passed the __post_init__ hook (sgl.Runtime builds them before any plugin is loaded) are refused here and there.
"""

from __future__ import annotations

from ._common import check_env_request_was_seen, settings_of
from ._kvstore import launch_with_kvstore

TARGET = "sglang.srt.entrypoints.engine.Engine._launch_subprocesses"
HOOK_TYPE = "AROUND"
PARAMS = ("cls", "server_args", "init_tokenizer_manager_func", "run_scheduler_process_func",
          "run_detokenizer_process_func", "port_args")
PURPOSE = "start the embedded kvstore before the schedulers spawn; stop it if the launch fails"


def hook(orig, cls, server_args, *args, **kwargs):
    if settings_of(server_args) is None:
        check_env_request_was_seen(server_args)
        return orig(cls, server_args, *args, **kwargs)
    from . import require_hooks

    require_hooks("launching a FreeKV server")
    return launch_with_kvstore(orig, cls, server_args, *args, **kwargs)
