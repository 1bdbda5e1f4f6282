"""FreeKV's radix cache (written against sglang 0.5.16's RadixCache): SGLang's tree, its hits cut to the kvstore's.

The tree keeps each cached prefix's token slots, which under FreeKV hold the dense layers' KV only; the sparse layers'
prefix comes from the kvstore arena (freekv_sglang.radix). So:
  - match_prefix with a request: the tree's match, cut to the arena's longest retained prefix of it (pinned for the
    request); the tree is matched again at that length so the locked node is the one the request uses;
  - cache_finished_req: the finished request's full pages are exported to the arena and retained under their keys
    before SGLang inserts its tokens (a radix node's eviction leaves the arena's keys to the arena's LRU);
  - cache_unfinished_req once a prompt's prefill completed: its full pages are exported the same way, so requests
    arriving while it decodes hit its prefix; for a chunk of a prompt still in prefill (chunked=True) nothing is
    exported (its sink pages are staged, not on the engine's GPU pages, until the prefill completes).
A match without a request (the scheduling policy's prefix estimate) is the tree's alone.
"""

from __future__ import annotations

import functools


@functools.cache
def radix_cache_class() -> type:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
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
            if params.req is None or self.disable:
                return result
            tokens = sharing().match(params.req, params.key.token_ids, matched)
            if tokens == matched:
                return result
            if tokens == 0:
                return self._empty_match_result
            key = RadixKey(token_ids=params.key.token_ids[:tokens], extra_key=params.key.extra_key)
            return super().match_prefix(MatchPrefixParams(key=key, req=params.req))

        def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
            if is_insert and not self.disable and not self.disable_finished_insert:
                sharing().export(req, kv_len_to_handle)
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)

        def cache_unfinished_req(self, req, chunked=False):
            # SGLang calls this once a prompt's prefill completed (chunked=False), so its prefix is shared while it
            # decodes; the export of its output pages waits for cache_finished_req.
            if not chunked and not self.disable:
                sharing().export(req, len(req.get_fill_ids()))
            return super().cache_unfinished_req(req, chunked=chunked)

    return FreeKVRadixCache
