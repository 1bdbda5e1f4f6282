"""The request slots of a batch reach the attention backend on every path a ForwardBatch takes (ScheduleBatch ->
ForwardBatch.init_new -> eager copy / prefill graph / decode graph capture and replay view), the freed-slot and
backend-wrapping hooks fire, and nothing happens with FreeKV off. Runs the patched SGLang symbols on CPU where they
run without a GPU, and the hooks directly with stand-ins where they do not."""

import dataclasses
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, FreeKVServerSettings

ON = SimpleNamespace(_freekv=FreeKVServerSettings(config=FreeKVConfig(), kvstore_endpoint="ipc:///tmp/t.sock"))
OFF = SimpleNamespace()


@pytest.fixture
def fake_backend_module(monkeypatch):
    """freekv_sglang.sglang_backend as the hooks import it (the real one needs a GPU)."""
    module = types.ModuleType("freekv_sglang.sglang_backend")
    module.freed = []
    module.on_request_freed = module.freed.append

    class FreeKVAttnBackend:
        def __init__(self, runner, inner, settings):
            self.runner, self.inner, self.settings = runner, inner, settings

    module.FreeKVAttnBackend = FreeKVAttnBackend
    monkeypatch.setitem(sys.modules, "freekv_sglang.sglang_backend", module)
    return module


def _forward_batch(bs=3):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
                        req_pool_indices=torch.tensor([5, 2, 7][:bs]), seq_lens=torch.tensor([40, 41, 42][:bs]),
                        out_cache_loc=torch.zeros(bs, dtype=torch.int64), seq_lens_sum=123)


def test_init_new_puts_slots_on_the_batch(plugins):
    from freekv_patches.forward_batch_init_new import hook

    slots = torch.tensor([5, 2, 7])
    fb = _forward_batch()
    hook(fb, None, SimpleNamespace(req_pool_indices_cpu=slots), SimpleNamespace(server_args=ON))
    assert fb._freekv_req_slots_cpu is slots and fb._freekv_raw_bs == 3
    stale = _forward_batch()
    hook(stale, None, SimpleNamespace(req_pool_indices_cpu=torch.tensor([1, 2])), SimpleNamespace(server_args=ON))
    assert stale._freekv_req_slots_cpu is None  # wrong length: None, the backend refuses
    missing = _forward_batch()
    hook(missing, None, SimpleNamespace(), SimpleNamespace(server_args=ON))
    assert missing._freekv_req_slots_cpu is None
    off = _forward_batch()
    hook(off, None, SimpleNamespace(req_pool_indices_cpu=slots), SimpleNamespace(server_args=OFF))
    assert "_freekv_req_slots_cpu" not in vars(off)


def test_dataclasses_replace_drops_unknown_attributes_so_eager_copy_is_hooked(plugins, monkeypatch):
    import dataclasses

    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    fb = _forward_batch()
    fb._freekv_req_slots_cpu, fb._freekv_raw_bs = torch.tensor([5, 2, 7]), 3
    assert "_freekv_req_slots_cpu" not in vars(dataclasses.replace(fb))  # why the hook exists
    monkeypatch.setenv("SGLANG_EAGER_INPUT_NO_COPY", "1")  # load_batch returns dataclasses.replace(fb)
    out = EagerRunner.load_batch(SimpleNamespace(), fb)  # the patched method, as the eager runner calls it
    assert out is not fb and torch.equal(out._freekv_req_slots_cpu, fb._freekv_req_slots_cpu)
    assert out._freekv_raw_bs == 3
    plain = EagerRunner.load_batch(SimpleNamespace(), _forward_batch())
    assert "_freekv_req_slots_cpu" not in vars(plain)


def test_prefill_graph_copy_carries_slots(plugins):
    from freekv_patches.prefill_graph_load_batch import hook

    fb = _forward_batch()
    fb._freekv_req_slots_cpu, fb._freekv_raw_bs = torch.tensor([5, 2, 7]), 3
    static = _forward_batch()
    hook(static, None, fb)
    assert static._freekv_req_slots_cpu is fb._freekv_req_slots_cpu and static._freekv_raw_bs == 3


