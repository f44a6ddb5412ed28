#!/usr/bin/env bash
# The GPU check, run ON a CUDA machine from the repository root, offline:
#
#   bash scripts/gpu_check.sh [setup] [test] [bench]      # no stage named: all three
#
# setup  installs the wheels of gpu_wheels/ (made here by scripts/gpu_wheels.sh; carry the
#        folder to the device machine) into .gpu-site/ with --target and puts it and the source
#        tree on PYTHONPATH. Not a venv: the lent machine's python3 is itself a venv
#        (/opt/torch/.venv) whose packages (torch 2.11+cu130, transformers, ...) a nested
#        --system-site-packages venv would not see. torch is never installed or touched.
# test   pytest tests_gpu -v (exit status non-zero when a test fails); POLYRL_GPU_TESTS="EXPR"
#        passes -k EXPR, to split the suite over device calls (e.g. "not async", then "async").
# bench  python benchmarks/gpu_step.py (its JSON record goes into the report).
#
# The report is $OUT/gpu_report.md when $OUT is set (the device tool brings $OUT back), else
# outputs/gpu_report.md; logs and the benchmark record sit beside it. The whole check takes
# about 8-10 minutes on an H100; a device call is limited to 10, so there run it in two calls:
# `bash scripts/gpu_check.sh setup test` then `bash scripts/gpu_check.sh bench` (setup is
# repeated by each call; it takes seconds).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${POLYRL_GPU_WHEELS:-$ROOT/gpu_wheels}"
SITE="${POLYRL_GPU_SITE:-$ROOT/.gpu-site}"
REPORT_DIR="${OUT:-$ROOT/outputs}"
REPORT="$REPORT_DIR/gpu_report.md"
mkdir -p "$REPORT_DIR"
rc=0

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(setup test bench)
for s in "${stages[@]}"; do
    case "$s" in setup | test | bench) ;; *)
        echo "gpu_check.sh: unknown stage '$s' (expected setup, test or bench)" >&2
        exit 2
        ;;
    esac
done

say() { printf '%s\n' "$*" | tee -a "$REPORT"; }
fence() { say '```'; }

: >"$REPORT"
say "# polyrl GPU check"
say ""
say "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
say "- stages: ${stages[*]}"
say "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo 'nvidia-smi not found')"
say ""

# Every stage needs the wheels and the source tree on the path; always (re)do it: seconds.
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    # --no-deps: the folder lists every dependency the machine lacks (scripts/gpu_requirements.txt);
    # the import check below catches anything still missing.
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl >"$REPORT_DIR/gpu_setup.log" 2>&1; then
        say "setup: pip install of $WHEELS failed:"
        fence; tail -20 "$REPORT_DIR/gpu_setup.log" | tee -a "$REPORT"; fence
        exit 1
    fi
else
    say "setup: no wheels in $WHEELS (run scripts/gpu_wheels.sh where pip reaches PyPI, carry the folder); using what is installed"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

say "## Versions"
fence
"$PY" - 2>&1 <<'EOF' | tee -a "$REPORT"
import importlib, sys
import torch
print(f"python {sys.version.split()[0]} ({sys.executable})")
print(f"torch {torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()}"
      + (f" device={torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
for name in ("transformers", "tokenizers", "safetensors", "numpy", "httpx", "fastapi", "uvicorn",
             "pydantic", "tensordict", "pyarrow", "matplotlib", "math_verify", "pytest"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # report, do not stop: the import check below decides
        print(f"{name} MISSING ({type(exc).__name__}: {exc})")
EOF
fence
# The modules the GPU tests and the benchmark load (none of them may need Ray).
if ! "$PY" -c "import polyrl.rollout.server, polyrl.trainer.rl, polyrl.demo, polyrl.controller.local_backend, polyrl.weights, polyrl.model_engine" \
    >"$REPORT_DIR/gpu_import.log" 2>&1; then
    say "setup: polyrl does not import:"
    fence; tail -20 "$REPORT_DIR/gpu_import.log" | tee -a "$REPORT"; fence
    exit 1
fi
say "setup: ok (PYTHONPATH=$PYTHONPATH)"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # Every GPU test would be skipped and the benchmark refuse: that is no pass.
    say "CUDA is not available here: the check needs a CUDA GPU (the stages run anyway)"
    rc=1
fi
say ""

for s in "${stages[@]}"; do
    case "$s" in
    test)
        say "## tests_gpu"
        select=()
        if [ -n "${POLYRL_GPU_TESTS:-}" ]; then
            select=(-k "$POLYRL_GPU_TESTS")
            say "selected: -k '$POLYRL_GPU_TESTS'"
        fi
        "$PY" -m pytest tests_gpu -v -rs -p no:cacheprovider "${select[@]}" \
            --junitxml="$REPORT_DIR/gpu_tests.xml" >"$REPORT_DIR/gpu_tests.log" 2>&1
        trc=$?
        fence
        # The per-test lines and the closing summary line.
        grep -E '(PASSED|FAILED|ERROR|SKIPPED)( |$)|^=+ .* in [0-9.]+s' "$REPORT_DIR/gpu_tests.log" \
            | tee -a "$REPORT"
        fence
        say "pytest exit status: $trc (full log: gpu_tests.log)"
        if [ "$trc" -eq 5 ]; then say "pytest collected no tests"; fi
        [ "$trc" -ne 0 ] && rc=1
        say ""
        ;;
    bench)
        say "## benchmarks/gpu_step.py"
        "$PY" benchmarks/gpu_step.py >"$REPORT_DIR/gpu_step.log" 2>&1
        brc=$?
        if [ "$brc" -eq 0 ]; then
            tail -1 "$REPORT_DIR/gpu_step.log" >"$REPORT_DIR/gpu_step.json"
            fence; cat "$REPORT_DIR/gpu_step.json" | tee -a "$REPORT"; fence
            say "(record also appended to benchmarks/history/gpu_step.jsonl on this machine)"
        else
            say "gpu_step.py failed with status $brc:"
            fence; tail -30 "$REPORT_DIR/gpu_step.log" | tee -a "$REPORT"; fence
            rc=1
        fi
        say ""
        ;;
    esac
done
say "gpu_check: exit status $rc"
exit "$rc"
