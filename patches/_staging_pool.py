"""FreeKV's SGLang token pool (written against sglang 0.5.16's MHATokenToKVPool).

SGLang's token locations keep their meaning, but only the dense layers get a buffer row per location. The
sparse layers' buffers hold the staging pages (freekv_sglang.staging) of the prefill in flight, and every write
to a sparse layer goes through page_map; the attention backend reads sparse layers only at translated locations
(freekv_sglang.sglang_backend). get_kv_size_bytes() sums the real buffers, so SGLang's log of the pool is true.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def staging_pool_class(base: type) -> type:
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    from freekv_sglang.server_args import FreeKVArgsError
    from freekv_sglang.staging import StagingPages, translate

    class FreeKVTokenToKVPool(base):
        def __init__(self, *args, freekv_dense_layers: int, freekv_staging_pages: int, **kwargs):
            if kwargs.get("post_capture_active"):
                raise FreeKVArgsError("FreeKV sizes SGLang's KV pool itself: unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING")
            self.freekv_dense_layers = freekv_dense_layers
            self.staging = StagingPages(freekv_staging_pages)
            super().__init__(*args, **kwargs)
            pages = (self.size + self.page_size) // self.page_size
            self.page_map = torch.full((pages,), self.staging.trash, dtype=torch.int32, device=self.device)
            self._staged_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (locations, rows) of this batch

        def is_staged(self, layer_id: int) -> bool:
            return layer_id >= self.freekv_dense_layers

        def _create_buffers(self):
            if self.is_quantized_kv_cache or self.kv_cache_layout != "nhd":
                raise FreeKVArgsError(f"FreeKV needs an unquantized NHD KV cache (got {self.kv_cache_layout}, "
                                      f"{self.dtype}): drop --kv-cache-dtype and SGLANG_USE_HND_KVCACHE")
            self.k_scale_buffer = self.v_scale_buffer = self.dq_k_buffer = self.dq_v_buffer = None
            rows = [(self.staging.num_pages + 1) * self.page_size if self.is_staged(layer) else self.size + self.page_size
                    for layer in range(self.start_layer, self.start_layer + self.layer_num)]
            kw = dict(dtype=self.store_dtype, device=self.device)
            self.k_buffer = [torch.zeros((n, self.head_num, self.head_dim), **kw) for n in rows]
            self.v_buffer = [torch.zeros((n, self.head_num, self.v_head_dim), **kw) for n in rows]
            self._kv_buffer_descs = self._build_kv_buffer_descs()
            self._init_data_ptrs_and_strides()

        def translate(self, loc: torch.Tensor) -> torch.Tensor:
            return translate(self.page_map, loc, self.page_size)

        def staged_rows(self, loc: torch.Tensor) -> torch.Tensor:
            """Staging rows of an extend batch's token locations, translated once for all its staged layers (each
            writes at the same locations; the translation is ~6 launches, recomputed for every layer before). Staged
            layers are written only by extend forwards, each prepared by the backend, which forgets the rows before
            it changes page_map (forget_staged_rows), and again at every decode step. Not while a graph is captured:
            the graph must record the translation, not read rows computed outside it. The locations are matched by
            what they view, not by object: SGLang's breakable prefill graph hands each layer a new view of them (the
            memo holds the first, so no other tensor can take its memory meanwhile)."""
            capturing = loc.is_cuda and torch.cuda.is_current_stream_capturing()
            memo = self._staged_rows
            if memo is not None and not capturing and _same_view(memo[0], loc):
                return memo[1]
            rows = self.translate(loc)
            if not capturing:
                self._staged_rows = (loc, rows)
            return rows

        def forget_staged_rows(self) -> None:
            self._staged_rows = None

        def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
            layer_id = kwargs.get("layer_id_override")
            if self.is_staged(layer.layer_id if layer_id is None else layer_id):
                loc_info = self.staged_rows(unwrap_write_loc(loc_info)[0])
            return super().set_kv_buffer(layer, loc_info, cache_k, cache_v, *args, **kwargs)

        def _store_kv_layer(self, layer_idx: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor):
            # SGLang bounds every layer's write by the token pool (size + page_size, its store kernel's device
            # assert): here each layer's bound is its own buffer's rows, the same for a dense layer, while a staged
            # layer's rows are staging rows, past the token pool when the arena is small.
            k_buf, v_buf = self.k_buffer[layer_idx], self.v_buffer[layer_idx]
            memory_pool._set_kv_buffer_impl(cache_k, cache_v, k_buf, v_buf, loc, row_dim=self.row_dim,
                                            store_dtype=self.store_dtype, device_module=self.device_module,
                                            size_limit=k_buf.shape[0], alt_stream=self.alt_stream,
                                            same_kv_dim=self.same_kv_dim)

    FreeKVTokenToKVPool.__name__ = FreeKVTokenToKVPool.__qualname__ = f"FreeKV{base.__name__}"
    return FreeKVTokenToKVPool


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)
