"""8 client processes hammer one daemon for >= 10 s: no page owned twice, every checksum verified."""

from __future__ import annotations

import json

import pytest

from freekv_kvstore import daemon_stats

from kvstore_helpers import run_worker

CLIENTS = 8
SECONDS = 10.5


@pytest.mark.soak
@pytest.mark.timeout(120)
def test_eight_clients_random_alloc_write_verify_free(daemons):
    d = daemons.start("ipc", arena_gb=0.05)
    workers = [run_worker("soak", d.endpoint, f"soak{i}", str(1000 + i), str(SECONDS)) for i in range(CLIENTS)]
    try:
        results = []
        for i, w in enumerate(workers):
            out, err = w.communicate(timeout=90)
            lines = out.strip().splitlines()
            assert w.returncode == 0 and lines, f"worker {i} failed (exit {w.returncode}):\n{out}\n{err}"
            results.append(json.loads(lines[-1]))
    finally:
        for w in workers:
            w.kill()
            w.wait(10)
    assert all(r.get("ok") for r in results), results
    ops = {k: sum(r["ops"][k] for r in results) for k in results[0]["ops"]}
    # Every path was taken many times: allocation, a full arena, eviction by our own allocs, pinned lookups.
    assert ops["alloc"] > 1000 and ops["verify"] > 10_000 and ops["lookup"] > 100
    assert ops["full"] > 0 and ops["evicted"] > 0, ops
    stats = daemon_stats(d.endpoint, check=True)
    assert stats.accounting_ok, stats.accounting_error
    assert stats.sessions == 0 and stats.arenas == [] and stats.reserved_bytes == 0  # all closed, all unlinked
    assert stats.errors == sum(r["ops"]["full"] for r in results)  # the only refusals were full arenas
    print(f"soak: {CLIENTS} clients x {SECONDS} s: {ops}, {stats.messages} messages")
