"""The journal in process: a core rebuilt from it equals the one that wrote it, a resent page call takes effect
once, and a journal or arena that is not what it should be is refused with nothing changed."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import zlib
from pathlib import Path

import pytest

from freekv_kvstore import ArenaFull, ArenaGeometry, StateRejected
from freekv_kvstore import core as core_mod
from freekv_kvstore import journal as journal_mod
from freekv_kvstore.arena import ARENA_ID_BYTES
from freekv_kvstore.config import DaemonConfig
from freekv_kvstore.core import KVStoreCore
from freekv_kvstore.journal import store_prefix
from freekv_kvstore.protocol import (
    AllocRequest,
    ByeRequest,
    FreeRequest,
    HelloRequest,
    LookupRequest,
    Opcode,
    ReleaseRequest,
    RetainRequest,
    StatsRequest,
)

pytestmark = pytest.mark.timeout(60)

GEOM = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")  # 256-byte pages
ENDPOINT = "ipc://test"


def make_core(shm: Path, **overrides) -> KVStoreCore:
    settings = dict(endpoint=f"ipc://{shm}/x.sock", arena_bytes=256 * GEOM.page_bytes, shm_dir=str(shm))
    return KVStoreCore(DaemonConfig(**{**settings, **overrides}), ENDPOINT)


def crash(core: KVStoreCore) -> None:
    """What kill -9 leaves: every file as it is, the store's lock released."""
    core._prefaulter.shutdown(wait=False)
    core._journal.close()


def hello(core: KVStoreCore, client_id: str, num_pages: int = 32, geom: ArenaGeometry = GEOM) -> int:
    return core.handle(Opcode.HELLO, 0, HelloRequest(client_id, geom, num_pages)).session


def store_files(shm: Path) -> dict[str, str]:
    prefix = store_prefix(str(shm), ENDPOINT)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shm.iterdir() if str(p).startswith(prefix)}


def test_a_core_rebuilt_from_the_journal_equals_the_one_that_wrote_it(tmp_path, monkeypatch):
    monkeypatch.setattr(core_mod, "_COMPACT_BYTES", 512)  # snapshots and records both carry state below
    core = make_core(tmp_path)
    rng = random.Random(0)
    sessions = {name: hello(core, name) for name in ("a", "b", "c")}
    keys: list[bytes] = []
    for call_id in range(1, 400):
        name = rng.choice(list(sessions))
        sid, rid = sessions[name], rng.randrange(6)
        op = rng.random()
        try:
            if op < 0.4:
                counts = [rng.randint(0, 4), rng.randint(0, 3)]
                core.handle(Opcode.ALLOC, sid, AllocRequest([rid, rid + 1], counts), call_id)
            elif op < 0.6:
                core.handle(Opcode.FREE, sid, FreeRequest([rid]), call_id)
            elif op < 0.75:
                (pages,) = core.handle(Opcode.ALLOC, sid, AllocRequest([rid], [1])).pages
                keys.append(rng.randbytes(8))
                core.handle(Opcode.RETAIN, sid, RetainRequest([keys[-1]], [pages]), call_id)
            elif op < 0.9 and keys:
                core.handle(Opcode.LOOKUP, sid, LookupRequest([rng.choice(keys)], rng.choice([None, rid])), call_id)
            elif keys:
                core.handle(Opcode.RELEASE, sid, ReleaseRequest([rng.choice(keys)]), call_id)
        except ArenaFull:
            pass
        if call_id % 50 == 0:
            core.tick()
        if call_id == 200:  # a session ends (its requests go, its prefixes stay) and a new client joins
            core.handle(Opcode.BYE, sessions.pop("c"), ByeRequest())
            sessions["d"] = hello(core, "d", 16)
    assert core._journal.log_bytes and core._journal.snapshot_bytes > 512
    before = core._snapshot()
    crash(core)
    again = make_core(tmp_path)
    assert again._snapshot() == before and again.epoch == core.epoch + 1
    assert again.handle(Opcode.STATS, 0, StatsRequest(check=True)).accounting_ok
    again.close()
    assert not store_files(tmp_path)  # a clean stop takes the whole store along


def test_a_resent_page_call_takes_effect_once_also_across_a_restart(tmp_path):
    core = make_core(tmp_path)
    s = hello(core, "a", 8)
    first = core.handle(Opcode.ALLOC, s, AllocRequest([1], [2]), call_id=7)
    assert core.handle(Opcode.ALLOC, s, AllocRequest([1], [2]), call_id=7) == first  # the reply was lost: again
    crash(core)  # as if it died after journaling call 7 and before its reply left
    core = make_core(tmp_path)
    assert core.handle(Opcode.ALLOC, s, AllocRequest([1], [2]), call_id=7) == first
    with pytest.raises(ArenaFull):
        core.handle(Opcode.ALLOC, s, AllocRequest([1], [7]), call_id=8)
    with pytest.raises(ArenaFull, match="cannot allocate 7 pages"):  # a refusal is answered again, too
        core.handle(Opcode.ALLOC, s, AllocRequest([1], [7]), call_id=8)
    assert core.handle(Opcode.ALLOC, s, AllocRequest([1], [1]), call_id=9).pages == [[2]]
    (arena,) = core.handle(Opcode.STATS, 0, StatsRequest(check=True)).arenas
    assert arena.used_pages == 3
    core.close()


