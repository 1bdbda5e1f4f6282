"""FreeKV kernels: one folder per op, each with a torch reference (naive.py) and a Triton kernel (triton.py).

Tensor conventions shared by every op:
  B batch rows, R request slots, L layers, H KV heads, G query heads per KV head, Hq = H * G,
  D head dim, p page size, M max logical pages per request, P host pages.
  GPU KV cache of one layer (SGLang's NHD token layout): k_cache, v_cache [T, H, D]; page g is rows g*p .. g*p+p-1.
  Host KV arena: host_kv [P, L, H, 2, p, D] (HND pages; [.., 0, ..] keys, [.., 1, ..] values).
  Page summaries of one layer: summaries [P, H, 2, D] ([.., 0, :] elementwise min, [.., 1, :] max), indexed by host page.

Compilation: Triton compiles a kernel again for each new pattern of its integer arguments (equal to 1, divisible by
16). Arguments that vary with a request or a batch outside a CUDA graph (prompt tokens and pages, rows of a prefill,
the staged pages' width) are declared do_not_specialize, so the server compiles them at its warm-up and never on a
request's path (tests/engine/test_prefill_path_gpu.py).
"""
