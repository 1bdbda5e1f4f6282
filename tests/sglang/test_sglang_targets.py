"""Every SGLang 0.5.16 symbol a FreeKV hook targets exists, has the parameters the hook was written for, and the
hook accepts the calls SGLang makes. The table is freekv_patches.SEAMS (one module per seam)."""

import importlib.metadata
import inspect
import pkgutil

import pytest

import freekv_patches
from freekv_patches import SEAMS, SGLANG_VERSION

IDS = [seam.target.rsplit(".", 2)[-2] + "." + seam.target.rsplit(".", 1)[-1] for seam in SEAMS]


def test_sglang_version():
    assert importlib.metadata.version("sglang") == SGLANG_VERSION


def _original(target):
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    kind = type(raw).__name__ if isinstance(raw, (classmethod, staticmethod)) else "function"
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return owner, kind, inspect.unwrap(fn)  # through HookRegistry's wrappers (linked by __wrapped__)


@pytest.mark.parametrize("seam", SEAMS, ids=IDS)
def test_target_exists_with_expected_signature(seam):
    owner, kind, fn = _original(seam.target)
    assert callable(fn), seam.target
    params = tuple(inspect.signature(fn).parameters)
    assert params == seam.params, f"{seam.target}: sglang has {params}, {seam.module} expects {seam.params}"
    if params and params[0] == "cls":
        assert kind == "classmethod", seam.target
    if isinstance(owner, type) and kind == "function":
        assert params[0] == "self" or seam.target.endswith("add_cli_args"), seam.target
    assert seam.hook_type in ("BEFORE", "AFTER", "AROUND")


@pytest.mark.parametrize("seam", SEAMS, ids=IDS)
def test_hook_accepts_the_targets_calls(seam):
    owner, kind, fn = _original(seam.target)
    sig = inspect.signature(fn)
    prefix = {"BEFORE": [], "AFTER": ["result"], "AROUND": ["orig"]}[seam.hook_type]
    plain = [p for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    hook_sig = inspect.signature(seam.hook)
    # positional call with every parameter
    hook_sig.bind(*prefix, *[p.name for p in plain])
    # keyword call (self/cls stay positional, as Python passes them)
    lead = [p.name for p in plain if p.name in ("self", "cls")]
    hook_sig.bind(*prefix, *lead, **{p.name: p.name for p in plain if p.name not in ("self", "cls")})


@pytest.mark.parametrize("seam", SEAMS, ids=IDS)
def test_seam_module_documents_target(seam):
    doc = " ".join(inspect.getmodule(seam.hook).__doc__.split())
    assert seam.target in doc.replace("_ ", "_")  # long names may wrap after an underscore
    assert "written against sglang 0.5.16" in doc.lower()


def test_applied_hooks_are_ours(plugins):
    for seam in SEAMS:
        assert freekv_patches._wraps_hook(freekv_patches.resolve_target(seam.target), seam.hook), seam.target


def test_decode_capture_calls_the_tail_hooks():
    """The FreeKV backend joins its side streams in a ModelRunner.capture_tail_hooks entry: SGLang 0.5.16 creates the
    list in ModelRunner.__init__ and calls each entry with (graph runner, output, forward batch, tokens) after the
    captured decode forward."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    assert "self.capture_tail_hooks = []" in inspect.getsource(ModelRunner.__init__)
    assert ("for capture_hook in self.model_runner.capture_tail_hooks:\n"
            in inspect.getsource(DecodeCudaGraphRunner.capture_one_shape))
    assert "capture_hook(self, out, forward_batch, num_tokens)" in inspect.getsource(DecodeCudaGraphRunner.capture_one_shape)