def _rewrite_header(journal: Path, version: int | None = None, epoch: int | None = None) -> None:
    data = bytearray(journal.read_bytes())
    fields = list(journal_mod._HEADER.unpack_from(data))
    fields[1] = fields[1] if version is None else version
    fields[3] = fields[3] if epoch is None else epoch
    header = journal_mod._HEADER.pack(*fields)
    data[: len(header) + 4] = header + struct.pack("!I", zlib.crc32(header))
    journal.write_bytes(bytes(data))


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _records_at(journal: Path) -> int:
    """Offset of the journal's first record: right after its header and snapshot."""
    snapshot_bytes = journal_mod._HEADER.unpack_from(journal.read_bytes())[4]
    return journal_mod._HEADER.size + 4 + snapshot_bytes


def _replace_arena(path: Path) -> None:
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[:-ARENA_ID_BYTES] + os.urandom(ARENA_ID_BYTES))  # another arena of the same size


CASES = {
    "corrupt snapshot": (lambda j, a: _flip_byte(j, _records_at(j) - 1), {}, "snapshot fails its checksum"),
    "other format": (lambda j, a: _rewrite_header(j, version=99), {}, "format 99, this daemon reads formats 1, 2"),
    "stale epoch": (lambda j, a: _rewrite_header(j, epoch=0), {},
                    "stale: it is at epoch 0, the store's lock file at epoch 1"),
    "no journal": (lambda j, a: j.unlink(), {}, "1 arena files but no journal"),
    "replaced arena": (lambda j, a: _replace_arena(a), {}, "carries another arena id"),
    "smaller arena": (lambda j, a: os.truncate(a, 16 * GEOM.page_bytes), {}, "has 4096 bytes"),
    "smaller budget": (lambda j, a: None, {"arena_bytes": 8 * GEOM.page_bytes}, "more than the budget"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_store_that_is_not_what_it_should_be_is_refused_with_nothing_changed(tmp_path, case):
    spoil, overrides, reason = CASES[case]
    core = make_core(tmp_path)
    s = hello(core, "a")
    core.handle(Opcode.ALLOC, s, AllocRequest([1], [3]), call_id=1)
    (arena_path,) = (a.arena_path for a in core.handle(Opcode.STATS, 0, StatsRequest()).arenas)
    crash(core)
    spoil(Path(f"{store_prefix(str(tmp_path), ENDPOINT)}journal"), Path(arena_path))
    files = store_files(tmp_path)
    with pytest.raises(StateRejected, match=reason) as refused:
        make_core(tmp_path, **overrides)
    assert "Nothing was changed" in str(refused.value) and store_files(tmp_path) == files


def test_a_torn_last_record_is_dropped_and_a_corrupt_one_before_others_refused(tmp_path):
    journal = Path(f"{store_prefix(str(tmp_path), ENDPOINT)}journal")
    core = make_core(tmp_path)
    s = hello(core, "a")
    for call_id in (1, 2):
        core.handle(Opcode.ALLOC, s, AllocRequest([call_id], [1]), call_id=call_id)
    crash(core)
    journal.write_bytes(journal.read_bytes()[:-3])  # it died while appending call 2, so it never answered it
    core = make_core(tmp_path)
    (arena,) = core.handle(Opcode.STATS, 0, StatsRequest()).arenas
    assert (arena.requests, arena.used_pages) == (1, 1)
    for call_id in (3, 4):
        core.handle(Opcode.ALLOC, s, AllocRequest([call_id], [1]), call_id=call_id)
    crash(core)
    _flip_byte(journal, _records_at(journal) + journal_mod._RECORD.size)  # call 3, which call 4 follows
    with pytest.raises(StateRejected, match="journal record 1 is corrupt"):
        make_core(tmp_path)


def test_a_journal_of_another_endpoint_is_refused(tmp_path):
    core = make_core(tmp_path)
    hello(core, "a")
    crash(core)
    other = store_prefix(str(tmp_path), "ipc://elsewhere")
    for suffix in ("journal", "lock"):
        os.replace(f"{store_prefix(str(tmp_path), ENDPOINT)}{suffix}", f"{other}{suffix}")
    with pytest.raises(StateRejected, match="belongs to ipc://test"):
        KVStoreCore(DaemonConfig(endpoint=f"ipc://{tmp_path}/x.sock", shm_dir=str(tmp_path)), "ipc://elsewhere")


def test_a_busy_daemon_defers_its_journal_compaction(tmp_path, monkeypatch):
    """The snapshot holds the next call (tens of ms at many retained keys): while calls come, only a journal 4x past
    due is compacted; an idle daemon compacts it once due."""
    monkeypatch.setattr(core_mod, "_COMPACT_BYTES", 2048)
    core = make_core(tmp_path)
    sid = hello(core, "a", num_pages=200)
    journal, call_id = core._journal, 0

    def grow_past(limit: int) -> None:
        nonlocal call_id
        while journal.log_bytes <= limit:
            call_id += 1
            core.handle(Opcode.ALLOC, sid, AllocRequest([1], [1]), call_id)
            core.handle(Opcode.FREE, sid, FreeRequest([1]), call_id + 100_000)

    due = max(2048, 4 * journal.snapshot_bytes)
    grow_past(due)
    core.tick(idle=False)
    assert journal.log_bytes > due  # deferred
    core.tick(idle=True)
    assert journal.log_bytes == 0  # compacted once idle
    busy_due = core_mod._COMPACT_BUSY_FACTOR * max(2048, 4 * journal.snapshot_bytes)
    grow_past(busy_due)
    core.tick(idle=False)
    assert journal.log_bytes == 0  # far past due: compacted while busy
    core.close()
