"""Write a config-only model folder (real shapes, no weights) for `--load-format dummy` speed runs.

    python3 scripts/make_dummy_model.py llama-3.1-8b /tmp/llama8b
    python3 scripts/make_dummy_model.py qwen2.5-7b /tmp/qwen7b
    python3 scripts/make_dummy_model.py smollm2-135m /tmp/smollm2-dummy

A word-level tokenizer over the full vocabulary lets SGLang and bench_serving (random-ids) run offline; serve with
--tokenizer-path OUT/tokenizer (see below).
"""

from __future__ import annotations

import sys

SHAPES = {
    "llama-3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-7b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False),
    # SmolLM2-135M-Instruct's shapes: server fault and equality runs without bringing its weights over.
    "smollm2-135m": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: make_dummy_model.py {{{','.join(SHAPES)}}} OUT_DIR")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    shape, out = dict(SHAPES[sys.argv[1]]), sys.argv[2]
    cfg = AutoConfig.for_model(shape.pop("model_type"), bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                               **shape)
    cfg.save_pretrained(out)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=cfg.max_position_embeddings)
    fast.save_pretrained(out)
    # Beside a config.json, transformers picks the tokenizer class by model type (Qwen2's BPE tokenizer encodes
    # every word of this vocabulary to nothing); OUT/tokenizer has no config.json, so --tokenizer-path there
    # loads this word-level tokenizer for every shape.
    fast.save_pretrained(f"{out}/tokenizer")
    print(f"wrote {out}: {sys.argv[1]} shapes, dummy weights")


if __name__ == "__main__":
    main()
