"""SGLang's own serving benchmark (`python -m sglang.benchmark.serving`), run offline.

    python3 benchmarks/bench_shared_prefix.py --backend sglang --port 30003 --dataset-name generated-shared-prefix \
        --tokenizer /tmp/llama8b/tokenizer --gsp-num-groups 4 --gsp-prompts-per-group 16 ...

Every argument goes to SGLang's CLI unchanged. The one difference: SGLang 0.5.16's benchmark imports all its dataset
modules at start-up, and its MMMU module imports the `datasets` package, which the offline GPU wheelhouse lacks (it
pulls pyarrow and pandas). The generated datasets (random, generated-shared-prefix) never use it, so a stand-in
module is put in its place whose `load_dataset` refuses with that reason: a dataset that does need it fails loudly.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def _offline_datasets() -> None:
    if importlib.util.find_spec("datasets") is not None:
        return

    def load_dataset(*args, **kwargs):
        raise RuntimeError("bench_shared_prefix.py: this dataset needs the `datasets` package, which is not "
                           "installed here; use a generated dataset (random, generated-shared-prefix)")

    stand_in = types.ModuleType("datasets")
    stand_in.load_dataset = load_dataset
    sys.modules["datasets"] = stand_in


if __name__ == "__main__":
    _offline_datasets()
    from sglang.benchmark.serving import cli_main

    cli_main()
