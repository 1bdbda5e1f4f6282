"""How a FreeKV server splits its GPU KV budget, and what SGLang may admit.

SGLang sizes one token pool from the GPU memory left after the weights. Under FreeKV the GPU holds:
  - the dense layers' KV of every admitted token (SGLang's token pool, dense layers only);
  - staging pages for the sparse layers of the prefill in flight (freekv_sglang.staging);
  - per request slot, the engine's resident pages (sink + selection slots + window ring) of every
    sparse layer, plus its tables; and the page summaries, one per arena page.
The sparse layers' full KV lives in the kvstore arena, so SGLang's token capacity (what admission
counts) is what the arena holds, and the number of request slots is what the GPU has room for.
"""

from __future__ import annotations

import dataclasses

from .config import FreeKVConfig
from .early_query import predicted_layers
from .engine import ModelShape, engine_gpu_bytes
from .server_args import FreeKVArgsError

# SGLang's own ceiling on request slots when --max-running-requests is not given.
DEFAULT_MAX_REQUESTS = 4096


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    tokens: int  # SGLang's token pool: what admission counts
    max_requests: int  # SGLang's max_running_requests; the engine has one more slot (padding)
    gpu_requests: int  # request slots the GPU has room for (before --max-running-requests)
    staging_pages: int
    dense_bytes: int
    staging_bytes: int
    engine_bytes: int
    available_bytes: int
    early_bytes: int = 0  # early_weights "fp8": the W_q copies of the correction one layer early

    def describe(self) -> str:
        gb = 1e9
        return (f"{self.tokens} tokens (the arena's), {self.max_requests} request slots (room for "
                f"{self.gpu_requests}); GPU: dense layers "
                f"{self.dense_bytes / gb:.2f} GB + staging {self.staging_pages} pages {self.staging_bytes / gb:.2f} GB "
                f"+ engine {self.engine_bytes / gb:.2f} GB"
                + (f" + early W_q {self.early_bytes / gb:.2f} GB" if self.early_bytes else "")
                + f" of {self.available_bytes / gb:.2f} GB available")


def plan_memory(available_bytes: int, *, cfg: FreeKVConfig, shape: ModelShape, dtype_bytes: int, host_pages: int,
                context_len: int, prefill_tokens: int, max_running_requests: int | None = None,
                max_total_tokens: int | None = None, hidden_size: int = 0) -> MemoryPlan:
    """Split `available_bytes` of GPU memory. `prefill_tokens`: the most new tokens one prefill batch holds
    (SGLang's max_prefill_tokens or chunk size, whichever is larger); `context_len`: the longest request;
    `hidden_size`: the model's, which sizes early_weights "fp8"'s copies of W_q (one byte a weight and one an output
    row, every layer predicted)."""
    p, H, D = cfg.page_size, shape.num_kv_heads, shape.head_dim
    tokens = host_pages * p
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens // p * p)
    if tokens < p:
        raise FreeKVArgsError(f"the kvstore arena holds {host_pages} pages of this model: pass a larger "
                              "--kvstore-arena-gb")
    sparse_layers = shape.num_layers - cfg.dense_layers
    dense_bytes = (tokens + p) * cfg.dense_layers * H * D * 2 * dtype_bytes + (tokens // p + 1) * 4  # + page map
    staging_page_bytes = sparse_layers * p * H * D * 2 * dtype_bytes
    max_pages = -(-context_len // p)

    def engine(slots: int) -> int:
        return engine_gpu_bytes(cfg, shape, num_slots=slots, max_context=context_len, host_pages=host_pages,
                                dtype_bytes=dtype_bytes)

    def staging(requests: int) -> int:
        # The one chunked prompt's staged pages, the batch's new tokens, and each batch row's partial page.
        return max_pages + -(-prefill_tokens // p) + min(requests, prefill_tokens)

    # Each request slot costs its engine pages and, as a prefill batch row, up to one staging page.
    per_request = engine(2) - engine(1) + staging_page_bytes
    early_bytes = 0
    if cfg.early_weights == "fp8":
        if hidden_size <= 0:
            raise ValueError("early_weights 'fp8' needs the model's hidden_size to plan its W_q copies")
        q_size = shape.num_q_heads * D
        early_bytes = len(predicted_layers(shape.num_layers, cfg.dense_layers)) * q_size * (hidden_size + 1)
    left = available_bytes - early_bytes - dense_bytes - staging(0) * staging_page_bytes - engine(1)
    gpu_requests = left // per_request
    requests = min(max_running_requests or DEFAULT_MAX_REQUESTS, gpu_requests)
    if requests < 1:
        raise FreeKVArgsError(
            f"FreeKV's GPU share does not fit in {available_bytes / 1e9:.2f} GB: "
            + (f"early W_q {early_bytes / 1e9:.2f} GB (drop --kv-early-weights fp8), " if early_bytes else "")
            + "dense layers "
            f"{dense_bytes / 1e9:.2f} GB for {tokens} tokens, staging {staging(1) * staging_page_bytes / 1e9:.2f} GB "
            f"for a {context_len}-token prompt, {per_request / 1e9:.3f} GB per request; pass a smaller "
            "--kvstore-arena-gb, --context-length, --chunked-prefill-size or --kv-budget, or a larger "
            "--mem-fraction-static")
    pages = staging(requests)
    return MemoryPlan(tokens=tokens, max_requests=requests, gpu_requests=gpu_requests, staging_pages=pages, dense_bytes=dense_bytes,
                      staging_bytes=(pages + 1) * staging_page_bytes, engine_bytes=engine(requests + 1),
                      available_bytes=available_bytes, early_bytes=early_bytes)
