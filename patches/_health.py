"""/health and /health_generate of a FreeKV server fail while its kvstore daemon does not answer.

SGLang's route (http_server.health_generate) answers 503 only while the server starts or stops, or when no output
at all came back within 20 s of a one-token probe request. A FreeKV server whose daemon is gone still answers that
probe (the scheduler aborts it), so FreeKV puts a middleware on SGLang's FastAPI `app`: GET /health and
/health_generate answer 503 with a message naming the daemon and why while it does not answer a PING (1 s, off the
event loop), and go on to SGLang's own check otherwise. A daemon that comes back (the embedded one restarted by its
supervisor, or an external one) makes them pass again by themselves.

Installed by the launch hooks (_kvstore.launch_with_kvstore), before uvicorn starts, when the launch comes from
SGLang's HTTP server (its module is loaded): sglang.Engine(...) has no HTTP routes. SGLang's app lives in this one
process only with --tokenizer-worker-num 1, which FreeKV requires.
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


def add_kvstore_health(app: Any, endpoint: str) -> None:
    """Put the health middleware on a FastAPI/Starlette app (once)."""
    if getattr(app, "_freekv_kvstore_health", None) is not None:
        return
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import PlainTextResponse

    async def dispatch(request, call_next):
        if request.method == "GET" and request.url.path in HEALTH_PATHS:
            problem = await asyncio.to_thread(kvstore_problem, endpoint)
            if problem is not None:
                return PlainTextResponse(problem, status_code=503)
        return await call_next(request)

    app.add_middleware(BaseHTTPMiddleware, dispatch=dispatch)
    app._freekv_kvstore_health = endpoint


def install_kvstore_health(endpoint: str) -> None:
    """On SGLang's HTTP app, when this launch comes from its HTTP server."""
    http_server = sys.modules.get(HTTP_SERVER)
    if http_server is not None:
        add_kvstore_health(http_server.app, endpoint)
