"""Client processes for the kvstore tests (run as a script; prints one JSON line when it has something to say).

    hold ENDPOINT CLIENT_ID PAGES RETAINED   allocate PAGES, retain the first RETAINED, report, sleep until killed
    soak ENDPOINT CLIENT_ID SEED SECONDS     random alloc/write/verify/retain/lookup/free; exit 1 on any violation
    embed                                    start an embedded daemon, report it, sleep until killed
"""

from __future__ import annotations

import json
import random
import sys
import time
import zlib

import numpy as np

from freekv_kvstore import ArenaFull, ArenaGeometry, KVStoreClient, start_embedded

GEOM = ArenaGeometry(num_layers=2, num_kv_heads=2, page_size=4, head_dim=16, dtype="float32")  # 2 KiB pages


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def hold(endpoint: str, client_id: str, pages: int, retained: int) -> None:
    client = KVStoreClient.connect(endpoint, geometry=GEOM, num_pages=64, client_id=client_id, cuda_register=False)
    got = client.alloc(1, pages)
    if retained:
        client.retain(b"held-prefix", got[:retained])
    report(pages=got)
    time.sleep(3600)


class Soak:
    def __init__(self, client: KVStoreClient, rng: random.Random) -> None:
        self.c = client
        self.rng = rng
        self.mem = np.frombuffer(client.buffer, dtype=np.uint8).reshape(client.num_pages, client.page_bytes)
        self.requests: dict[int, list[int]] = {}
        self.retained: dict[bytes, list[int]] = {}
        self.crc: dict[int, int] = {}
        self.next_rid = 0
        self.ops = dict(alloc=0, full=0, free=0, verify=0, retain=0, lookup=0, release=0, evicted=0)

    def fail(self, what: str) -> None:
        report(error=what, ops=self.ops)
        sys.exit(1)

    def held(self) -> set[int]:
        return {p for ps in self.requests.values() for p in ps} | {p for ps in self.retained.values() for p in ps}

    def verify(self, pages: list[int]) -> None:
        for p in pages:
            if zlib.crc32(self.mem[p]) != self.crc[p]:
                self.fail(f"page {p} does not hold what was written to it")
        self.ops["verify"] += len(pages)

    def alloc(self) -> None:
        rid = self.rng.choice(list(self.requests)) if self.requests and self.rng.random() < 0.3 else self.next_rid
        self.next_rid += rid == self.next_rid
        try:
            pages = self.c.alloc(rid, self.rng.randint(1, 12))
        except ArenaFull:
            self.ops["full"] += 1
            if self.requests:
                self.free(self.rng.choice(list(self.requests)))
            return
        fresh = set(pages)
        if len(fresh) != len(pages) or fresh & {p for ps in self.requests.values() for p in ps}:
            self.fail(f"alloc returned pages another live request holds: {sorted(fresh)}")
        for key in [k for k, ps in self.retained.items() if fresh & set(ps)]:
            if self.c.lookup(key) is not None:  # only an eviction may hand out a retained page
                self.fail(f"alloc handed out pages still retained under {key.hex()}")
            del self.retained[key]
            self.ops["evicted"] += 1
        for p in pages:
            self.mem[p] = np.frombuffer(self.rng.randbytes(self.c.page_bytes), dtype=np.uint8)
            self.crc[p] = zlib.crc32(self.mem[p])
        self.requests.setdefault(rid, []).extend(pages)
        self.ops["alloc"] += 1

    def free(self, rid: int) -> None:
        pages = self.requests.pop(rid)
        self.verify(pages)
        self.c.free(rid)
        self.ops["free"] += 1

    def retain(self) -> None:
        rid = self.rng.choice(list(self.requests))
        pages = self.requests[rid][: self.rng.randint(1, len(self.requests[rid]))]
        key = self.rng.randbytes(16)
        if self.c.retain(key, pages) != pages:
            self.fail("a fresh key did not retain the pages given")
        self.retained[key] = pages
        self.ops["retain"] += 1

    def lookup(self) -> None:
        key = self.rng.choice(list(self.retained))
        rid = self.next_rid
        self.next_rid += 1
        pages = self.c.lookup(key, request_id=rid)
        if pages is None:  # evicted by our own alloc since; the model learns it here
            del self.retained[key]
            self.ops["evicted"] += 1
            return
        if pages != self.retained[key]:
            self.fail(f"lookup returned {pages}, retained {self.retained[key]}")
        self.verify(pages)
        self.requests[rid] = list(pages)
        self.ops["lookup"] += 1

    def release(self) -> None:
        key = self.rng.choice(list(self.retained))
        self.c.release(key)
        del self.retained[key]
        self.ops["release"] += 1

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            r = self.rng.random()
            if r < 0.4 or not self.requests:
                self.alloc()
            elif r < 0.65:
                self.free(self.rng.choice(list(self.requests)))
            elif r < 0.8:
                self.retain()
            elif r < 0.92 and self.retained:
                self.lookup()
            elif self.retained:
                self.release()
        for rid in list(self.requests):
            self.free(rid)
        self.c.release_many(list(self.retained))
        self.retained.clear()
        arena = next(a for a in self.c.stats(check=True)["arenas"] if a["client_id"] == self.c.client_id)
        if (arena["free_pages"], arena["used_pages"], arena["cached_pages"]) != (self.c.num_pages, 0, 0):
            self.fail(f"after freeing everything the arena reports {arena}")


def soak(endpoint: str, client_id: str, seed: int, seconds: float) -> None:
    client = KVStoreClient.connect(endpoint, geometry=GEOM, num_pages=96, client_id=client_id, cuda_register=False)
    s = Soak(client, random.Random(seed))
    s.run(seconds)
    del s.mem
    client.close()
    report(ok=True, ops=s.ops)


def embed() -> None:
    handle = start_embedded(arena_gb=0.05)
    report(pid=handle.pid, endpoint=handle.endpoint)
    time.sleep(3600)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "hold":
        hold(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "soak":
        soak(args[0], args[1], int(args[2]), float(args[3]))
    elif mode == "embed":
        embed()
    else:
        sys.exit(f"unknown mode {mode}")
