"""freekv-kvstore: run the kvstore daemon, or query / stop a running one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from .config import ENDPOINT_ENV, TOKEN_ENV, DaemonConfig, GiB, default_endpoint
from .errors import KVStoreError


def _parser() -> argparse.ArgumentParser:
    defaults = DaemonConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="freekv-kvstore",
        description="The FreeKV kvstore daemon: owns the host-memory KV pages of every GPU process of this host "
        "in POSIX shared memory and hands them out over a ZMQ socket.",
        epilog=f"Environment: ${ENDPOINT_ENV} sets the default endpoint, ${TOKEN_ENV} the token. "
        "Exit codes: 0 clean stop, 1 failure (endpoint taken, daemon unreachable), 2 bad arguments.",
    )
    p.add_argument("--endpoint", default=None,
                   help=f"ipc://<path> or tcp://<host>:<port> (port 0 picks a free one); default {default_endpoint()}")
    p.add_argument("--arena-gb", type=float, default=None,
                   help="budget in GiB for the arenas of all clients together (default: half the host memory, "
                        "at most the size of --shm-dir)")
    tokens = p.add_mutually_exclusive_group()
    tokens.add_argument("--token", default=None,
                        help="shared secret clients must present; required for tcp:// (prefer --token-file or "
                             f"${TOKEN_ENV}: arguments are visible to other users in ps)")
    tokens.add_argument("--token-file", default=None, help="read the token from this file")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--client-timeout", type=float, default=defaults["client_timeout_s"].default, metavar="S",
                   help="seconds without a message after which a client's session and unretained pages are reclaimed "
                        "(default %(default)s)")
    p.add_argument("--heartbeat-interval", type=float, default=defaults["heartbeat_interval_s"].default, metavar="S",
                   help="how often clients heartbeat (default %(default)s)")
    p.add_argument("--max-clients", type=int, default=defaults["max_clients"].default)
    p.add_argument("--shm-dir", default=defaults["shm_dir"].default, help="where arenas live (default %(default)s)")
    p.add_argument("--parent-pid", type=int, default=None, help="stop when this process exits (embedded mode)")
    p.add_argument("--ready-file", default=None, help="write the bound endpoint to this file once listening")
    actions = p.add_mutually_exclusive_group()
    actions.add_argument("--ping", action="store_true", help="ask the daemon at --endpoint whether it is up and exit")
    actions.add_argument("--stats", action="store_true", help="print the running daemon's statistics as JSON and exit")
    actions.add_argument("--stop", action="store_true", help="ask the daemon at --endpoint to shut down and exit")
    return p


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip()
    return args.token if args.token is not None else os.environ.get(TOKEN_ENV)


def _control(args: argparse.Namespace, token: str | None) -> int:
    from .client import daemon_stats, ping_daemon, shutdown_daemon

    endpoint = args.endpoint or default_endpoint()
    if args.ping:
        reply = ping_daemon(endpoint, token=token)
        print(f"kvstore at {endpoint} is up: pid {reply.daemon_pid}, up {reply.uptime_s:.0f} s")
    elif args.stats:
        print(json.dumps(dataclasses.asdict(daemon_stats(endpoint, token=token, check=True)), indent=2))
    else:
        reply = shutdown_daemon(endpoint, token=token)
        print(f"kvstore at {endpoint} is shutting down ({reply.sessions} sessions were open)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s freekv-kvstore: %(message)s"
    )
    try:
        token = _token(args)
    except OSError as e:
        parser.error(f"cannot read --token-file: {e}")
    try:
        if args.ping or args.stats or args.stop:
            return _control(args, token)
        overrides = {"endpoint": args.endpoint, "parent_pid": args.parent_pid, "ready_file": args.ready_file}
        if args.arena_gb is not None:
            overrides["arena_bytes"] = int(args.arena_gb * GiB)
        config = DaemonConfig(
            token=token,
            log_level=args.log_level,
            client_timeout_s=args.client_timeout,
            heartbeat_interval_s=args.heartbeat_interval,
            max_clients=args.max_clients,
            shm_dir=args.shm_dir,
            **{k: v for k, v in overrides.items() if v is not None},
        )
    except ValueError as e:
        parser.error(str(e))
    except KVStoreError as e:
        print(f"freekv-kvstore: {e}", file=sys.stderr)
        return 1
    from .server import serve

    try:
        serve(config)
    except (KVStoreError, OSError) as e:
        print(f"freekv-kvstore: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
