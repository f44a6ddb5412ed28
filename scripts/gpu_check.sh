#!/usr/bin/env bash
# The GPU check, run ON a CUDA machine from the repository root, offline, in calls that each
# fit one 10-minute device command:
#
#   bash scripts/gpu_check.sh fast bench    # call 1: every GPU test but the GRPO runs, then
#                                           #         benchmarks/gpu_step.py        (~5 min)
#   bash scripts/gpu_check.sh grpo          # call 2: the two GRPO runs (hybrid, async); they
#                                           #         share one SFT warm-up          (~8 min)
#
# No part named: `fast` (and the report says what to run next). Parts:
# fast   pytest tests_gpu, all but the GRPO runs (FSDP2, native engine fp32 and bf16, CUDA
#        IPC, vLLM and SGLang -- reported "not run" where they are not installed).
# grpo   pytest tests_gpu/test_grpo_cuda.py; the SFT warm-up of the first run is kept in
#        outputs/gpu_check/demo_sft for the second (and for a later call on the same machine).
# bench  python benchmarks/gpu_step.py (its JSON record goes into the report).
#
# Every call installs the wheels of gpu_wheels/ (made here by scripts/gpu_wheels.sh; carry the
# folder) into .gpu-site/ with --target and puts it and the source tree on PYTHONPATH (not a
# venv: the lent machine's python3 is itself a venv whose torch 2.11+cu130 and transformers a
# nested venv would not see; torch is never installed or touched). Seconds.
#
# Time: the whole call stays inside POLYRL_GPU_CALL_S (default 540 s): each pytest runs under
# `timeout` with what is left less 40 s for the report, each test under pytest-timeout's
# POLYRL_GPU_TEST_S (default 300 s) where pytest-timeout is installed, and every test's outcome
# is written to the report as it finishes, so a call cut short still says what ran. A skipped
# test is reported "NOT RUN", never as passed.
#
# POLYRL_GPU_DRY_RUN=1 runs every step that needs no GPU (set-up, versions, imports, collecting
# the selected tests) and writes the same report: check the script here before a device call.
#
# The report is $OUT/gpu_report.md when $OUT is set (the device tool brings $OUT back), else
# outputs/gpu_report.md; logs and the benchmark record sit beside it.
set -uo pipefail

START=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${POLYRL_GPU_WHEELS:-$ROOT/gpu_wheels}"
SITE="${POLYRL_GPU_SITE:-$ROOT/.gpu-site}"
REPORT_DIR="${OUT:-$ROOT/outputs}"
REPORT="$REPORT_DIR/gpu_report.md"
CALL_S="${POLYRL_GPU_CALL_S:-540}"
TEST_S="${POLYRL_GPU_TEST_S:-300}"
DRY="${POLYRL_GPU_DRY_RUN:-0}"
mkdir -p "$REPORT_DIR"
rc=0

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(fast)
for p in "${parts[@]}"; do
    case "$p" in fast | grpo | bench) ;; *)
        echo "gpu_check.sh: unknown part '$p' (expected fast, grpo or bench)" >&2
        exit 2
        ;;
    esac
done

say() { printf '%s\n' "$*" | tee -a "$REPORT"; }
fence() { say '```'; }
left() { echo $((CALL_S - ($(date +%s) - START))); }

