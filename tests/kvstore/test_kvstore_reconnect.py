"""A client whose session is gone (a daemon restarted without the dead one's state) opens a new one with
reconnect(): the new arena is mapped at the old one's address, so views and pointers taken before reach it.
ping(timeout_s) bounds a probe of a daemon that is down."""

from __future__ import annotations

import os
import signal
import time

import pytest

from freekv_kvstore import ArenaGeometry, DaemonUnavailable, KVStoreClient, SessionExpired
from freekv_kvstore.arena import map_segment
from freekv_kvstore.journal import discard_store

pytestmark = pytest.mark.timeout(90)

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=4, head_dim=16, dtype="float32")  # 2 KiB pages
FAST = ("--client-timeout", "1.0", "--heartbeat-interval", "0.25")


def test_reconnect_maps_the_new_arena_over_the_old_address(daemons):
    shm = str(daemons.workdir())
    d = daemons.start(extra=FAST, shm_dir=shm)
    c = KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=32, cuda_register=False, client_id="r0")
    try:
        view = c.arena  # taken before the loss, as the engine holds it
        address = view.data_ptr()
        old_file = os.stat(c.arena_path).st_ino
        page = c.alloc(1, 1)[0]
        view[page].fill_(7.0)

        d.stop(signal.SIGKILL)
        discard_store(shm, d.endpoint)  # the state is gone: the next daemon starts afresh
        d2 = daemons.start(endpoint=d.endpoint, extra=FAST, shm_dir=shm)
        with pytest.raises(SessionExpired):
            c.ping(timeout_s=5)
        deadline = time.monotonic() + 10
        while c.expired is None:  # the heartbeat sees it too
            assert time.monotonic() < deadline, "the heartbeat did not notice the lost session"
            time.sleep(0.05)

        c.reconnect()
        assert c.expired is None and c.ping(timeout_s=5) > 0
        assert c.arena.data_ptr() == address and os.stat(c.arena_path).st_ino != old_file
        assert float(view[page].abs().max()) == 0.0  # the new, zeroed arena: the old bytes are not reachable
        new_page = c.alloc(2, 1)[0]
        view[new_page].fill_(3.0)  # written through the view taken before the loss ...
        with map_segment(c.arena_path, view.numel() * view.element_size()) as other:  # ... lands in the new file
            import torch

            seen = torch.frombuffer(other, dtype=torch.float32).view(view.shape)[new_page]
            assert bool((seen == 3.0).all())
        assert c.free(2) == 1
        assert d2.process.poll() is None
    finally:
        c.close()


def test_ping_gives_up_at_its_timeout(daemons):
    d = daemons.start(extra=FAST)
    c = KVStoreClient.connect(d.endpoint, geometry=GEOM, num_pages=8, cuda_register=False, timeout_s=30)
    try:
        d.process.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            c.ping(timeout_s=0.3)
        assert time.monotonic() - t0 < 2
    finally:
        d.process.send_signal(signal.SIGCONT)
        c.close()