def test_replay_view_is_padded(plugins):
    """build_replay_fb_view (patched, called as load_batch calls it) returns a SimpleNamespace: the hook adds slots
    padded with 0 (ReqToTokenPool's padding row) to the captured size and the real batch size."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner_module

    bs, raw_bs = 8, 3
    fb = _forward_batch(raw_bs)
    fb._freekv_req_slots_cpu, fb._freekv_raw_bs = torch.tensor([5, 2, 7]), raw_bs
    buffers = SimpleNamespace(input_ids=torch.zeros(bs, dtype=torch.int64), positions=torch.zeros(bs),
                              req_pool_indices=torch.zeros(bs, dtype=torch.int64), seq_lens=torch.ones(bs),
                              seq_lens_cpu=torch.ones(bs), encoder_lens=None)
    view = runner_module.build_replay_fb_view(forward_batch=fb, buffers=buffers, bs=bs, raw_bs=raw_bs, num_tokens=bs,
                                              seq_len_fill_value=1, capture_forward_mode=ForwardMode.DECODE,
                                              is_encoder_decoder=False)
    assert isinstance(view, SimpleNamespace)
    assert view._freekv_req_slots_cpu.tolist() == [5, 2, 7, 0, 0, 0, 0, 0]
    assert view._freekv_req_slots_cpu.dtype == torch.int64 and view._freekv_raw_bs == raw_bs
    assert view.num_padding == bs - raw_bs
    plain = runner_module.build_replay_fb_view(forward_batch=_forward_batch(raw_bs), buffers=buffers, bs=bs,
                                               raw_bs=raw_bs, num_tokens=bs, seq_len_fill_value=1,
                                               capture_forward_mode=ForwardMode.DECODE, is_encoder_decoder=False)
    assert not hasattr(plain, "_freekv_req_slots_cpu")


def test_capture_batch_is_all_padding(plugins):
    from freekv_patches.decode_graph_capture_prepare import hook

    fb = _forward_batch()
    hook((fb, None, None), SimpleNamespace(model_runner=SimpleNamespace(server_args=ON)), 3)
    assert fb._freekv_req_slots_cpu.tolist() == [0, 0, 0] and fb._freekv_raw_bs == 0
    off = _forward_batch()
    hook((off, None, None), SimpleNamespace(model_runner=SimpleNamespace(server_args=OFF)), 3)
    assert "_freekv_req_slots_cpu" not in vars(off)


def test_freed_slots_are_reported(plugins, fake_backend_module):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
    reqs = [SimpleNamespace(req_pool_idx=None) for _ in range(2)]
    assert pool.alloc(reqs) == [1, 2]
    pool.free(reqs[0])  # pool not marked (FreeKV off): nothing reported
    assert fake_backend_module.freed == []
    pool._freekv_enabled = True
    pool.free(reqs[1])
    assert fake_backend_module.freed == [2] and reqs[1].req_pool_idx is None


def test_backend_is_wrapped(plugins, fake_backend_module):
    from freekv_patches.attn_backend_wrapper import hook

    inner = object()
    runner = SimpleNamespace(server_args=ON)
    wrapped = hook(lambda r, b: b, runner, inner)
    assert isinstance(wrapped, fake_backend_module.FreeKVAttnBackend)
    assert wrapped.inner is inner and wrapped.runner is runner and wrapped.settings is ON._freekv
    assert hook(lambda r, b: b, SimpleNamespace(server_args=OFF), inner) is inner


def _runner(hf_config, server_args, **kw):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu", enable_memory_saver=False)
    model_config = SimpleNamespace(hf_config=hf_config, is_hybrid_swa=False)
    return SimpleNamespace(server_args=server_args, model_config=model_config, req_to_token_pool=pool,
                           is_draft_worker=False, use_mla_backend=False, **kw)


def test_scheduler_self_check(plugins, monkeypatch):
    from transformers import LlamaConfig, MistralConfig

    from freekv_patches.model_runner_post_pool import hook
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    llama = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)  # head dim 32
    runner = _runner(llama, SimpleNamespace(_freekv=FreeKVServerSettings(config=FreeKVConfig())))
    monkeypatch.setenv("FREEKV_KVSTORE_ENDPOINT", "ipc:///tmp/from-env.sock")
    hook(None, runner)
    assert runner.req_to_token_pool._freekv_enabled
    assert runner.server_args._freekv.kvstore_endpoint == "ipc:///tmp/from-env.sock"
    assert ForwardBatch._freekv_req_slots_cpu is None and ForwardBatch._freekv_raw_bs is None

    monkeypatch.delenv("FREEKV_KVSTORE_ENDPOINT")
    with pytest.raises(RuntimeError, match="kvstore endpoint"):
        hook(None, _runner(llama, SimpleNamespace(_freekv=FreeKVServerSettings(config=FreeKVConfig()))))
    with pytest.raises(FreeKVArgsError, match="sliding-window"):
        hook(None, _runner(MistralConfig(num_hidden_layers=2), ON))
    with pytest.raises(FreeKVArgsError, match="--kv-dense-layers"):
        deep = FreeKVServerSettings(FreeKVConfig(dense_layers=3), "ipc:///x")
        hook(None, _runner(llama, SimpleNamespace(_freekv=deep)))
    with pytest.raises(FreeKVArgsError, match="MLA"):
        hook(None, SimpleNamespace(**{**vars(_runner(llama, ON)), "use_mla_backend": True}))
    off = _runner(llama, OFF)
    hook(None, off)
    assert not hasattr(off.req_to_token_pool, "_freekv_enabled")


def test_self_check_refuses_missing_hooks(plugins, monkeypatch):
    from transformers import LlamaConfig

    import sglang.srt.model_executor.runner.eager_runner as eager
    from freekv_patches.model_runner_post_pool import hook

    monkeypatch.setattr(eager.EagerRunner, "load_batch", eager.EagerRunner.load_batch.__wrapped__)
    llama = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)  # head dim 32
    with pytest.raises(RuntimeError, match="EagerRunner.load_batch"):
        hook(None, _runner(llama, ON))


def test_dummy_and_prefill_capture_batches_have_no_real_rows(plugins):
    from freekv_patches.prefill_graph_capture_prepare import hook as prefill_capture
    from sglang.srt.model_executor.model_runner import ModelRunner

    fb = _forward_batch()
    out = ModelRunner.prepare_dummy_forward_batch(SimpleNamespace(server_args=ON), fb)  # patched method
    assert out._freekv_req_slots_cpu.tolist() == [5, 2, 7] and out._freekv_raw_bs == 0
    off = ModelRunner.prepare_dummy_forward_batch(SimpleNamespace(server_args=OFF), _forward_batch())
    assert "_freekv_req_slots_cpu" not in vars(off)
    fb = _forward_batch()
    prefill_capture((fb, None), SimpleNamespace(model_runner=SimpleNamespace(server_args=ON)), 64)
    assert fb._freekv_req_slots_cpu.tolist() == [0, 1, 2] and fb._freekv_raw_bs == 0


def test_init_new_marks_prefill_completion(plugins):
    from freekv_patches.forward_batch_init_new import hook
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    def req(end, total):
        return SimpleNamespace(extend_range=SimpleNamespace(end=end), full_untruncated_fill_ids=[0] * total)

    fb = _forward_batch()
    fb.forward_mode = ForwardMode.EXTEND
    batch = SimpleNamespace(req_pool_indices_cpu=torch.tensor([5, 2, 7]), reqs=[req(90, 90), req(64, 200), req(7, 7)])
    hook(fb, None, batch, SimpleNamespace(server_args=ON))
    assert fb._freekv_prefill_done_cpu == [True, False, True]
    batch.reqs = batch.reqs[:2]  # not one per row: None, the backend refuses
    hook(fb, None, batch, SimpleNamespace(server_args=ON))
    assert fb._freekv_prefill_done_cpu is None
    decode = _forward_batch()
    hook(decode, None, batch, SimpleNamespace(server_args=ON))
    assert decode._freekv_prefill_done_cpu is None


class _Configurator:
    """Like SGLang's KVCacheConfigurator, it takes no attributes beyond its slots."""

    __slots__ = ("server_args", "model_config", "kv_cache_dtype", "_profile_available_bytes")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _configurator(settings, available_gb=60.0, max_running_requests=None, max_total_tokens=None, tp=1):
    mc = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, head_dim=128, context_len=32768,
                         hidden_size=4096, get_num_kv_heads=lambda t: 8 // t)
    args = SimpleNamespace(_freekv=settings, tp_size=tp, max_prefill_tokens=16384, chunked_prefill_size=8192,
                           max_running_requests=max_running_requests, max_total_tokens=max_total_tokens,
                           mem_fraction_static=0.8)
    return _Configurator(server_args=args, model_config=mc, kv_cache_dtype=torch.bfloat16,
                         _profile_available_bytes=lambda pre: int(available_gb * 1e9))


