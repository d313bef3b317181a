#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/check.py): each part under a hard time limit a little above its
# own budget, so that a part that hangs cannot take the others' time, then the summary. Results
# under $OUT (default benchmarks/results/gpu). Extra arguments go to every part (--dry-run).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results/gpu}"
PYTHON="${PYTHON:-python3}"
for part in tests:200 kernels:100 steps:160; do
    name="${part%%:*}"
    timeout "${part##*:}" "$PYTHON" benchmarks/gpu/check.py "$name" --out "$OUT" "$@" \
        || echo "check: part $name ended with status $?"
done
"$PYTHON" benchmarks/gpu/check.py report --out "$OUT" "$@"
