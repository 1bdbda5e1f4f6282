"""FreeKV's side of SGLang's radix cache (docs/radix.md): cached prefixes shared as kvstore host pages.

SGLang's radix tree keeps a cached prefix's token slots; under FreeKV those hold only the dense layers' KV (the
sparse layers' pool rows are staging pages, released once a prompt is in). The sparse layers' prefix lives in the
kvstore arena as host pages retained under prefix keys (freekv_kvstore.prefix_keys, one chain key per full page), so
a hit needs the arena's (every layer's bytes) and token slots holding its dense layers (the radix node's, or loaded).

- Export (the radix cache's cache_unfinished_req after each prefill chunk and once a prompt's prefill completed, and
  cache_finished_req; patches/_radix_cache.py): the request's full pages so far go to the arena with their summaries
  (FreeKVEngine.export_prefix; a prompt still in prefill from its staging pages) and the dense layers' slices from
  SGLang's pool, and are retained as a chain, one key per page. The requests one step finishes are exported together
  once SGLang has processed that step's results (batched_exports).
- Match (match_prefix with a request): the arena's longest retained prefix of the request's tokens, whose pages are
  pinned for the request at once (LOOKUP with a pending owner id, which the engine takes as the request's owner), so
  no eviction can take them before the prefill. The radix match is cut to it or, where the tree lacks it, its dense
  layers are loaded into new token slots (load_dense). A request that shares a stashed chunk whose copies are still
  in flight waits for them and is matched again when the batch can admit it (await_in_flight). Pins of requests the
  scheduler did not admit into the new prefill batch are let go when get_new_batch_prefill returns
  (release_unadmitted).
- Prefill (FreeKVAttnBackend._prepare_extend): a hit row starts with FreeKVEngine.begin_prefill_shared; its prefix pages
  are staged once per host page (shared by every row of that prefix, filled from the arena layer by layer before the
  wrapped backend reads them) and its own suffix is staged and offloaded as any prompt's.

A hit costs staging pages for its prefix until its prefill completes (once per host page, however many rows share
it); the match keeps the pinned prefixes of one batch within one context's worth of staging (the memory plan's share
of the chunked prompt in flight). A hit that does not fit while that room is held (by the batch's other hits, by hits
or a prompt still in prefill) is deferred: the scheduler does not admit it this round (patches/prefill_adder_add_one_req)
and matches it again later, instead of admitting it cut short and prefilling the rest again. SGLang's scheduling
policy also matches every waiting request to rank them (calc_priority); those matches see the radix tree only
(patches/schedule_policy_calc_priority), so they neither pin arena pages nor take staging room from the requests the
scheduler admits.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch

from freekv_kvstore import prefix_keys

from .kvstore_pool import HostPagesUnavailable
from .streams import upload

logger = logging.getLogger(__name__)

# Owner ids of pins taken at match time, apart from the engine's own counter (both are kvstore request ids).
PIN_OWNER_BASE = 1 << 40
# A hit waits for staging room at most this long (from its first deferral), then is admitted cut: the room frees as
# prompts complete (a 128K prompt prefills in well under this), so only a stuck prefill reaches it.
DEFER_LIMIT_S = 30.0


class _Hit(list):
    """A LOOKUP's pages, pinned under owner."""

    def __init__(self, owner: int, pages: list[int]):
        super().__init__(pages)
        self.owner = owner


@dataclasses.dataclass(frozen=True)
class PrefixPin:
    """Host pages of a request's shared prefix (logical pages 0..len-1), held in the arena under owner."""

    owner: int
    pages: tuple[int, ...]
    tokens: int


@dataclasses.dataclass(frozen=True)
class _Export:
    """A finished request's export waiting for the end of batched_exports: its full pages [0, num_pages) to complete
    and retain (those before done are), and SGLang's token rows of the new ones, read when it finished."""

    req: Any
    slot: int
    num_pages: int
    done: int
    dense_rows: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Written:
    """A stashed chunk's export, its copies queued on the device: retained once they have landed (`landed`: an event
    after them, None on CPU), if the slot still holds the same request."""

    req: Any
    slot: int
    generation: int
    owner: int  # its host pages' owner: a kvstore session lost meanwhile took them
    pages: list[int]
    done: int
    keys: list[bytes]  # the chain keys of its pages, which a match compares with a waiting request's
    landed: Any


