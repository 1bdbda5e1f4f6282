"""--kv-correct-at previous_mlp in a served model: freekv_patches wraps decoder layers that follow SGLang's call
(layer(positions, hidden_states, forward_batch, residual), fused add-and-norm) so each sparse layer's query is
predicted from the previous layer's mid residual in decode forwards. Stand-in layers with Llama's attributes, CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freekv_patches.model_runner_post_pool import _install_early
from freekv_sglang.server_args import FreeKVArgsError

HIDDEN, HQ, HKV, D = 48, 6, 2, 8


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)

    def forward(self, x, residual=None):
        if residual is not None:
            x = residual = x + residual
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return y if residual is None else (y, residual)


def rope(positions, q, k):
    """A stand-in rotation that depends on the position (enough to catch a wrong one)."""
    ang = positions[:, None].float() * 0.1
    return q * torch.cos(ang) + q.roll(1, -1) * torch.sin(ang), k


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_size, self.kv_size = HQ * D, HKV * D
        self.qkv_proj = torch.nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size)
        self.o_proj = torch.nn.Linear(self.q_size, HIDDEN)
        self.rotary_emb = rope
        self.seen: list[torch.Tensor] = []  # the rotated queries of the forwards run

    def forward(self, positions, h):
        q = rope(positions, self.qkv_proj(h)[:, :self.q_size], None)[0]
        self.seen.append(q)
        return self.o_proj(q)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
        self.self_attn = Attention()
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)
        torch.nn.init.zeros_(self.mlp.weight)  # the next layer's input is then this layer's mid residual
        torch.nn.init.zeros_(self.mlp.bias)

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual, h = hidden_states, self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, h)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class UnfusedLayer(Layer):
    """A layer that adds its residual itself: its post-attention norm gets no residual to return."""

    def forward(self, positions, hidden_states, forward_batch, residual):
        h = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states))
        return h + self.mlp(self.post_attention_layernorm(h)), None


def runner_of(layers):
    return SimpleNamespace(model=SimpleNamespace(model=SimpleNamespace(layers=layers)))


def run(layers, decode: bool, tokens: int = 5):
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: decode))
    positions = torch.arange(100, 100 + tokens)
    h, residual = torch.randn(tokens, HIDDEN), None
    for layer in layers:
        h, residual = layer(positions, h, fb, residual)


def test_decode_forwards_predict_each_sparse_layers_query():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer() for _ in range(4))
    runner = runner_of(layers)
    with torch.no_grad():
        _install_early(runner, dense_layers=1, correct_at="previous_mlp")
        calls = []
        # Only the mid residual is an input, which the engine copies: the positions are read in place.
        runner._freekv_early.target = lambda layer, predict, inputs: calls.append((layer, predict(*inputs),
                                                                                  len(inputs)))
        run(layers, decode=False)
        assert calls == []  # extend forwards pass through
        run(layers, decode=True)
    assert [j for j, _, _ in calls] == [1, 2, 3] and all(n == 1 for _, _, n in calls)
    calls = [(j, q) for j, q, _ in calls]
    for j, q in calls:  # the MLPs are zero: the prediction is the layer's real query, norm, bias and rotation in
        torch.testing.assert_close(q, layers[j].self_attn.seen[-1])


def test_fp8_weights_predict_within_e4m3s_rounding():
    """--kv-early-weights fp8: the prediction through an e4m3 copy of each W_q (here its torch reference, on the CPU)
    stays within e4m3's rounding of the real query."""
    torch.manual_seed(1)
    layers = torch.nn.ModuleList(Layer() for _ in range(3))
    runner = runner_of(layers)
    with torch.no_grad():
        _install_early(runner, dense_layers=1, correct_at="previous_mlp_only", weights="fp8")
        calls = []
        runner._freekv_early.target = lambda layer, predict, inputs: calls.append((layer, predict(*inputs)))
        run(layers, decode=True)
    assert [j for j, _ in calls] == [1, 2]
    for j, q in calls:
        real = layers[j].self_attn.seen[-1]
        assert not torch.equal(q, real)  # a copy, not the model's W_q
        assert (q - real).norm() <= 0.05 * real.norm()


