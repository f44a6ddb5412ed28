#!/usr/bin/env bash
# Create .venv-megatron: polyrl with the optional `megatron` extra (megatron-core) for the
# Megatron-Core engine backend and its tests (tests_megatron/, `make test-megatron`). A separate
# venv keeps megatron-core out of the main .venv, so `make test` proves the core does not need it.
#
# Usage: scripts/setup_megatron_venv.sh [VENV_DIR]   (default: .venv-megatron in the repository root)
# Env:   PYTHON (default python3.11), TORCH_SPEC (default torch==2.13.0)
#
# Idempotent: does nothing when VENV_DIR already imports megatron.core and polyrl.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-megatron}"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

megatron_ok() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import megatron.core, polyrl, pytest' \
        >/dev/null 2>&1
}

if megatron_ok; then
    echo "setup_megatron_venv: $VENV already has megatron-core ($("$VENV/bin/python" -c \
        'import megatron.core; print(megatron.core.__version__)' 2>/dev/null)); nothing to do"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >/dev/null
# torch first and pinned: megatron-core asks for torch>=2.6, which pip would otherwise satisfy
# with the multi-GB CUDA build.
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install -e "$ROOT[test,megatron]"

if ! megatron_ok; then
    echo "setup_megatron_venv: 'import megatron.core, polyrl' still fails in $VENV:" >&2
    "$VENV/bin/python" -c 'import megatron.core, polyrl' >&2 || true
    exit 1
fi
echo "setup_megatron_venv: ready: $VENV (megatron-core" \
    "$("$VENV/bin/python" -c 'import megatron.core; print(megatron.core.__version__)'))"
