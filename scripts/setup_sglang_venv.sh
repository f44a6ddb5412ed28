#!/usr/bin/env bash
# Create .venv-sglang: a separate virtual environment holding SGLang for the optional `sglang`
# rollout backend. It cannot share polyrl's .venv: SGLang pins its own torch (a CUDA build)
# and transformers.
#
# SGLang from PyPI runs on NVIDIA GPUs only: its kernels (sglang-kernel) ship CUDA code and no
# CPU build, and SGLang's Intel-Xeon CPU path needs sgl-kernel built from SGLang's sources, which
# this script does not do. On a machine without a CUDA GPU the install may succeed but the
# server cannot start; the backend's CPU tests (tests/test_rollout_sglang.py) do not need it.
#
# Usage: scripts/setup_sglang_venv.sh [VENV_DIR]   (default: .venv-sglang in the repository root)
# Env:   PYTHON (default python3.11), SGLANG_SPEC (default sglang)
#
# Idempotent: does nothing when VENV_DIR/bin/python exists and `import sglang` works there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang}"

sglang_ok() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sglang' >/dev/null 2>&1
}

version() {
    "$VENV/bin/python" -c 'import sglang; print(sglang.__version__)' 2>/dev/null
}

if sglang_ok; then
    echo "setup_sglang_venv: $VENV already has a working sglang ($(version)); nothing to do"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >/dev/null
# SGLang pins the torch it was built against (a CUDA wheel, several GB with its NVIDIA libraries).
"${PIP[@]}" install "$SGLANG_SPEC"

if ! sglang_ok; then
    echo "setup_sglang_venv: 'import sglang' still fails in $VENV:" >&2
    "$VENV/bin/python" -c 'import sglang' >&2 || true
    exit 1
fi
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null
then
    echo "setup_sglang_venv: note: torch in $VENV sees no CUDA GPU; SGLang's server will not" \
        "start on this machine" >&2
fi
echo "setup_sglang_venv: ready: $VENV ($(version))"