def test_pool_is_sized_by_the_arena_and_the_gpu(plugins):
    """Admission counts host memory (tokens = what the arena holds); request slots are what the GPU has room for."""
    from freekv_patches.kv_pool_config import hook
    from freekv_sglang.server_args import host_page_capacity

    cfg = FreeKVConfig(page_size=32)
    settings = FreeKVServerSettings(config=cfg, kvstore_endpoint="ipc:///x", kvstore_arena_gb=36)
    shape = dict(num_layers=32, num_kv_heads=8, head_dim=128)
    assert host_page_capacity(settings, **shape, kv_dtype=torch.bfloat16) == 8583
    # FP8 host pages: 129 bytes per 128-wide row (e4m3 values and an int8 exponent) against 256
    fp8 = dataclasses.replace(settings, config=dataclasses.replace(cfg, host_dtype="fp8_e4m3"))
    assert host_page_capacity(fp8, **shape, kv_dtype=torch.bfloat16) == int(36e9) // (32 * 8 * 2 * 32 * 129)
    orig = lambda self, pre: "sglang's own"  # noqa: E731

    c = _configurator(settings)
    config = hook(orig, c, 0)
    plan = c.server_args._freekv_plan
    assert config.max_total_num_tokens == plan.tokens == 8583 * 32
    assert config.max_running_requests == plan.max_requests
    used = plan.dense_bytes + plan.staging_bytes + plan.engine_bytes
    assert used <= 60e9 < used + 0.5e9  # the GPU share is spent on request slots (~0.35 GB each here)
    small = hook(orig, _configurator(settings, max_running_requests=16, max_total_tokens=100_000), 0)
    assert small.max_running_requests == 16 and small.max_total_num_tokens == 100_000 // 32 * 32
    tp2 = hook(orig, _configurator(settings, tp=2), 0)  # each rank: half the arena, half the heads
    assert tp2.max_total_num_tokens == 8583 * 32
    with pytest.raises(FreeKVArgsError, match="--mem-fraction-static"):
        hook(orig, _configurator(settings, available_gb=2.0), 0)
    tiny = FreeKVServerSettings(config=cfg, kvstore_endpoint="ipc:///x", kvstore_arena_gb=0.001)
    with pytest.raises(FreeKVArgsError, match="--kvstore-arena-gb"):
        hook(orig, _configurator(tiny), 0)
    assert hook(orig, SimpleNamespace(server_args=OFF), 0) == "sglang's own"
    # --kv-early-weights fp8: the W_q copies (31 predicted layers of 4096 x 4096 bytes and an exponent a row, per TP
    # rank half the rows) come off the request slots' share
    early = dataclasses.replace(settings, config=dataclasses.replace(cfg, correct_at="previous_mlp_only",
                                                                   early_weights="fp8"))
    for tp in (1, 2):
        c = _configurator(early, tp=tp)
        fp8_config = hook(orig, c, 0)
        assert c.server_args._freekv_plan.early_bytes == 31 * 4096 // tp * 4097
    assert fp8_config.max_running_requests < tp2.max_running_requests


