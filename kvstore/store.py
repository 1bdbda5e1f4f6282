"""Page bookkeeping of one arena: the free pool, the pages each request holds, retained prefixes under an LRU.

Plain data: no sockets, no shared memory. Every page is in exactly one state:
    free    in the pool, held by nobody;
    used    held by at least one request (a request holds the pages it allocated and those it pinned by LOOKUP);
    cached  held only by retained prefix keys, so evictable.
A page returns to the pool only when the last request and the last key holding it let go, so the pool never
hands out a page somebody still holds. Every method validates its whole input before it changes anything.

A key holds either its whole prefix's pages (retain) or, in a chain (retain_chain), one page linked to its parent key,
so retaining every page-aligned prefix of a long prompt costs one page per key instead of quadratic page lists. A
chain key's prefix is its ancestors' pages then its own. The LRU keeps every chain key before its ancestors (a use
touches the key, then each ancestor up to the root), and eviction takes only keys with no retained child, so a chain
is cut from its end and never leaves a key whose parent is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .errors import ArenaFull, InternalError, InvalidArgument, LimitExceeded


class PageTable:
    def __init__(self, num_pages: int, *, max_requests: int = 1 << 20, max_prefixes: int = 1 << 20) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.max_requests = max_requests
        self.max_prefixes = max_prefixes
        self.evicted_prefixes = 0
        self._free = list(range(num_pages - 1, -1, -1))  # a stack; pop() hands out low page ids first
        self._req_refs = [0] * num_pages
        self._key_refs = [0] * num_pages
        self._cached = 0
        self._requests: dict[int, list[int]] = {}
        self._prefixes: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # least recently used first
        self._parent: dict[bytes, bytes] = {}  # chain key -> its parent key (a chain's first key has none)
        self._children: dict[bytes, set[bytes]] = {}  # key -> its retained chain children (absent: none)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        return self._cached

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free) - self._cached

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_prefixes(self) -> int:
        return len(self._prefixes)

    def request_pages(self, request_id: int) -> list[int]:
        return list(self._requests.get(request_id, ()))

    def alloc(self, request_ids: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
        """Append counts[i] fresh pages to request_ids[i], all or nothing; evicts LRU prefixes if it must."""
        if len(request_ids) != len(counts) or any(n < 0 for n in counts):
            raise InvalidArgument("alloc needs one non-negative count per request id")
        total = sum(counts)
        if total > len(self._free) + self._cached:
            raise ArenaFull(
                f"cannot allocate {total} pages: {len(self._free)} free and {self._cached} evictable "
                f"of {self.num_pages} (the rest are held by {len(self._requests)} requests); "
                "free finished requests or give this client a larger arena"
            )
        new_ids = {rid for rid, n in zip(request_ids, counts, strict=True) if n and rid not in self._requests}
        self._check_request_room(len(new_ids))
        if total > len(self._free):
            self._evict_for(total)
        out = []
        for rid, n in zip(request_ids, counts, strict=True):
            if n == 0:
                out.append([])
                continue
            pages = self._free[-n:][::-1]
            del self._free[-n:]
            for p in pages:
                self._req_refs[p] = 1
            self._requests.setdefault(rid, []).extend(pages)
            out.append(pages)
        return out

    def free(self, request_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Drop requests (unknown ids count as already freed). Per request: pages released, pages pooled."""
        released, freed = [], []
        for rid in request_ids:
            pages = self._requests.pop(rid, ())
            released.append(len(pages))
            freed.append(self._change(pages, -1, 0))
        return released, freed

    def free_all_requests(self) -> int:
        """What a client's death does: every request lets go; retained pages stay cached."""
        return sum(self.free(list(self._requests))[1])

    def retain(self, keys: Sequence[bytes], page_lists: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[bool]]:
        """Retain each page list under its key. Equal keys mean equal tokens, so a key already retained keeps
        the pages it has (and becomes most recently used); the caller's pages are then not retained."""
        if len(keys) != len(page_lists):
            raise InvalidArgument(f"{len(keys)} keys but {len(page_lists)} page lists")
        seen: set[bytes] = set()
        for key, pages in zip(keys, page_lists, strict=True):
            if key in self._prefixes or key in seen:
                continue
            seen.add(key)
            if not pages:
                raise InvalidArgument("every retained key needs at least one page")
            if len(set(pages)) != len(pages):
                raise InvalidArgument(f"key {key.hex()} lists a page twice")
            for p in pages:
                if not 0 <= p < self.num_pages:
                    raise InvalidArgument(f"page {p} is outside this arena (0..{self.num_pages - 1})")
                if self._req_refs[p] == 0 and self._key_refs[p] == 0:
                    raise InvalidArgument(f"page {p} is free: only pages a request or a prefix holds can be retained")
        held, created = [], []
        for key, pages in zip(keys, page_lists, strict=True):
            existing = self._prefixes.get(key)
            if existing is not None:
                self._touch(key)
                held.append(self.prefix_pages(key))
                created.append(False)
                continue
            self._prefixes[key] = tuple(pages)
            self._change(pages, 0, 1)
            held.append(list(pages))
            created.append(True)
        self._trim_prefixes()
        return held, created

    def retain_chain(self, keys: Sequence[bytes], pages: Sequence[int], parent: bytes | None = None) -> list[bool]:
        """Retain a chain: keys[i] holds pages[i] alone, its parent being keys[i-1] (keys[0]'s: parent, a retained key,
        or none). A key already retained keeps its page (equal keys mean equal tokens) and stays the parent of the next
        key. Returns, per key, whether it was created."""
        if len(keys) != len(pages) or not keys:
            raise InvalidArgument(f"a chain needs one page per key, got {len(keys)} keys and {len(pages)} pages")
        if parent is not None and parent not in self._prefixes:
            raise InvalidArgument(f"parent key {parent.hex()} is not retained")
        if len(set(keys)) != len(keys) or parent in keys:
            raise InvalidArgument("a chain lists a key twice")
        new = [i for i, key in enumerate(keys) if key not in self._prefixes]
        if len({pages[i] for i in new}) != len(new):
            raise InvalidArgument("a chain lists a page twice")
        for i in new:
            p = pages[i]
            if not 0 <= p < self.num_pages:
                raise InvalidArgument(f"page {p} is outside this arena (0..{self.num_pages - 1})")
            if self._req_refs[p] == 0 and self._key_refs[p] == 0:
                raise InvalidArgument(f"page {p} is free: only pages a request or a prefix holds can be retained")
        for i, key in enumerate(keys):
            if key in self._prefixes and self._parent.get(key) != (parent if i == 0 else keys[i - 1]):
                raise InvalidArgument(f"key {key.hex()} is retained under another parent")
        created = [False] * len(keys)
        for i in new:
            key, up = keys[i], parent if i == 0 else keys[i - 1]
            self._prefixes[key] = (pages[i],)
            if up is not None:
                self._parent[key] = up
                self._children.setdefault(up, set()).add(key)
            self._change((pages[i],), 0, 1)
            created[i] = True
        self._touch(keys[-1])
        self._trim_prefixes()
        return created

    def release(self, keys: Sequence[bytes]) -> tuple[list[bool], int]:
        released, freed = [], 0
        for key in keys:
            released.append(key in self._prefixes)
            if key in self._prefixes:
                freed += self._drop_subtree(key)
        return released, freed

    def lookup(self, keys: Sequence[bytes], request_id: int | None = None) -> tuple[int, list[int]]:
        """The last of keys that is retained, as (index, pages), or (-1, []). With request_id, the request
        also holds the pages until it is freed, so no eviction can hand them out while it reads them."""
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] not in self._prefixes:
                continue
            pages = self.prefix_pages(keys[i])
            if request_id is not None:
                self._check_request_room(request_id not in self._requests)
                self._requests.setdefault(request_id, []).extend(pages)
                self._change(pages, 1, 0)
            self._touch(keys[i])
            return i, pages
        return -1, []

    def prefix_pages(self, key: bytes) -> list[int]:
        """The pages of a retained key's prefix: its chain ancestors' pages, then its own."""
        parts = [self._prefixes[key]]
        while key in self._parent:
            key = self._parent[key]
            parts.append(self._prefixes[key])
        return [p for part in reversed(parts) for p in part]

    def state(self) -> dict:
        """Everything a restarted daemon needs to rebuild this table exactly, orders included (the free
        stack and the LRU decide what later calls hand out), as plain msgpack-able data."""
        return {
            "free": list(self._free),
            "requests": [[rid, pages] for rid, pages in self._requests.items()],
            "prefixes": [[key, list(pages)] for key, pages in self._prefixes.items()],
            "parents": [[key, parent] for key, parent in self._parent.items()],
            "evicted": self.evicted_prefixes,
        }

    @classmethod
    def from_state(cls, num_pages: int, state: dict, **limits: int) -> PageTable:
        """The table state() described; the reference counts are recounted and the result audited."""
        table = cls(num_pages, **limits)
        table._free = [int(p) for p in state["free"]]
        table._requests = {int(rid): [int(p) for p in pages] for rid, pages in state["requests"]}
        table._prefixes = OrderedDict((bytes(key), tuple(int(p) for p in pages)) for key, pages in state["prefixes"])
        table.evicted_prefixes = int(state["evicted"])
        for key, parent in state.get("parents", ()):  # journals of format 1 have no chains
            key, parent = bytes(key), bytes(parent)
            if key not in table._prefixes or parent not in table._prefixes:
                raise InvalidArgument(f"chain key {key.hex()} or its parent is not retained")
            table._parent[key] = parent
            table._children.setdefault(parent, set()).add(key)
        for holders, refs in ((table._requests, table._req_refs), (table._prefixes, table._key_refs)):
            for pages in holders.values():
                for p in pages:
                    if not 0 <= p < num_pages:
                        raise InvalidArgument(f"page {p} is outside an arena of {num_pages} pages")
                    refs[p] += 1
        table._cached = sum(1 for r, k in zip(table._req_refs, table._key_refs, strict=True) if r == 0 and k > 0)
        problem = table.audit()
        if problem:
            raise InvalidArgument(problem)
        return table

    def audit(self) -> str | None:
        """Recount every reference from the request and prefix tables; the first inconsistency, or None."""
        req_refs = [0] * self.num_pages
        key_refs = [0] * self.num_pages
        for pages in self._requests.values():
            for p in pages:
                req_refs[p] += 1
        for pages in self._prefixes.values():
            for p in pages:
                key_refs[p] += 1
        if req_refs != self._req_refs:
            return "request reference counts disagree with the request table"
        if key_refs != self._key_refs:
            return "prefix reference counts disagree with the prefix table"
        children: dict[bytes, set[bytes]] = {}
        for key, parent in self._parent.items():
            if key not in self._prefixes or parent not in self._prefixes:
                return f"chain key {key.hex()} or its parent is not retained"
            children.setdefault(parent, set()).add(key)
        if children != self._children:
            return "chain children disagree with the parent links"
        pool = set(self._free)
        if len(pool) != len(self._free):
            return "a page is in the free pool twice"
        idle = {p for p in range(self.num_pages) if req_refs[p] == 0 and key_refs[p] == 0}
        if pool != idle:
            return f"free pool differs from unheld pages on {sorted(pool ^ idle)[:8]}"
        cached = sum(1 for p in range(self.num_pages) if req_refs[p] == 0 and key_refs[p] > 0)
        if cached != self._cached:
            return f"cached count {self._cached} but {cached} pages are held by prefixes alone"
        return None

    def _check_request_room(self, new_requests: int) -> None:
        if len(self._requests) + new_requests > self.max_requests:
            raise LimitExceeded(f"more than {self.max_requests} live requests in one arena; free finished ones")

    def _change(self, pages: Sequence[int], d_req: int, d_key: int) -> int:
        """Move references on held pages; pool those nobody holds any more and return how many."""
        req_refs, key_refs = self._req_refs, self._key_refs
        pooled = 0
        for p in pages:
            was_cached = req_refs[p] == 0 and key_refs[p] > 0
            req_refs[p] += d_req
            key_refs[p] += d_key
            r, k = req_refs[p], key_refs[p]
            self._cached += (r == 0 and k > 0) - was_cached
            if r == 0 and k == 0:
                self._free.append(p)
                pooled += 1
        return pooled

    def _touch(self, key: bytes) -> None:
        """Make key and then each of its ancestors most recently used (so ancestors stay after descendants)."""
        while key is not None:
            self._prefixes.move_to_end(key)
            key = self._parent.get(key)

    def _unlink(self, key: bytes) -> int:
        """Forget one key (it has no retained children) and pool the pages only it held."""
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
        return self._change(self._prefixes.pop(key), 0, -1)

    def _drop_subtree(self, key: bytes) -> int:
        freed = 0
        for child in list(self._children.get(key, ())):
            freed += self._drop_subtree(child)
        return freed + self._unlink(key)

    def _evict(self, key: bytes) -> None:
        self._unlink(key)
        self.evicted_prefixes += 1

    def _trim_prefixes(self) -> None:
        while len(self._prefixes) > self.max_prefixes:
            self._evict(next(k for k in self._prefixes if k not in self._children))

    def _evict_for(self, target_free: int) -> None:
        """Evict least recently used prefixes until target_free pages are pooled. Keys whose pages are all
        held by requests free nothing now; they are in use, so they count as recently used. Chain keys with
        retained children wait for them (a request holding a child holds its ancestors too). The caller has
        checked free + cached >= target: dropping every key with a cached page pools every cached page."""
        skipped = 0
        while len(self._free) < target_free and skipped < len(self._prefixes):
            key = next(iter(self._prefixes))
            if key in self._children or key in self._parent:
                key = next((k for k in self._prefixes if k not in self._children
                            and not all(self._req_refs[p] for p in self._prefixes[k])), None)
                if key is None:
                    break
            elif all(self._req_refs[p] for p in self._prefixes[key]):
                self._prefixes.move_to_end(key)
                skipped += 1
                continue
            self._evict(key)
            skipped = 0
        if len(self._free) < target_free:  # unreachable while the counters are right; never hand out short
            raise InternalError(f"eviction pooled {len(self._free)} pages, {target_free} expected: {self.audit()}")
