"""tests/sglang: the FreeKV plugin against the installed sglang 0.5.16, on CPU.

scripts/test.sh installs sglang with --no-deps plus scripts/sglang-cpu-requirements.txt. Without sglang these tests
skip, except under CI (CI=true), where a missing sglang is an install bug and fails the run.
"""

import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("CI"):
        raise RuntimeError("sglang is not installed; scripts/test.sh installs it (scripts/sglang-cpu-requirements.txt)")
    collect_ignore_glob = ["test_*.py"]

CLEAN_ENV = ("SGLANG_KV_RETRIEVAL", "FREEKV_ARGS", "FREEKV_KVSTORE_ENDPOINT", "SGLANG_PLUGINS")


@pytest.fixture(scope="session")
def plugins():
    """SGLang's load_plugins() in this process (what launch_server and every scheduler do first)."""
    for name in CLEAN_ENV:
        os.environ.pop(name, None)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import freekv_patches

    return freekv_patches


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in CLEAN_ENV:
        monkeypatch.setenv(name, "x")  # records the original state, so teardown restores it
        monkeypatch.delenv(name)
    yield