def test_pool_build_uses_freekv_pool(plugins):
    from freekv_patches.kv_pool_build import hook
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    built = {}

    def orig(self, *, max_total_num_tokens, mha_pool_class, quant_method=None):
        built["pool"] = mha_pool_class(max_total_num_tokens, page_size=16, dtype=torch.float32, head_num=2,
                                       head_dim=16, layer_num=3, device="cpu", enable_memory_saver=False,
                                       start_layer=0, end_layer=3, enable_alt_stream=False,
                                       enable_kv_cache_copy=False, post_capture_active=False)
        return built["pool"]

    settings = FreeKVServerSettings(config=FreeKVConfig(page_size=16, dense_layers=1), kvstore_endpoint="ipc:///x")
    conf = SimpleNamespace(server_args=SimpleNamespace(_freekv=settings, _freekv_plan=SimpleNamespace(staging_pages=5)))
    pool = hook(orig, conf, max_total_num_tokens=1024, mha_pool_class=MHATokenToKVPool)
    assert [tuple(b.shape) for b in pool.k_buffer] == [(1040, 2, 16), (96, 2, 16), (96, 2, 16)]
    assert sum(pool.get_kv_size_bytes()) == 2 * 4 * 2 * 16 * (1040 + 96 + 96)  # SGLang logs the real bytes
    with pytest.raises(RuntimeError, match="token pool"):
        hook(orig, SimpleNamespace(server_args=SimpleNamespace(_freekv=settings)), max_total_num_tokens=1024,
             mha_pool_class=MHATokenToKVPool)


