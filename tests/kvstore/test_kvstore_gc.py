"""The daemon's garbage collection: Python's full collections (which scan every retained key) only between calls."""

from __future__ import annotations

import subprocess
import sys

import pytest

from freekv_kvstore import server

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_full_collections_run_once_the_daemon_is_idle_or_overdue(monkeypatch):
    full = []
    monkeypatch.setattr(server.gc, "collect", lambda *generation: full.append(generation))
    clock = Clock()
    c = server.OldGenerationCollector(clock)
    for _ in range(int(server._GC_MAX_GAP_S / 0.25) - 1):  # busy: a message every tick, for just under the max gap
        clock.t += 0.25
        c.served()
        c.tick()
    assert full == []
    clock.t += 0.25  # the max gap: collected though busy
    c.served()
    c.tick()
    assert full == [()]
    clock.t += server._IDLE_S  # idle, but too soon after the last
    c.tick()
    assert len(full) == 1
    clock.t += server._GC_IDLE_GAP_S
    c.tick()
    assert len(full) == 2 and c.collections == 2
    clock.t += server._GC_IDLE_GAP_S + server._IDLE_S
    c.served()  # a message just now: not idle
    c.tick()
    assert len(full) == 2


def test_a_daemon_process_never_collects_its_oldest_generation_by_itself():
    # In a fresh interpreter: how soon Python collects its oldest generation depends on the heap it has.
    code = """
import gc
from freekv_kvstore import server
generations = []
gc.callbacks.append(lambda phase, info: phase == "start" and generations.append(info["generation"]))
before = gc.get_threshold()
keep = []
with server.daemon_gc():
    for i in range(300_000):  # a page table's retained keys: a bytes key and a tuple of pages each
        keep.append((i.to_bytes(16, "little"), (i,)))
inside = list(generations)
generations.clear()
for i in range(300_000):
    keep.append((i.to_bytes(16, "little"), (i,)))
print(2 in inside, 0 in inside, gc.get_threshold() == before, 2 in generations)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    # Inside: no full collection, the young generations still collected; after: thresholds back, and the same
    # allocations collect the oldest generation again.
    assert out.stdout.split() == ["False", "True", "True", "True"]