: >"$REPORT"
say "# polyrl GPU check"
say ""
say "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
say "- parts: ${parts[*]}$([ "$DRY" = 1 ] && echo ' (dry run: nothing that needs a GPU runs)')"
say "- call budget: ${CALL_S}s, per test: ${TEST_S}s"
say "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo 'nvidia-smi not found')"
say ""

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
             "pydantic", "tensordict", "pyarrow", "matplotlib", "math_verify", "pytest",
             "pytest_timeout"):
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
if [ "$DRY" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # Every GPU test would be skipped and the benchmark refuse: that is no pass.
    say "CUDA is not available here: the check needs a CUDA GPU (the parts run anyway; use POLYRL_GPU_DRY_RUN=1 to check the script alone)"
    rc=1
fi
timeout_opt=()
pytest_help="$("$PY" -m pytest --help 2>/dev/null)"
if [[ "$pytest_help" == *"--timeout="* ]]; then
    timeout_opt=(--timeout="$TEST_S")
else
    say "pytest-timeout is not installed: no per-test limit, only the call's"
fi
say ""

run_tests() { # $1: title, rest: pytest selection
    local title="$1" name="$2"
    shift 2
    say "## tests_gpu: $title"
    local log="$REPORT_DIR/gpu_tests_$name.log"
    if [ "$DRY" = 1 ]; then
        "$PY" -m pytest -p no:cacheprovider --collect-only -q "$@" >"$log" 2>&1
        local crc=$?
        fence
        grep -E '::' "$log" | sed 's/^/- WOULD RUN /' | tee -a "$REPORT"
        grep -E '^SKIPPED' "$log" | sed 's/^SKIPPED \[[0-9]*\] /- NOT RUN (whole module) /' | tee -a "$REPORT"
        fence
        say "collected: $(grep -c '::' "$log") test(s) (pytest exit status $crc)"
        [ "$crc" -ne 0 ] && rc=1
        say ""
        return
    fi
    local budget=$(($(left) - 40))
    if [ "$budget" -lt 30 ]; then
        say "not run: ${budget}s left of this call's ${CALL_S}s; run this part in a call of its own"
        rc=1
        say ""
        return
    fi
    say "each line is written as its test ends (limit for this part: ${budget}s)"
    fence
    POLYRL_GPU_LIVE_REPORT="$REPORT" timeout --signal=INT --kill-after=20 "$budget" \
        "$PY" -m pytest -v -rs -p no:cacheprovider "${timeout_opt[@]}" "$@" \
        --junitxml="$REPORT_DIR/gpu_tests_$name.xml" >"$log" 2>&1
    local trc=$?
    fence
    say "$(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -1)"
    case "$trc" in
    0) say "pytest exit status 0 (full log: $(basename "$log"))" ;;
    124 | 130 | 137) say "cut off after ${budget}s: the tests without a line above did not run (full log: $(basename "$log"))"; rc=1 ;;
    5) say "pytest collected no tests"; rc=1 ;;
    *) say "pytest exit status $trc (full log: $(basename "$log"))"; rc=1 ;;
    esac
    say ""
}

for p in "${parts[@]}"; do
    case "$p" in
    fast) run_tests "all but the GRPO runs" fast tests_gpu --ignore=tests_gpu/test_grpo_cuda.py ;;
    grpo) run_tests "the GRPO runs" grpo tests_gpu/test_grpo_cuda.py ;;
    bench)
        say "## benchmarks/gpu_step.py"
        if [ "$DRY" = 1 ]; then
            say "dry run: not run (needs CUDA)"
            say ""
            continue
        fi
        budget=$(($(left) - 20))
        if [ "$budget" -lt 30 ]; then
            say "not run: ${budget}s left of this call's ${CALL_S}s; run it in a call of its own"
            rc=1
            say ""
            continue
        fi
        timeout --kill-after=10 "$budget" "$PY" benchmarks/gpu_step.py >"$REPORT_DIR/gpu_step.log" 2>&1
        brc=$?
        if [ "$brc" -eq 0 ]; then
            tail -1 "$REPORT_DIR/gpu_step.log" >"$REPORT_DIR/gpu_step.json"
            fence; tee -a "$REPORT" <"$REPORT_DIR/gpu_step.json"; fence
            say "(record also appended to benchmarks/history/gpu_step.jsonl on this machine)"
        else
            say "gpu_step.py failed with status $brc$([ "$brc" -eq 124 ] && echo " (cut off after ${budget}s)"):"
            fence; tail -30 "$REPORT_DIR/gpu_step.log" | tee -a "$REPORT"; fence
            rc=1
        fi
        say ""
        ;;
    esac
done
if [ $# -eq 0 ]; then
    say "next: \`bash scripts/gpu_check.sh bench\`, then \`bash scripts/gpu_check.sh grpo\` (each its own device call)"
fi
say "gpu_check: exit status $rc after $(($(date +%s) - START))s"
exit "$rc"
