"""/health and /health_generate of a FreeKV server fail while its kvstore daemon does not answer, or while a
rank's host pool cannot serve though the daemon answers.

SGLang's route (http_server.health_generate) answers 503 only while the server starts or stops, or when no output
at all came back within 20 s of a one-token probe request. A FreeKV server whose daemon is gone still answers that
probe (the scheduler aborts it), so FreeKV puts a middleware on SGLang's FastAPI `app`: GET /health and
/health_generate answer 503 with a message naming the daemon and why while it does not answer a PING (1 s, off the
event loop), and go on to SGLang's own check otherwise. A daemon that comes back (the embedded one restarted by its
supervisor, or an external one) makes them pass again by themselves.

A daemon that answers is not enough: a rank's pool may have lost its session (the daemon restarted afresh, reaped it,
failed its arena) and be refused a new one, and then every request aborts. Each scheduler's pool publishes its state
(freekv_sglang.kvstore_pool: a small file per TP rank under /dev/shm, named from the model, port and rank, replaced
atomically at every state change). While any rank's state is not "up", the health paths still run SGLang's own check
first, since its one-token request is what makes the pool try again (the scheduler's pool probes the daemon, or opens
a new session, only when a request waits), and then answer 503 with the rank and the reason unless every rank is up
by then. They pass again by themselves once the pools are up. (With SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0,
SGLang's /health sends no request: only /health_generate or traffic then make a pool try again.)

Installed by the launch hooks (_kvstore.launch_with_kvstore), before uvicorn starts, when the launch comes from
SGLang's HTTP server (its module is loaded): sglang.Engine(...) has no HTTP routes. SGLang's app lives in this one
process only with --tokenizer-worker-num 1, which FreeKV requires; the server's model and port are read from its
server_args once it serves (app.server_args, set by SGLang in that mode).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

HTTP_SERVER = "sglang.srt.entrypoints.http_server"
HEALTH_PATHS = frozenset({"/health", "/health_generate"})
PING_TIMEOUT_S = 1.0


def kvstore_problem(endpoint: str) -> str | None:
    """Why the kvstore daemon at endpoint cannot serve now, or None when it answers."""
    from freekv_kvstore import KVStoreError, ping_daemon

    try:
        ping_daemon(endpoint, timeout_s=PING_TIMEOUT_S)
    except KVStoreError as e:
        return f"FreeKV: the kvstore daemon at {endpoint} does not answer: {type(e).__name__}: {e}"
    return None


def pool_problem(identity: str | None) -> str | None:
    """Why some rank's host pool of the server `identity` (kvstore_pool.server_identity) cannot serve now, from the
    states the pools published; None when every rank that published one is up.

    A rank without a state file is not counted against the server: it has not opened its pool yet (the server is
    still starting, which SGLang's own check reports), or it closed it; a rank whose pool failed to open never
    serves, and SGLang's launch fails with it. Files left by dead processes are ignored (read_pool_states)."""
    if identity is None:
        return None
    from freekv_sglang.kvstore_pool import read_pool_states

    bad = [f"rank {s.get('rank')} ({s.get('client_id')}) is {s.get('state')} ({s.get('reason')}): {s.get('message')}"
           for s in read_pool_states(identity) if s.get("state") != "up"]
    return ("FreeKV: the kvstore host pool cannot serve on " + "; ".join(bad)) if bad else None


def server_problems(endpoint: str, identity: str | None) -> tuple[str | None, str | None]:
    """(why the daemon cannot serve, why a pool cannot): the pools are read only while the daemon answers."""
    daemon = kvstore_problem(endpoint)
    return daemon, None if daemon is not None else pool_problem(identity)


def _identity(app: Any) -> str | None:
    """The server identity of the pools this app serves, from SGLang's server_args (None until they are known)."""
    identity = getattr(app, "_freekv_server_identity", None)
    if identity is not None:
        return identity
    server_args = getattr(app, "server_args", None)
    if server_args is None:
        state = getattr(sys.modules.get(HTTP_SERVER), "_global_state", None)
        server_args = getattr(getattr(state, "tokenizer_manager", None), "server_args", None)
    if server_args is None:
        return None
    from freekv_sglang.kvstore_pool import server_identity

    app._freekv_server_identity = identity = server_identity(server_args)
    return identity


def add_kvstore_health(app: Any, endpoint: str) -> None:
    """Put the health middleware on a FastAPI/Starlette app (once)."""
    if getattr(app, "_freekv_kvstore_health", None) is not None:
        return
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import PlainTextResponse

    async def dispatch(request, call_next):
        if request.method == "GET" and request.url.path in HEALTH_PATHS:
            identity = _identity(request.app)
            daemon, pools = await asyncio.to_thread(server_problems, endpoint, identity)
            if daemon is not None:
                return PlainTextResponse(daemon, status_code=503)
            if pools is not None:
                # The daemon answers but a pool cannot serve: SGLang's check sends the request that makes the
                # scheduler's pool try again (see the module doc); 503 unless that brought every rank up.
                response = await call_next(request)
                problem = await asyncio.to_thread(pool_problem, identity)
                if problem is not None:
                    return PlainTextResponse(problem, status_code=503)
                return response
        return await call_next(request)

    app.add_middleware(BaseHTTPMiddleware, dispatch=dispatch)
    app._freekv_kvstore_health = endpoint


def install_kvstore_health(endpoint: str) -> None:
    """On SGLang's HTTP app, when this launch comes from its HTTP server."""
    http_server = sys.modules.get(HTTP_SERVER)
    if http_server is not None:
        add_kvstore_health(http_server.app, endpoint)
