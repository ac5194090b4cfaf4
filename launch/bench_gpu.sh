#!/usr/bin/env bash
# The prepared GPU benchmark session (docs/PERFORMANCE.md): the 1b bench with its
# baselines, then variants of the training settings without baselines, each within what is left
# of a time budget; the main table and a one-row-per-run summary are printed last.
#
#   bash launch/bench_gpu.sh [RESULT_DIR] [BUDGET_SECONDS]
#
# RESULT_DIR (default $OUT, else ./bench_results) gets <run>.json and <run>.log per run; the
# random-init weights are written once to $BENCH_MODELS (default /tmp/ds_ppo_bench_models) and
# reused by every run. A run that would start with under 90 s of budget left is skipped, and a
# run is killed when the budget is spent (its log says how far it got).
# Extra bench flags for every run: BENCH_FLAGS="--prompts 32"; a subset of the runs:
# BENCH_RUNS="main zero2"; another shape: BENCH_SHAPE=tiny (what the CPU test runs).
set -uo pipefail
RESULTS=${1:-${OUT:-./bench_results}}
BUDGET=${2:-480}
MODELS=${BENCH_MODELS:-/tmp/ds_ppo_bench_models}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
START=$(date +%s)
ran=()

bench() {  # bench NAME FLAGS...
  local name=$1; shift
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 90 )); then
    echo "[bench_gpu] skip $name: ${left}s of the ${BUDGET}s budget left"
    return
  fi
  echo "[bench_gpu] $name: $* (budget left ${left}s)"
  # shellcheck disable=SC2086
  timeout "$left" "$PY" -m ds_ppo.bench --shape "${BENCH_SHAPE:-1b}" --output-dir "$MODELS" \
      --json "$RESULTS/$name.json" "$@" ${BENCH_FLAGS:-} >"$RESULTS/$name.log" 2>&1
  local rc=$?
  if (( rc == 0 )); then
    ran+=("$RESULTS/$name.json")
  else
    echo "[bench_gpu] $name exited $rc; last lines of $RESULTS/$name.log:"
    tail -n 15 "$RESULTS/$name.log"
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
for run in ${BENCH_RUNS:-main persist zero2 micro32}; do
  case $run in
    main) bench main --iterations 2 ;;
    persist) bench persist --iterations 2 --skip-baselines --persistence-threshold 1e9 ;;
    zero2) bench zero2 --iterations 2 --skip-baselines --zero-stage 2 ;;
    micro32) bench micro32 --iterations 2 --skip-baselines --persistence-threshold 1e9 \
                 --micro-batch 32 --score-micro-batch 64 ;;
    *) echo "[bench_gpu] unknown run $run (main, persist, zero2, micro32)"; exit 2 ;;
  esac
done

echo
if [[ -f "$RESULTS/main.json" ]]; then
  sed -n '/^ds-ppo bench/,/^targets/p' "$RESULTS/main.log"
  echo
fi
echo "elapsed $(( $(date +%s) - START ))s of ${BUDGET}s"
if (( ${#ran[@]} )); then
  "$PY" -m ds_ppo.bench --summarize "${ran[@]}"
else
  echo "[bench_gpu] no run finished"
  exit 1
fi