class _FakeStream:
    def __init__(self, device=None, priority=0):
        self.device, self.priority = device, priority


@pytest.fixture
def process_server_args():
    """Publishes a ServerArgs stand-in as SGLang's scheduler does, restoring the slot after the test."""
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    saved = ctx._server_args
    yield ctx.set_server_args
    ctx._server_args = saved


def test_graph_capture_stream_outranks_the_speculative_lanes(plugins, process_server_args, monkeypatch):
    """On a FreeKV server SGLang's graphs are captured on a stream of CRITICAL_PRIORITY, which the select stream shares
    and the speculative streams do not: captured kernel nodes keep their stream's priority."""
    from freekv_patches.graph_capture_stream import hook
    from freekv_sglang import streams

    assert streams.CRITICAL_PRIORITY < 0  # lower is higher; the side streams' default is 0
    monkeypatch.setattr(streams.torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    process_server_args(ON)
    args, kwargs = hook()
    assert args == () and kwargs["stream"].priority == streams.CRITICAL_PRIORITY
    assert hook(stream="given") is None  # a caller's own stream is kept
    process_server_args(OFF)
    assert hook() is None
    process_server_args(ON)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hook() is None

    side = streams.Streams(torch.device("cuda", 0))
    assert side.select.priority == streams.CRITICAL_PRIORITY
    assert side.speculate.priority == side.recall.priority == 0


def test_graph_capture_is_patched_where_the_runners_call_it(plugins):
    """The registry's patch of parallel_state.graph_capture reaches the graph runners' own imported names."""
    import freekv_patches.graph_capture_stream as seam
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner, prefill_cuda_graph_runner

    for module in (parallel_state, decode_cuda_graph_runner, prefill_cuda_graph_runner):
        assert plugins._wraps_hook(module.graph_capture, seam.hook), module.__name__
