"""Every Python file of the repository compiles under the interpreter running the tests (CI's 3.11). The GPU host
runs 3.12, which accepts syntax 3.11 refuses (a backslash inside an f-string expression once broke decode.py's
import here); scripts that no test imports would otherwise only fail on the machine that runs them."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# .device and .gpu-model hold local, untracked device outputs and scratch copies (a base checkout for an A/B).
SKIP = {".venv", ".git", "scratch", ".gpu-wheels", ".whl", "build", "__pycache__", ".device", ".gpu-model"}
SOURCES = sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


def test_sources_found():
    assert len(SOURCES) > 50 and ROOT / "benchmarks/decode.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_compiles(path):
    compile(path.read_text(), str(path), "exec")
