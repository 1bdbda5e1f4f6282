"""Lets PyPI's torchvision import next to a CPU-only torch (installed by scripts/test.sh as
site-packages/_freekv_torchvision_cpu.py, activated by _freekv_torchvision_cpu.pth).

PyPI has only CUDA builds of torchvision; next to torch 2.13.0+cpu its C extension cannot load
(it links libtorch_cuda), and torchvision 0.28 then fails at import with "operator torchvision::nms
does not exist" because its meta registrations assume the extension defined that op. SGLang imports
torchvision.io unconditionally, and transformers imports torchvision whenever it is installed, so
without this shim neither imports. On the first `import torchvision` this shim tries to load the
extension itself; only when that fails does it define the schemas of the two ops torchvision
registers unconditionally (nms, qnms), so the import goes through. Nothing here gives them a kernel:
calling torchvision.ops.nms still fails, loudly. Costs nothing until torchvision is imported.
"""

import importlib.util
import os
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBS = []  # keeps the torch.library.Library fragment alive


def _prepare_torchvision():
    try:
        import torch
    except Exception:  # no torch: torchvision will fail on its own terms
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for folder in spec.submodule_search_locations:
        for name in os.listdir(folder):
            if name.startswith("_C.") and name.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(folder, name))
                    return  # the real extension loaded: it defines the ops itself
                except OSError:
                    pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op, schema in _SCHEMAS.items():
        try:
            getattr(torch.ops.torchvision, op)
        except (AttributeError, RuntimeError):
            lib.define(schema)
    _LIBS.append(lib)


class _TorchvisionFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname == "torchvision":
            try:
                sys.meta_path.remove(_TorchvisionFinder)
            except ValueError:
                pass
            _prepare_torchvision()
        return None  # the regular finders import torchvision itself


if _TorchvisionFinder not in sys.meta_path:
    sys.meta_path.insert(0, _TorchvisionFinder)
