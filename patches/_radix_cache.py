"""FreeKV's radix cache (written against sglang 0.5.16's RadixCache): SGLang's tree, its hits cut to the kvstore's.

The tree keeps each cached prefix's token slots, which under FreeKV hold the dense layers' KV only; the sparse layers'
prefix comes from the kvstore arena (freekv_sglang.radix). So:
  - match_prefix with a request: the arena's longest retained prefix of the request's tokens, pinned for the request.
    Shorter than the tree's match: the match is cut to it. Longer (the tree evicted it, or an earlier server on the
    same arena retained it): its dense layers are loaded from the arena into new token slots and inserted into the
    tree. The tree is then matched again at that length, so the locked node is the one the request uses;
  - cache_finished_req: the finished request's full pages are exported to the arena and retained under their keys
    before SGLang inserts its tokens (a radix node's eviction leaves the arena's keys to the arena's LRU);
  - cache_unfinished_req after each chunk of a prompt (chunked=True) and once its prefill completed: its full pages
    so far are exported the same way (a prompt still in prefill from its staging pages, its copies queued behind the
    chunk's forward and its keys retained once they have landed), so requests admitted while it still prefills, or
    decodes, hit the part already computed; each export writes only the pages the last one did not.
A match without a request (the scheduling policy's prefix estimate) is the tree's alone.
"""

from __future__ import annotations

import functools


@functools.cache
def radix_cache_class() -> type:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from freekv_sglang.radix import active_sharing

    def sharing():
        found = active_sharing()
        if found is None:
            raise RuntimeError("FreeKV's radix cache found no FreeKV attention backend with the radix cache on in "
                               "this scheduler process")
        return found

    class FreeKVRadixCache(RadixCache):
        def match_prefix(self, params: MatchPrefixParams):
            result = super().match_prefix(params)
            matched = len(result.device_indices)
            if params.req is None or self.disable or sharing().ranking:
                return result
            token_ids, p = params.key.token_ids, self.page_size
            tokens = sharing().match(params.req, token_ids, len(params.key) // p * p)
            if tokens > matched and not self._load(params, result, tokens):
                tokens = sharing().match(params.req, token_ids, matched)
            if tokens == matched:
                return result
            if tokens == 0:
                return self._empty_match_result
            key = RadixKey(token_ids=token_ids[:tokens], extra_key=params.key.extra_key)
            return super().match_prefix(MatchPrefixParams(key=key, req=params.req))

        def _load(self, params: MatchPrefixParams, result, tokens: int) -> bool:
            """The arena's pinned prefix reaches past the tree's match: give tokens [matched, tokens) new token slots,
            load their dense layers from the arena and insert them into the tree (unlocked, so they count as
            evictable, as any cached node, until the scheduler admits the request). False when no slots can be had."""
            matched = len(result.device_indices)
            need, allocator = tokens - matched, self.token_to_kv_pool_allocator
            if allocator.available_size() < need:
                self.inc_lock_ref(result.last_device_node)  # the part of the match this request keeps
                self.evict(EvictParams(num_tokens=need - allocator.available_size()))
                self.dec_lock_ref(result.last_device_node)
            locs = allocator.alloc(need)
            if locs is None:
                return False
            sharing().load_dense(params.req, matched, locs)
            key = RadixKey(token_ids=params.key.token_ids[:tokens], extra_key=params.key.extra_key)
            self.insert(InsertParams(key=key, value=torch.cat([result.device_indices, locs])))
            return True

        def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
            if is_insert and not self.disable and not self.disable_finished_insert:
                sharing().export(req, kv_len_to_handle)
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)

        def cache_unfinished_req(self, req, chunked=False):
            # SGLang calls this after each chunk of a prompt (chunked=True, inserting the chunk into the tree) and
            # once the prompt completed: its full pages so far are retained first, so a request matched next finds
            # in the arena what the tree holds; the export of its output pages waits for cache_finished_req.
            if not self.disable:
                sharing().export(req, len(req.get_fill_ids()))
            return super().cache_unfinished_req(req, chunked=chunked)

    return FreeKVRadixCache
