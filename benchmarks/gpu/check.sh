#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/check.py): each part under a hard time limit a little above its
# own budget, so that a part that hangs cannot take the others' time, then the summary. Results
# under $OUT (default benchmarks/results/gpu). Extra arguments go to every part (--dry-run).
#
# A lent device returns at most 8 files from $OUT, and the parts write a dozen (logs, per-test
# lines, one table per part). So the parts write into a scratch folder; $OUT gets each part's
# JSON as soon as the part ends (what a run cut short still returns), then summary.md, and
# everything else in one archive, gpu-check.tar.gz: 5 files.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results/gpu}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
for part in tests:200 kernels:100 steps:160; do
    name="${part%%:*}"
    timeout "${part##*:}" "$PYTHON" benchmarks/gpu/check.py "$name" --out "$WORK" "$@" \
        || echo "check: part $name ended with status $?"
    if [[ -f "$WORK/$name.json" ]]; then cp "$WORK/$name.json" "$OUT/"; fi
done
"$PYTHON" benchmarks/gpu/check.py report --out "$WORK" "$@"
if [[ -f "$WORK/summary.md" ]]; then cp "$WORK/summary.md" "$OUT/"; fi
tar -czf "$OUT/gpu-check.tar.gz" -C "$WORK" .
rm -rf "$WORK"
