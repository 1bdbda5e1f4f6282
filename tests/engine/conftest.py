import pytest
import torch


@pytest.fixture
def prefill_alike():
    """prefill_alike(engines, lens, dtype, device) -> slots: one prompt per length, the same random K/V (and last
    query) in every engine, each layer prefilled in turn; slot ids come from the last engine."""

    def prefill(engines, lens, dtype=torch.float32, device="cpu"):
        shape = engines[0].shape
        slots = []
        for n in lens:
            data = [(torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype),
                     torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype),
                     torch.randn(shape.num_q_heads, shape.head_dim, device=device, dtype=dtype))
                    for _ in range(shape.num_layers)]
            for e in engines:
                s = e.add_request()
                e.begin_prefill(s, n)
                for layer in range(shape.num_layers):
                    e.prefill_layer(s, layer, *data[layer])
            slots.append(s)
        return slots

    return prefill
