#!/usr/bin/env bash
# Download, HERE (with access to the package registry), the wheels that the lent GPU machine
# lacks for polyrl's local-backend path, into an ignored folder that travels with a device run
# (`carry: ["gpu_wheels"]`); scripts/gpu_check.sh installs them there offline.
#
#   bash scripts/gpu_wheels.sh [DEST]        # DEST defaults to gpu_wheels/
#
# The list is scripts/gpu_requirements.txt (pinned, dependencies listed explicitly). Wheels
# are for CPython 3.12 on manylinux x86_64, binary only. The folder must stay under 55 MiB
# (a device run carries at most 64 MiB with the working tree): the script fails if it is not.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/gpu_wheels}"
REQS="$ROOT/scripts/gpu_requirements.txt"
LIMIT_MIB=55
# Any Python with pip will do: pip downloads for the target's version and platform.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for cand in "$ROOT/.venv/bin/python" python3; do
        if "$cand" -m pip --version >/dev/null 2>&1; then PY="$cand"; break; fi
    done
fi
[ -n "$PY" ] || { echo "gpu_wheels.sh: no Python with pip found (set PYTHON=...)" >&2; exit 2; }

rm -rf "$DEST"
mkdir -p "$DEST"
# pip matches manylinux_2_N tags exactly, so name the usual ones.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$DEST" -r "$REQS"

# One wheel per requirement, no more (two versions of one package stop an install).
want=$(grep -cEv '^\s*(#|$)' "$REQS")
got=$(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$got" -ne "$want" ]; then
    echo "gpu_wheels.sh: expected $want wheels, found $got in $DEST" >&2
    exit 1
fi
bytes=$(du -sb "$DEST" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
if [ "$bytes" -gt $(( LIMIT_MIB * 1048576 )) ]; then
    echo "gpu_wheels.sh: $DEST is $mib MiB, over the $LIMIT_MIB MiB limit" >&2
    exit 1
fi
echo "gpu_wheels.sh: $got wheels, $bytes bytes (~$mib MiB) in $DEST"
