"""Seam: AROUND sglang.srt.entrypoints.engine.Engine._launch_scheduler_processes (classmethod). Written against
sglang 0.5.16.

The last stop before the scheduler processes spawn, reached through `cls._launch_scheduler_processes` after
_launch_subprocesses has called load_plugins(). Makes sure the kvstore endpoint is known: a no-op when the
_launch_subprocesses hook already started the daemon, the place it starts in the sgl.Runtime route (see
engine_launch_subprocesses.py).
"""

from __future__ import annotations

from ._common import check_env_request_was_seen, settings_of
from ._kvstore import launch_with_kvstore

TARGET = "sglang.srt.entrypoints.engine.Engine._launch_scheduler_processes"
HOOK_TYPE = "AROUND"
PARAMS = ("cls", "server_args", "port_args", "run_scheduler_process_func")
PURPOSE = "make sure the kvstore endpoint is known before the schedulers spawn (all launch routes)"


def hook(orig, cls, server_args, *args, **kwargs):
    if settings_of(server_args) is None:
        check_env_request_was_seen(server_args)
        return orig(cls, server_args, *args, **kwargs)
    return launch_with_kvstore(orig, cls, server_args, *args, **kwargs)
