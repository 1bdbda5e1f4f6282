import pytest
import torch

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample


@pytest.fixture
def prefill_alike():
    """prefill_alike(engines, lens, dtype, device) -> slots: one prompt per length, the same random K/V (and last
    query) in every engine, each layer prefilled in turn; slot ids come from the last engine. An engine that waits for
    a calibration (the default channel sketch) is first calibrated from the same Gaussian queries and keys."""

    def prefill(engines, lens, dtype=torch.float32, device="cpu"):
        shape = engines[0].shape
        for e in engines:
            calibrate_synthetic(e, gaussian_sample(e))
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


@pytest.fixture
def decode_alike():
    """decode_alike(engines, slots, steps, device) -> stats: `steps` decode steps of the slots plus one padding row,
    the same random queries and K/V in every engine; each step every engine's outputs (real rows) and slot tables
    must equal the first engine's, then its statistics (mean cosines within 1e-6). Returns the first engine's
    statistics, mean cosines left out."""

    def decode(engines, slots, steps, device="cpu"):
        shape, n = engines[0].shape, len(slots)
        L, Hq, H, D = shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        for _ in range(steps):
            q = torch.randn(L, n + 1, Hq, D, device=device)
            kv = torch.randn(2, L, n + 1, H, D, device=device)
            outs = []
            for e in engines:
                plan = e.begin_step(slots, pad_to=n + 1)
                outs.append([e.attend(plan, layer, q[layer], kv[0, layer], kv[1, layer]) for layer in range(L)])
                e.end_step()
            for out, e in zip(outs[1:], engines[1:]):
                for layer in range(L):
                    torch.testing.assert_close(out[layer][:n], outs[0][layer][:n], atol=1e-4, rtol=1e-4)
                assert torch.equal(engines[0].slot_table[:, slots], e.slot_table[:, slots])
        st = [e.stats() for e in engines]
        cos = [x.pop("mean_cosine") for x in st]
        for other, c in zip(st[1:], cos[1:]):
            assert other == st[0]
            assert c.keys() == cos[0].keys() and all(abs(c[k] - cos[0][k]) < 1e-6 for k in c)
        return st[0]

    return decode