def test_fp8_weights_follow_a_weight_update():
    """SGLang updates weights in place inside SchedulerWeightUpdaterManager._observe_weight_load; the seam around it
    marks the e4m3 copies stale on leaving (also when the update raised), and EarlyQuery.refresh_weights (which the
    backend's next decode calls) re-derives them, so the prediction follows the new W_q. Without copies the seam
    hands SGLang's context manager back untouched."""
    import contextlib

    from freekv_patches import weight_update_refresh as seam

    torch.manual_seed(2)
    layers = torch.nn.ModuleList(Layer() for _ in range(3))
    runner = runner_of(layers)
    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))
    entered = []

    @contextlib.contextmanager
    def observe(self, source):
        entered.append(source)
        yield

    def predictions():
        calls = []
        runner._freekv_early.target = lambda layer, predict, inputs: calls.append((layer, predict(*inputs)))
        run(layers, decode=True)
        assert [j for j, _ in calls] == [1, 2]
        return [(q, layers[j].self_attn.seen[-1]) for j, q in calls]

    def update():
        for layer in layers:
            layer.self_attn.qkv_proj.weight.mul_(-1.5)  # in place, as SGLang's weight loaders copy

    with torch.no_grad():
        _install_early(runner, dense_layers=1, correct_at="previous_mlp_only", weights="fp8")
        early = runner._freekv_early
        with seam.hook(observe, manager, "tensor"):
            update()
        assert early.weights_stale
        stale = predictions()
        assert all((q - real).norm() > 0.5 * real.norm() for q, real in stale)  # the copies still hold the old W_q
        early.weights_stale = False
        with pytest.raises(RuntimeError, match="rolled back"), seam.hook(observe, manager, "disk"):
            update()  # a failed update's weights (SGLang reloads the old ones): refreshed from what the model has
            raise RuntimeError("rolled back")
        assert entered == ["tensor", "disk"] and early.weights_stale
        assert early.refresh_weights() == 2 and not early.weights_stale
        for q, real in predictions():
            assert (q - real).norm() <= 0.05 * real.norm()
    bare = observe(None, "ipc")
    early.fp8_weights = []  # --kv-early-weights model
    assert seam.hook(lambda self, source: bare, manager, "ipc") is bare
    assert seam.hook(lambda self, source: bare, SimpleNamespace(), "ipc") is bare  # FreeKV off


def test_fp8_weights_off_the_models_device_are_refused():
    runner = runner_of(torch.nn.ModuleList(Layer() for _ in range(3)))
    runner.device = "meta"  # the model's device, where the stand-in's weights (CPU) do not lie
    with pytest.raises(FreeKVArgsError, match="offloaded") as e:
        _install_early(runner, dense_layers=1, correct_at="previous_mlp_only", weights="fp8")
    assert "--kv-early-weights" in str(e.value)


def test_the_dense_layers_are_not_predicted():
    layers = torch.nn.ModuleList(Layer() for _ in range(4))
    runner = runner_of(layers)
    _install_early(runner, dense_layers=2, correct_at="previous_mlp")
    calls = []
    runner._freekv_early.target = lambda layer, predict, inputs: calls.append(layer)
    with torch.no_grad():
        run(layers, decode=True)
    assert calls == [2, 3]


@pytest.mark.parametrize("spoil, match", [
    (lambda layer: setattr(layer.self_attn, "q_norm", Norm()), "QK"),
    (lambda layer: delattr(layer.self_attn, "rotary_emb"), "rotary_emb"),
    (lambda layer: setattr(layer.self_attn.qkv_proj, "weight",
                           torch.nn.Parameter(torch.zeros(64, HIDDEN, dtype=torch.int8), requires_grad=False)),
     "quantized"),
])
def test_layers_it_cannot_predict_are_refused(spoil, match):
    layers = torch.nn.ModuleList(Layer() for _ in range(3))
    spoil(layers[2])
    with pytest.raises(FreeKVArgsError, match=match) as e:
        _install_early(runner_of(layers), dense_layers=1, correct_at="previous_mlp")
    assert "--kv-correct-at" in str(e.value)


def test_layers_whose_norm_adds_no_residual_are_refused():
    layers = torch.nn.ModuleList([Layer(), UnfusedLayer(), Layer()])
    with pytest.raises(FreeKVArgsError, match="decoder layer 1 .* fused add-and-norm") as e:
        _install_early(runner_of(layers), dense_layers=1, correct_at="previous_mlp")
    assert "--kv-correct-at" in str(e.value)


