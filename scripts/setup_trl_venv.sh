#!/usr/bin/env bash
# Create .venv-trl: a separate virtual environment holding Hugging Face TRL, the baseline of
# benchmarks/rl_step.py (TRL's GRPOTrainer). It is kept apart from polyrl's .venv so that TRL's
# own pins (transformers, accelerate, datasets) never change what polyrl is tested against.
# vLLM is deliberately not installed: the benchmark compares CPU steps without it.
#
# Usage: scripts/setup_trl_venv.sh [VENV_DIR]   (default: .venv-trl in the repository root)
# Env:   PYTHON (default python3.11), TORCH_SPEC (default torch==2.13.0),
#        TRL_SPEC (default trl==1.13.0), TRANSFORMERS_SPEC (default transformers==5.23.0)
#
# transformers is pinned to the version polyrl's .venv resolves to, so both sides of the benchmark
# run the same modeling code.
#
# Idempotent: does nothing when VENV_DIR/.polyrl-trl-installed exists and `import trl` works.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-trl}"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TRL_SPEC="${TRL_SPEC:-trl==1.13.0}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC:-transformers==5.23.0}"
STAMP="$VENV/.polyrl-trl-installed"

trl_ok() {
    "$VENV/bin/python" -c 'import trl, trl.trainer.grpo_trainer' >/dev/null 2>&1
}

versions() {
    "$VENV/bin/python" -c 'import torch, transformers, trl
print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")'
}

if [ -f "$STAMP" ] && trl_ok; then
    echo "setup_trl_venv: $VENV is ready ($(versions)); nothing to do"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >/dev/null
# torch first and pinned: any looser spec would pull the multi-GB CUDA build. TRL's own torch
# requirement is then already met, and the torch pin below keeps pip from replacing it.
"${PIP[@]}" install "$TORCH_SPEC"
# requests: trl's GRPOTrainer module imports its vLLM client (which needs requests) even when vLLM
# is not used, and trl does not declare it.
"${PIP[@]}" install "$TORCH_SPEC" "$TRL_SPEC" "$TRANSFORMERS_SPEC" requests

torch_version="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
want="${TORCH_SPEC#torch==}"
case "$torch_version" in
    "$want" | "$want+cpu") ;;
    *)
        echo "setup_trl_venv: torch in $VENV is $torch_version, expected $want(+cpu)" >&2
        exit 1
        ;;
esac
if ! trl_ok; then
    echo "setup_trl_venv: 'import trl.trainer.grpo_trainer' fails in $VENV:" >&2
    "$VENV/bin/python" -c 'import trl.trainer.grpo_trainer' >&2 || true
    exit 1
fi
touch "$STAMP"
echo "setup_trl_venv: ready: $VENV ($(versions))"