# What a retained page holds, in its keys: pages retained before the dense layers' slices were exported (format 1)
# must not be loaded into the dense layers by a newer server on the same arena.
PAGE_FORMAT = 2


def namespace_of(model_path: str, revision: str | None, dtype: torch.dtype, rank: int, tp_size: int) -> bytes:
    """What prefix keys are salted with: another model, revision, KV dtype or TP split never hits."""
    return f"{model_path}|{revision or ''}|{dtype}|tp{rank}/{tp_size}|pages{PAGE_FORMAT}".encode()


class PrefixSharing:
    """Per rank: pins, exports and prefix staging of one FreeKVAttnBackend."""

    def __init__(self, backend: Any, namespace: bytes):
        self.backend = backend
        self.namespace = namespace
        self.page_size = backend.engine.cfg.page_size
        self._owners = itertools.count(PIN_OWNER_BASE)
        self._pending: dict[int, Any] = {}  # id(req) -> request holding a pin not yet taken by a forward
        self._pending_hp: Counter[int] = Counter()  # host pages pinned by pending requests
        # Host pages whose page summaries this process wrote or loaded (the arena may hold a restarted server's).
        self._summarised: set[int] = set()
        # Prefix staging: host page -> [staging page, rows holding it]; slot -> its prefix's host pages.
        self._staged: dict[int, list[int]] = {}
        # Exported pages of prompts still in prefill: host page -> (slot, the staging page holding it). A hit on them
        # reads that staging page (equal bytes) instead of staging a copy from the arena.
        self._inflight: dict[int, tuple[int, int]] = {}
        self._slot_prefix: dict[int, list[int]] = {}
        self.hits = self.hit_tokens = self.exported_pages = self.export_failures = 0
        self.export_s = 0.0  # time the scheduler spent in export (its syncs, hashing and RETAIN_CHAIN)
        self.cut_matches = self.cut_pages = 0  # matches pinned short of the arena's hit for lack of staging room
        self.deferred_matches = 0  # matches that waited for staging room instead
        self.ranking = False  # inside the scheduling policy's ranking of the waiting queue (tree matches only)
        # Inside batched_exports: finished requests' exports, written together when it ends.
        self._deferred: list[_Export] | None = None
        # Inside batched_exports: prompts its step completed, written by their forward (req, slot, pages, done); their
        # pages are retained when it ends, so the step's first tokens do not wait for the RETAIN_CHAIN round trip.
        self._retain_later: list[tuple[Any, int, list[int], int]] = []
        # Stashed chunks' exports whose copies are still on the device, oldest first (see retain_written).
        self._written: collections.deque[_Written] = collections.deque()
        self._warm_page_copies()

    def _warm_page_copies(self) -> None:
        """Compile the page copies of a hit and an export at startup, on scratch tensors strided as the arena's layer
        and SGLang's [T, H, D] buffers: the first hit would otherwise wait for their JIT (~0.1 s on an H100)."""
        eng = self.backend.engine
        arena, p = eng.host.arena, self.page_size  # [pages, layers, KV heads, 2, page size, head dim]
        host = torch.empty((1, *arena.shape[1:]), dtype=arena.dtype, device=eng.device)[:, 0]
        scales = None if eng.host.scales is None else torch.zeros(host.shape[:-1], dtype=torch.int8, device=eng.device)
        k, v = (torch.zeros(p, arena.shape[2], arena.shape[5], dtype=eng.dtype, device=eng.device) for _ in range(2))
        pages = torch.zeros(1, dtype=torch.int32, device=eng.device)
        rows = eng.page_rows(torch.zeros(1, dtype=torch.int64, device=eng.device))
        eng.ops.pages_to_host(k, v, rows, host, pages, host_scales=scales)
        eng.ops.pages_from_host(host, pages, k, v, rows, host_scales=scales)

    @contextlib.contextmanager
    def ranking_pass(self) -> Iterator[None]:
        """The scheduling policy ranks every waiting request by its match: no pins, no staging room taken."""
        self.ranking = True
        try:
            yield
        finally:
            self.ranking = False

    # ---- scheduler side ----------------------------------------------------------------------

    def keys(self, tokens: Sequence[int], extra_key: Any) -> list[bytes]:
        ns = self.namespace if extra_key is None else self.namespace + b"|" + repr(extra_key).encode()
        return prefix_keys(tokens, self.page_size, namespace=ns)

    def match(self, req: Any, token_ids: Sequence[int], max_tokens: int) -> int:
        """Pin for req the arena's longest retained prefix of token_ids[:max_tokens] (page-aligned) and return its
        length in tokens (0: prefill from scratch, or wait: see deferred)."""
        self.drop_pin(req)
        req.__dict__.pop("_freekv_defer", None)
        req.__dict__.pop("_freekv_in_flight", None)
        p, n = self.page_size, max_tokens // self.page_size
        # A request not admitted is matched again every scheduling round; its keys hash a prefix of its tokens alone
        # (as _chain_keys reuses them), ~1.7 ms for 32K tokens.
        keys = list(req.__dict__.get("_freekv_keys", ())[:n])
        if len(keys) < n:
            keys = self.keys(token_ids[:n * p], getattr(req, "extra_key", None))
            self._remember_keys(req, keys)
        in_flight = self._in_flight_shared(keys)
        if in_flight is not None:  # the adder seam waits for it if the batch can take req, then matches again
            req._freekv_in_flight = in_flight
        hit = self._lookup(keys)
        # Staging holds each host page once per batch: only pages not staged or pinned yet cost room.
        room, fits = self._stage_room(), 0
        for hp in hit:
            if hp not in self._staged and hp not in self._pending_hp and hp not in self._inflight:
                room -= 1
            if room < 0:
                break
            fits += 1
        if fits < len(hit) and self._room_will_grow():  # wait for it rather than prefill the rest again
            since = req.__dict__.setdefault("_freekv_deferred_since", time.monotonic())
            if time.monotonic() - since < DEFER_LIMIT_S:
                self.backend.host.free(hit.owner)
                self.deferred_matches += 1
                req._freekv_defer = True
                return 0
        req.__dict__.pop("_freekv_deferred_since", None)
        if fits < len(hit):  # pin only what fits, so the pool counts exactly the request's pages
            self.cut_matches += 1
            self.cut_pages += len(hit) - fits
            self.backend.host.free(hit.owner)
            hit = self._lookup(keys[:fits]) if fits else _Hit(0, [])
        if not hit:
            return 0
        req._freekv_prefix_pin = PrefixPin(hit.owner, tuple(hit), len(hit) * p)
        self._pending[id(req)] = req
        self._pending_hp.update(hit)
        return len(hit) * p

    def _in_flight_shared(self, keys: list[bytes]) -> _Written | None:
        """The newest stashed chunk whose copies are still in flight that a request with these keys shares (its first
        new page's chain key is the request's at that index), if any."""
        shared = None
        for w in self._written:
            if len(keys) > w.done and keys[w.done] == w.keys[w.done]:
                shared = w
        return shared

    def shares_in_flight(self, req: Any) -> bool:
        """Whether req's last match stopped short of a stashed chunk it shares whose copies are still in flight."""
        return "_freekv_in_flight" in req.__dict__

    def await_in_flight(self, req: Any) -> None:
        """Wait for the copies of the in-flight chunk req shares (and the older ones) and retain them, so that a match
        again hits it. The adder seam calls this only when the batch being built can admit req: SGLang matches the
        head of its waiting queue every round, also while a chunked prompt fills the whole batch, and waiting then
        would hold the scheduler at every chunk again. Without it, a request sent while a prompt prefills, and matched
        while that prompt's last chunk runs, would prefill that chunk again (~0.4 s for 8K tokens at 32K): full KV's
        tree serves an in-flight chunk's token slots."""
        last = req.__dict__.pop("_freekv_in_flight", None)
        for w in self._written:
            if w.landed is not None:
                w.landed.synchronize()
            if w is last:
                break
        self.retain_written()

    def _lookup(self, keys: list[bytes]) -> _Hit:
        owner = next(self._owners)
        if not keys:
            return _Hit(owner, [])
        pages = self.backend.host.lookup_prefix(owner, keys, sink_pages=self.backend.engine.cfg.sink_pages)
        if not pages:
            self.backend.host.free(owner)  # sends a FREE only if the LOOKUP may have pinned something
        return _Hit(owner, pages)

    def _stage_room(self) -> int:
        # Staging beyond one context's worth is the batch's new tokens' (freekv_sglang.memory_plan); hits share that
        # context's worth with a chunked prompt in flight.
        staging = self.backend.staging
        keep = staging.num_pages - self.backend.engine.max_pages
        # Set operations on the key views (in C): every waiting request is matched each scheduling round.
        need = len(self._pending_hp.keys() - self._staged.keys() - self._inflight.keys())
        return staging.free_pages - keep - need

    def _room_will_grow(self) -> bool:
        """Staging room is held by this batch's other hits or by prompts in prefill (hits or not): it frees as they
        complete. Otherwise the room is all there will be: a hit longer than it is cut."""
        staging = self.backend.staging
        return bool(self._pending_hp) or staging.free_pages < staging.num_pages

    def deferred(self, req: Any) -> bool:
        """Whether req's last match waited for staging room (the scheduler then leaves it waiting this round)."""
        return bool(req.__dict__.pop("_freekv_defer", False))

    def drop_pin(self, req: Any) -> None:
        pin = req.__dict__.pop("_freekv_prefix_pin", None)
        if pin is not None:
            self._pending.pop(id(req), None)
            self._pending_hp.subtract(pin.pages)
            self._pending_hp = +self._pending_hp
            self.backend.host.free(pin.owner)

    def release_unadmitted(self, batch: Any) -> None:
        """After the scheduler built its prefill batch: let go of the pins of requests it did not admit."""
        admitted = {id(r) for r in (getattr(batch, "reqs", None) or [])}
        for key, req in list(self._pending.items()):
            if key not in admitted:
                self.drop_pin(req)

    def take_pins(self, reqs: Sequence[Any]) -> list[PrefixPin | None]:
        """The pins of an extend batch's requests, by row (the forward takes them over)."""
        pins = []
        for req in reqs:
            pin = req.__dict__.pop("_freekv_prefix_pin", None)
            if pin is not None:
                self._pending.pop(id(req), None)
                self._pending_hp.subtract(pin.pages)
                self._pending_hp = +self._pending_hp
            pins.append(pin)
        return pins

    def export(self, req: Any, kv_len: int) -> int:
        """A request's prompt was prefilled up to kv_len (after any chunk, or complete), or the request finished:
        retain its first kv_len tokens' full pages (every layer, summaries included) under their chain keys. Returns
        the pages newly exported (0 when its host pages are lost, or they were exported already, or inside
        batched_exports, which exports them when it ends)."""
        t0 = time.perf_counter()
        try:
            return self._export(req, kv_len)
        finally:
            self.export_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def batched_exports(self) -> Iterator[None]:
        """SGLang's processing of a step's results (patches/scheduler_process_batch_result): the requests it finishes
        are exported together when it returns, after the step's tokens went out: one launch a layer for all of them
        and one device synchronisation, where each finishing request took its own (16 requests finishing on one
        step held the last token for ~80 ms). Their slots stay theirs until the next step's preparation frees them;
        the dense layers' token rows are read when each finishes (SGLang may give the slot's row to a new request
        first). The prompts the step completed (their forward wrote their pages) are retained then too, so their
        first tokens do not wait for the daemon's RETAIN_CHAIN (~1,000 keys at 32K: 4 ms on a 2-core CPU host)."""
        if self._deferred is not None:
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            jobs, self._deferred = self._deferred, None
            retains, self._retain_later = self._retain_later, []
            t0 = time.perf_counter()
            try:
                self.retain_written()
                for args in retains:  # before the finished requests': theirs link to their prompts' keys
                    self._retain(*args, None)
                self._export_together(jobs)
            finally:
                self.export_s += time.perf_counter() - t0

    def _export(self, req: Any, kv_len: int) -> int:
        b, eng, p = self.backend, self.backend.engine, self.page_size
        slot = getattr(req, "req_pool_idx", None)
        if slot is None or not self._holds(slot, int(b.req_pool.req_generation[slot])):
            return 0
        num_pages = min(kv_len, eng.seq_len(slot)) // p
        done = eng._complete[slot]  # pages complete in the arena: exported before, or a hit's shared prefix
        if num_pages <= done:
            return 0
        if b.forward_exported(slot) >= num_pages:  # its prefill's forward wrote them whole (_export_in_forward)
            self.retain_written()  # its stashed chunks' copies ran before that forward: theirs first
            pages = eng.exported_by_caller(slot, num_pages)
            if self._deferred is not None:
                self._retain_later.append((req, slot, pages, done))
                return 0
            return self._retain(req, slot, pages, done, None)
        if b.staging.pages(slot):  # still in prefill: its sink pages are in staging
            return self._export_chunk(req, slot, num_pages, done)
        if self._deferred is not None:
            self._chain_keys(req, num_pages)  # from its tokens now: the export retains when the batch ends
            self._deferred = [job for job in self._deferred if job.slot != slot]  # a later export of it covers it
            self._deferred.append(_Export(req, slot, num_pages, done, self._dense_rows(slot, done, num_pages)))
            return 0
        try:
            pages = eng.export_prefix(slot, num_pages)
        except HostPagesUnavailable as e:
            self._unshared(num_pages, e)
            return 0
        self._write_dense(self._dense_rows(slot, done, num_pages), pages[done:])
        self.retain_written()  # synchronised: its stashed chunks have landed, and their keys go first
        return self._retain(req, slot, pages, done, None)

    def _export_chunk(self, req: Any, slot: int, num_pages: int, done: int) -> int:
        """A prompt still in prefill, stashed by SGLang (cache_unfinished_req(chunked=True)) right after it launched
        the chunk's forward, which under the overlap scheduler still runs: the copies from its staging and dense rows
        are queued behind that forward on the device, and its pages retained once they have landed (retain_written),
        never waited for here. A device synchronisation here held the scheduler until the chunk's forward was done, so
        it built and launched the next batch with the GPU idle, and streamed the step's first tokens after that."""
        b, eng = self.backend, self.backend.engine
        if eng.device.type == "cuda":
            ready = b.chunk_done(slot)
            if ready is None:
                raise RuntimeError(f"request slot {slot}: a chunk stashed before FreeKV saw its forward")
            torch.cuda.current_stream(eng.device).wait_event(ready)
        staged = (b.layer_kv, self.prefix_staging(slot) + b.staging.pages(slot))
        try:
            pages = eng.export_prefix(slot, num_pages, staged)
        except HostPagesUnavailable as e:
            self._unshared(num_pages, e)
            return 0
        self._write_dense(self._dense_rows(slot, done, num_pages), pages[done:], wait=False)
        generation, keys = int(b.req_pool.req_generation[slot]), self._chain_keys(req, num_pages)
        self._written.append(_Written(req, slot, generation, b._owner(slot), pages, done, keys, self._copies_queued()))
        return self.retain_written()

    def _copies_queued(self) -> Any:
        """An event after the device work queued so far (None on CPU, where it is done once queued)."""
        if self.backend.engine.device.type != "cuda":
            return None
        # Blocking: await_in_flight may wait out a whole chunk's forward here, and a spin would hold a host core that
        # the kvstore daemon and SGLang's other processes share.
        event = torch.cuda.Event(blocking=True)
        event.record()
        return event

    def retain_written(self, freeing: Collection[int] = ()) -> int:
        """Retain the stashed chunks whose copies have landed, oldest first, without waiting for any (a chunk's export
        links to the one before it); a chunk whose request left its slot meanwhile, or whose host pages went with a
        lost kvstore session, is dropped. freeing: slots about to give their host pages back, whose copies are waited
        for (the daemon could hand a page to another client while a copy still writes it). Returns the pages newly
        exported."""
        b, exported = self.backend, 0
        for w in self._written:
            if w.slot in freeing and w.landed is not None:
                w.landed.synchronize()
        while self._written and (self._written[0].landed is None or self._written[0].landed.query()):
            w = self._written.popleft()
            if not self._holds(w.slot, w.generation) or b._owner(w.slot) != w.owner:
                continue
            # Its staging pages, while the prompt is still in prefill, serve hits on it (stage_prefix's _inflight).
            staging = b.staging.pages(w.slot)
            staged = (b.layer_kv, self.prefix_staging(w.slot) + staging) if staging else None
            exported += self._retain(w.req, w.slot, w.pages, w.done, staged)
        return exported

    def _holds(self, slot: int, generation: int) -> bool:
        """Whether the slot still holds that request with its host pages (not lost, nor gone with a lost kvstore
        session)."""
        b = self.backend
        return (b.engine.is_active(slot) and slot not in b._lost and b._generation.get(slot) == generation
                and not b.host.owner_lost(b._owner(slot)))

    def _unshared(self, num_pages: int, e: HostPagesUnavailable) -> None:
        # No host pages for its sink (arena full, daemon refusing): the prompt is not shared, the request goes on; the
        # tree's matches are cut to what the arena retained.
        self.export_failures += 1
        logger.warning("FreeKV: a prompt of %d pages is not shared: %s", num_pages, e)

    def _export_together(self, jobs: list[_Export]) -> None:
        eng, ready = self.backend.engine, []
        for job in jobs:
            try:
                ready.append((job, eng.export_pages(job.slot, job.num_pages)))
            except HostPagesUnavailable as e:
                self._unshared(job.num_pages, e)
        if not ready:
            return
        eng.write_exports([(job.slot, job.num_pages, pages) for job, pages in ready])
        self._write_dense(torch.cat([job.dense_rows for job, _ in ready]),
                          [hp for job, pages in ready for hp in pages[job.done:]])
        self.retain_written()  # the device is synchronised: every stashed chunk has landed, and their keys go first
        for job, pages in ready:
            self._retain(job.req, job.slot, pages, job.done, None)

    def _retain(self, req: Any, slot: int, pages: list[int], done: int, staged) -> int:
        """Retain a slot's exported pages (whole in the arena) under the chain keys of req's tokens: the pages past
        `done` linked to the key of page done - 1 (retained by an earlier export or the hit it started from), or the
        whole chain when the daemon does not hold that key (or refuses)."""
        b, num_pages = self.backend, len(pages)
        keys = self._chain_keys(req, num_pages)
        if not (done and b.host.retain_chain(keys[done:], pages[done:], parent=keys[done - 1])):
            if not b.host.retain_chain(keys, pages):
                return 0
        if staged is not None:  # its own staging pages (past a hit's prefix) now hold retained pages
            rows = staged[1]
            for j in range(max(done, len(self._slot_prefix.get(slot, ()))), num_pages):
                self._inflight[pages[j]] = (slot, rows[j])
        self._summarised.update(pages)
        self.exported_pages += num_pages - done
        return num_pages - done

    def _chain_keys(self, req: Any, num_pages: int) -> list[bytes]:
        """The keys of req's first num_pages pages: those its match or an earlier export hashed (keys depend on the
        tokens alone: its prompt, or a retracted request's prompt and output), continued past them."""
        p, known = self.page_size, req.__dict__.get("_freekv_keys", ())[:num_pages]
        if not known:
            keys = self.keys(_tokens(req, 0, num_pages * p), getattr(req, "extra_key", None))
        else:
            keys = list(known) + prefix_keys(_tokens(req, len(known) * p, num_pages * p), p, parent=known[-1])
        self._remember_keys(req, keys)
        return keys

    @staticmethod
    def _remember_keys(req: Any, keys: list[bytes]) -> None:
        """Keep the longest chain hashed for req, so its later exports hash only their new pages."""
        if len(keys) > len(req.__dict__.get("_freekv_keys", ())):
            req._freekv_keys = keys

    def load_dense(self, req: Any, start: int, locs: torch.Tensor) -> None:
        """Write the dense layers' K/V of req's pinned prefix, tokens [start, start + len(locs)), from the arena into
        SGLang's token slots locs: a prefix the radix tree does not hold (evicted there, or retained by an earlier
        server) gets its dense layers back without recomputing them."""
        pin, p = req._freekv_prefix_pin, self.page_size
        eng, pool = self.backend.engine, self.backend.pool
        pages = upload(pin.pages[start // p:(start + len(locs)) // p], torch.int32, eng.device)
        for layer in range(eng.shape.num_layers):
            if eng.dense[layer]:
                eng.ops.pages_from_host(eng.host.arena[:, layer], pages, pool.get_key_buffer(layer),
                                        pool.get_value_buffer(layer), locs.to(eng.device, torch.int64),
                                        host_scales=eng.host_scales(layer))

    def _dense_rows(self, slot: int, first: int, num_pages: int) -> torch.Tensor:
        """SGLang's token rows of a slot's logical pages [first, num_pages), on the device."""
        p, eng = self.page_size, self.backend.engine
        return self.backend.req_pool.req_to_token[slot, first * p:num_pages * p].to(eng.device, torch.int64)

    def _write_dense(self, rows: torch.Tensor, pages: list[int], wait: bool = True) -> None:
        """Copy the dense layers' K/V at SGLang's token rows into host pages (one per page of rows): the engine does
        not hold dense layers under SGLang, and a retained prefix must be whole. wait: for these copies and
        export_prefix's (else the caller retains the pages once they have landed)."""
        eng, pool = self.backend.engine, self.backend.pool
        if pages:
            dst = upload(pages, torch.int32, eng.device)
            for layer in range(eng.shape.num_layers):
                if eng.dense[layer]:
                    eng.ops.pages_to_host(pool.get_key_buffer(layer), pool.get_value_buffer(layer), rows,
                                          eng.host.arena[:, layer], dst, host_scales=eng.host_scales(layer))
        if wait and eng.device.type == "cuda":  # export_prefix's pages and these in the arena before they are retained
            torch.cuda.synchronize(eng.device)

    # ---- forward side --------------------------------------------------------------------------

    def stage_prefix(self, slot: int, pin: PrefixPin) -> list[tuple[int, int]]:
        """Stage a hit row's prefix pages (shared with the other rows of the same host pages; prefix_staging lists
        them) and return the (staging page, host page) pairs newly staged, which the forward fills from the arena
        layer by layer."""
        staging, new = self.backend.staging, []
        for hp in pin.pages:
            entry = self._staged.get(hp)
            if entry is None and hp in self._inflight:  # a prompt in prefill holds it: read its staging page
                entry = self._staged[hp] = [self._inflight[hp][1], 0]
            elif entry is None:
                ((_, page),) = staging.grow(-1 - hp, 1)  # staging owners: request slots >= 0, prefix pages < 0
                entry = self._staged[hp] = [page, 0]
                new.append((page, hp))
            entry[1] += 1
        self._slot_prefix[slot] = list(pin.pages)
        unknown = [hp for hp in pin.pages if hp not in self._summarised]
        if unknown:  # retained by an earlier server on this arena: its summaries were GPU state there
            self.backend.engine.load_prefix_summaries(unknown)
            self._summarised.update(unknown)
        self.hits += 1
        self.hit_tokens += pin.tokens
        return new

    def prefix_staging(self, slot: int) -> list[int]:
        return [self._staged[hp][0] for hp in self._slot_prefix.get(slot, ())]

    def unstage_prefix(self, slot: int) -> None:
        for hp in self._slot_prefix.pop(slot, ()):
            entry = self._staged[hp]
            entry[1] -= 1
            if entry[1] == 0:
                self.backend.staging.release(-1 - hp)  # nothing while the prompt that staged it still owns it
                del self._staged[hp]

    def release_staging(self, slot: int) -> None:
        """Free a prompt's staging pages (its prefill completed, or it was aborted), handing those that hit rows still
        read over to their host page's prefix owner (released with the last such row, in unstage_prefix)."""
        keep = {}
        for hp in [hp for hp, (s, _) in self._inflight.items() if s == slot]:
            _, page = self._inflight.pop(hp)
            entry = self._staged.get(hp)
            if entry is not None and entry[0] == page:
                keep[page] = -1 - hp
        self.backend.staging.release(slot, keep)


def _tokens(req: Any, lo: int, hi: int) -> list[int]:
    """Tokens [lo, hi) of a request's prompt followed by its output, without joining the whole of both."""
    n = len(req.origin_input_ids)
    return list(req.origin_input_ids[lo:min(hi, n)]) + list(req.output_ids[max(lo - n, 0):max(hi - n, 0)])


def prefix_fill_index(engine: Any, fill: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device indices of fill [(staging page, host page)]: (host pages int32, the staging pages' token rows),
    built once per batch for every layer's fill_prefix_staging (a list made a tensor per layer would make every layer
    of a hit's prefill wait for the GPU: a blocking host-to-device copy)."""
    if not fill:
        return None
    pairs = torch.tensor(fill, dtype=torch.int64)  # [n, 2]
    on_gpu = torch.device(engine.device).type == "cuda"
    pairs = (pairs.pin_memory() if on_gpu else pairs).to(engine.device, non_blocking=on_gpu)
    return pairs[:, 1].to(torch.int32), engine.page_rows(pairs[:, 0])


def fill_prefix_staging(engine: Any, pool: Any, layer: int, index: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Copy one sparse layer's K/V of host pages into staging pages of SGLang's pool (index: prefix_fill_index)."""
    if index is None:
        return
    host, rows = index
    engine.ops.pages_from_host(engine.host.arena[:, layer], host, pool.get_key_buffer(layer),
                               pool.get_value_buffer(layer), rows, host_scales=engine.host_scales(layer))


def active_sharing() -> PrefixSharing | None:
    """The prefix sharing of this process's FreeKV backend (one per scheduler process), or None."""
    from .sglang_backend import _ACTIVE

    return next((b.radix for b in reversed(_ACTIVE) if b.radix is not None), None)
