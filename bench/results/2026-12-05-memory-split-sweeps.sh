#!/usr/bin/env bash
# The issue-38 sweep on every trace and workload (bench/results/2026-12-05-memory-split-sweeps.md):
# python -m bench memory-split per (preset, trace), one JSON file each under
# bench/results/memory-split-sweeps/, then the tables. Rerun from the repository root:
#   bash bench/results/2026-12-05-memory-split-sweeps.sh            # every run (~30 min CPU)
#   bash bench/results/2026-12-05-memory-split-sweeps.sh tables     # the tables from the JSON
# Environment: PY (default python), NICE (default "nice -n 5").
set -euo pipefail
PY=${PY:-python}
NICE=${NICE:-nice -n 5}
OUT=bench/results/memory-split-sweeps
FRACTIONS="0.05 0.1 0.2 0.3 0.4737 0.6 0.8"
declare -A BUDGETS=([qwen3-next-80b]="5 10 20 40" [glm-5.3-flash-like]="10 20 40 80")
# name -> the trace options of memory-split
TRACES=(
  "mooncake-2000|--max-requests 2000"
  "docqa|--workload docqa"
  "agentic|--workload agentic"
  "multiturn|--workload multiturn"
  "sysprompt|--workload sysprompt"
  "mix|--workload mix"
  "agentic-seed1|--workload agentic --workload-seed 1"
)
if [[ "${1:-runs}" != tables ]]; then
  mkdir -p "$OUT"
  for model in qwen3-next-80b glm-5.3-flash-like; do
    for t in "${TRACES[@]}"; do
      name=${t%%|*}; opts=${t#*|}
      # shellcheck disable=SC2086
      $NICE "$PY" -m bench memory-split $opts --model "$model" --memory-gb ${BUDGETS[$model]} \
        --state-fractions $FRACTIONS --json "$OUT/$model-$name.json" > /dev/null
      echo "$model $name done"
    done
  done
fi
"$PY" -m bench.report.memory_split_tables "$OUT"/*.json