class UnfusedInputLayer(Layer):
    """A layer whose post-attention norm adds the residual, while its input norm does not (it adds it itself)."""

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is not None:
            hidden_states = hidden_states + residual
        residual, h = hidden_states, self.input_layernorm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return self.mlp(hidden_states), residual


def test_layers_whose_input_norm_adds_no_residual_are_refused():
    """The mid residual is released before the next layer's fused input add-and-norm overwrites it: a layer to
    predict that does not call its input norm so gives no such point."""
    layers = torch.nn.ModuleList([Layer(), UnfusedInputLayer(), Layer()])
    with pytest.raises(FreeKVArgsError, match="decoder layer 1 .* input norm") as e:
        _install_early(runner_of(layers), dense_layers=1, correct_at="previous_mlp")
    assert "--kv-correct-at" in str(e.value)


def test_the_mid_residual_is_released_before_the_next_input_norm():
    """In a decode forward, layer j's prediction (from layer j - 1's mid residual) comes first, then its release
    right before layer j's input norm, which overwrites that residual in a fused add-and-norm; the prediction's own
    norm does not release it. Extend forwards do neither."""
    layers = torch.nn.ModuleList(Layer() for _ in range(4))
    events = []
    for j in range(1, 4):  # the input norms, as the wrappers find them
        norm = layers[j].input_layernorm.forward
        layers[j].input_layernorm.forward = lambda *a, j=j, norm=norm: (events.append(("norm", j)), norm(*a))[1]
    runner = runner_of(layers)
    _install_early(runner, dense_layers=1, correct_at="previous_mlp")
    state = runner._freekv_early
    state.target = lambda layer, predict, inputs: (events.append(("predict", layer)), predict(*inputs))
    state.release = lambda layer: events.append(("release", layer))
    with torch.no_grad():
        run(layers, decode=False)
        assert events == [("norm", 1), ("norm", 2), ("norm", 3)]
        events.clear()
        run(layers, decode=True)
    # Each prediction runs the input norm once itself (on the mid residual), without a release.
    assert events == [e for j in (1, 2, 3) for e in (("predict", j), ("norm", j), ("release", j), ("norm", j))]


def test_a_norm_without_the_residual_pair_is_an_error():
    """A post-attention norm that returns one tensor (no fused residual) leaves no mid residual to predict from."""
    layers = torch.nn.ModuleList(Layer() for _ in range(3))
    layers[0].post_attention_layernorm.forward = lambda h, residual=None: h
    runner = runner_of(layers)
    _install_early(runner, dense_layers=1, correct_at="previous_mlp")
    state = runner._freekv_early
    state.target, state.positions = (lambda layer, predict, inputs: None), torch.arange(2)  # inside a decode forward
    with pytest.raises(RuntimeError, match="fused add-and-norm"):
        layers[0].post_attention_layernorm(torch.randn(2, HIDDEN), torch.randn(2, HIDDEN))


@pytest.mark.parametrize("module, prefix", [("sglang.srt.models.llama", "Llama"), ("sglang.srt.models.qwen2", "Qwen2")])
def test_sglangs_llama_and_qwen2_layers_hold_what_the_prediction_reads(module, prefix):
    """The attributes _install_early reads, and the decoder-layer call and fused norm the wrappers assume, as SGLang
    0.5.16's Llama and Qwen2 define them."""
    import importlib
    import inspect

    mod = importlib.import_module(module)
    attn = inspect.getsource(getattr(mod, f"{prefix}Attention").__init__)
    for name in ("self.qkv_proj", "self.q_size", "self.kv_size", "self.rotary_emb"):
        assert name in attn, name
    layer = getattr(mod, f"{prefix}DecoderLayer")
    for name in ("self.input_layernorm", "self.post_attention_layernorm"):
        assert name in inspect.getsource(layer.__init__), name
    assert list(inspect.signature(layer.forward).parameters)[:5] == ["self", "positions", "hidden_states",
                                                                    "forward_batch", "residual"]
    for call in ("self.post_attention_layernorm(hidden_states, residual)",
                 "self.input_layernorm(hidden_states, residual)"):
        assert call in inspect.getsource(layer.forward), call
