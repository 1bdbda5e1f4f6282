"""Fixtures of the kvstore tests; the helpers live in kvstore_helpers.py."""

from __future__ import annotations

import pytest

from kvstore_helpers import DaemonFactory, RawPeer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: multi-process soak run (kept in the default run, about 15 s)")


@pytest.fixture
def daemons():
    """Start daemons with daemons.start(...); all are killed and their files removed in teardown."""
    factory = DaemonFactory()
    yield factory
    factory.cleanup()


@pytest.fixture(params=["ipc", "tcp"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def raw_peer():
    peers: list[RawPeer] = []

    def make(endpoint: str) -> RawPeer:
        peers.append(RawPeer(endpoint))
        return peers[-1]

    yield make
    for p in peers:
        p.close()
