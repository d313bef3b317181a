#!/usr/bin/env bash
# The GPU speed check (benchmarks/gpu/speed.py) on this tree and on its baseline, alternating
# (new, base, new, base: drift on the device falls on both), then speed.md with new / base.
#
#   bash tools/baseline.sh [REV]          # here, before the loan: REV's tree into .baseline/
#   bash benchmarks/gpu/speed.sh          # there, with .baseline carried; results under $OUT
#
# Each run under a hard limit of 140 s (4 runs fit a lent device's 10-minute command); ROUNDS=1
# halves the time. Extra arguments go to every run.
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results/gpu}"
PYTHON="${PYTHON:-python3}"
BASELINE="${BASELINE:-.baseline}"
ROUNDS="${ROUNDS:-2}"
mkdir -p "$OUT"
if [[ ! -f "$BASELINE/hf_actq/__init__.py" ]]; then
    echo "speed: no baseline tree at $BASELINE (bash tools/baseline.sh, then carry it)" >&2
    exit 2
fi
for round in $(seq 1 "$ROUNDS"); do
    for label in new base; do
        tree="$PWD" commit="${HF_ACTQ_COMMIT:-}"
        if [[ $label == base ]]; then
            tree="$(cd "$BASELINE" && pwd)" commit="$(cat "$BASELINE/COMMIT")"
        fi
        HF_ACTQ_COMMIT="$commit" HF_ACTQ_TREE="$tree" PYTHONUNBUFFERED=1 timeout 140 \
            "$PYTHON" benchmarks/gpu/speed.py --label "$label-$round" --out "$OUT" "$@" \
            || echo "speed: $label-$round ended with status $?"
    done
done
"$PYTHON" benchmarks/gpu/speed.py --compare --out "$OUT"
