#!/usr/bin/env bash
# The tree of REV (default HEAD) in .baseline/, with its commit in .baseline/COMMIT: what
# benchmarks/gpu/speed.sh times beside the working tree on a lent GPU (name .baseline in the
# device run's carry; .gitignore keeps it out of commits).
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-HEAD}"
rm -rf .baseline
mkdir .baseline
git archive "$rev" hf_actq | tar -x -C .baseline
git rev-parse --short "$rev" > .baseline/COMMIT
echo "baseline: $(cat .baseline/COMMIT) in .baseline ($(du -sh .baseline | cut -f1))"
