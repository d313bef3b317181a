#!/usr/bin/env bash
# Re-runs on a lent GPU the committed memory reports that this CPU cannot: their bf16 steps go
# through torch's reference GEMM here, over 30 minutes per layer (docs/benchmarks.md). Run it
# after check.sh, with what the loan has left:
#
#     HF_ACTQ_COMMIT=<commit> BUDGET=<seconds> bash benchmarks/gpu/reports.sh
#
# Each report is the command that made the committed one, run in this order while the budget
# lasts; each gets what is left. A report that finishes writes its files under
# benchmarks/results/. Those that finished, with every report's log under reports-logs/, come
# back in one archive, $OUT/reports.tar.gz (a lent device returns at most 8 files). Unpack it in
# the repository root to put the files in place. `--list` prints the commands.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results/gpu}"
PYTHON="${PYTHON:-python3}"
BUDGET="${BUDGET:-300}"
# The ALAM tables' LLaMA2-7B reports first (the README and docs quote them most), then the rest.
# The Gemma 3 1B report names a config folder, which report_configs.py writes first. Not here:
# bench_memory.json's LLaMA part (--only llama) needs bitsandbytes for its QLoRA rows, which the
# device does not have.
REPORTS=(
    "-m hf_actq memory llama2-7b --peft lora --batch-size 8 --seq-len 512 --recipe alam:bits=1 --output benchmarks/results/memory_llama2_7b_lora_alam1 --no-progress"
    "-m hf_actq memory llama2-7b --peft lora --batch-size 8 --seq-len 512 --recipe checkpoint --output benchmarks/results/memory_llama2_7b_lora_checkpoint --no-progress"
    "benchmarks/bench_memory.py --only alam --output benchmarks/results/bench_memory_alam.json"
    "-m hf_actq memory gemma3-4b --peft lora --batch-size 1 --seq-len 1024 --layers scaled --recipe uniform:bits=4 --output benchmarks/results/memory_gemma3_4b_lora --no-progress"
    "-m hf_actq memory mixtral-8x7b --peft lora --batch-size 1 --seq-len 512 --layers scaled --recipe fewbit:fused_loss=true uniform:bits=4 alam:bits=1 --output benchmarks/results/memory_mixtral_8x7b_lora --no-progress"
    "-m hf_actq memory gemma3-1b-v32k --dtype bf16 --batch-size 1 --seq-len 512 --layers all --recipe uniform:bits=4 --output benchmarks/results/memory_gemma3_1b_v32k_all_layers --no-progress"
)
if [[ "${1:-}" == --list ]]; then
    printf '%s\n' "${REPORTS[@]}"
    exit 0
fi
mkdir -p "$OUT"
WORK="$(mktemp -d)"
mkdir "$WORK/reports-logs"
end=$((SECONDS + BUDGET))
finished=()
made=()
if ((BUDGET >= 20)) && [[ ! -e gemma3-1b-v32k ]]; then
    # In the repository root, where the command names it; removed at the end.
    "$PYTHON" benchmarks/gpu/report_configs.py --out . >"$WORK/reports-logs/report_configs.log" 2>&1
    made=(gemma3-1b-v32k)
fi
for report in "${REPORTS[@]}"; do
    output="${report##*--output }"
    output="${output%% *}"
    left=$((end - SECONDS))
    if ((left < 20)); then
        echo "reports: no time left for $output"
        continue
    fi
    log="$WORK/reports-logs/$(basename "${output%.json}").log"
    # $report is split into words on purpose: no command above quotes a word.
    # shellcheck disable=SC2086
    if timeout "$left" "$PYTHON" $report >"$log" 2>&1; then
        finished+=("$output")
        echo "reports: $output done"
    else
        echo "reports: $output ended with status $? (log in the archive)"
    fi
done
tar -czf "$OUT/reports.tar.gz" "${finished[@]}" -C "$WORK" reports-logs
rm -rf "$WORK" "${made[@]}"
