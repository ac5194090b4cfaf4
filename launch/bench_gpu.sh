#!/usr/bin/env bash
# The prepared GPU session (docs/PERFORMANCE.md, "The prepared GPU session"): bench rows of the
# 1b shape at the 1b preset's settings (zero_stage auto) and on ZeRO-3 with and without its
# knobs, our decoding loop alone (eager and compiled step, against the memory bound, with its
# kernel table and the fp32 greedy check), the decoding loop on a mixture-of-experts policy
# (Qwen3-30B-A3B's layers, 2 of them: each experts implementation of transformers, eager
# against CUDA graph, expert choices recorded), ppo.schedule sync against one_step_off (generation
# beside the update, docs/ASYNC.md) and, where TRL is installed, the peer ratio; each
# within what is left of a time budget. Every result lands in RESULT_DIR and in one tarball
# there (bench_gpu_results.tar.gz); the summary tables are printed last.
#
#   bash launch/bench_gpu.sh [RESULT_DIR] [BUDGET_SECONDS]
#
# RESULT_DIR (default $OUT, else ./bench_results) gets <run>.json and <run>.log per run; the
# random-init weights are written once to $BENCH_MODELS (default /tmp/ds_ppo_bench_models) and
# reused by every run. A run that would start with under 90 s of budget left is skipped, and a
# run is killed when the budget is spent (its log says how far it got).
# Extra bench flags for every bench run: BENCH_FLAGS="--prompts 32"; flags of the decode run:
# DECODE_FLAGS="--rows 64"; of the MoE decode run: MOE_FLAGS="--experts eager"; of the peer run:
# PEER_FLAGS="--iterations 1"; a subset of the runs: BENCH_RUNS="preset decode"; another shape:
# BENCH_SHAPE=tiny (what the CPU test runs). With .whl/ in the repo (prepare_wheels.sh) and no
# deepspeed importable, the wheels are installed into /tmp/site first.
set -uo pipefail
RESULTS=${1:-${OUT:-./bench_results}}
BUDGET=${2:-480}
MODELS=${BENCH_MODELS:-/tmp/ds_ppo_bench_models}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
START=$(date +%s)
ran=()
steps=()

if ! "$PY" -c "import deepspeed" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

bench() {  # bench NAME FLAGS...
  local name=$1; shift
  local l; l=$(left)
  if (( l < 90 )); then
    echo "[bench_gpu] skip $name: ${l}s of the ${BUDGET}s budget left"
    return
  fi
  echo "[bench_gpu] $name: $* (budget left ${l}s)"
  # shellcheck disable=SC2086
  timeout "$l" "$PY" -m ds_ppo.bench --shape "${BENCH_SHAPE:-1b}" --output-dir "$MODELS" \
      --json "$RESULTS/$name.json" "$@" ${BENCH_FLAGS:-} >"$RESULTS/$name.log" 2>&1
  local rc=$?
  if (( rc == 0 )); then
    ran+=("$RESULTS/$name.json")
  else
    echo "[bench_gpu] $name exited $rc; last lines of $RESULTS/$name.log:"
    tail -n 15 "$RESULTS/$name.log"
  fi
}

step() {  # step NAME CMD...: a non-bench run, its log kept, its exit code and last line noted
  local name=$1; shift
  local l; l=$(left)
  if (( l < 90 )); then
    steps+=("$name: skipped (${l}s of the budget left)")
    return
  fi
  echo "[bench_gpu] $name: $* (budget left ${l}s)"
  timeout "$l" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  # its last line, not a JSON record
  steps+=("$name: exit $rc | $(grep -v -e '^\s*$' -e '^{' "$RESULTS/$name.log" | tail -n 1)")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# the preset's settings: 128 prompts, gradient checkpointing, zero_stage auto
PRESET=(--iterations 2 --skip-baselines --prompts 128 --gradient-checkpointing)
# the MoE decode run's shape: Qwen3-30B-A3B's layers, or the tiny one with BENCH_SHAPE=tiny
MOE_SHAPE=$([[ ${BENCH_SHAPE:-1b} == tiny ]] && echo tiny_moe || echo 30b_a3b_2l)
for run in ${BENCH_RUNS:-preset z3 z3_knobs decode moe schedule peer main}; do
  case $run in
    main) bench main --iterations 2 ;;
    preset) bench preset "${PRESET[@]}" --zero-stage auto ;;
    z3) bench z3 "${PRESET[@]}" --zero-stage 3 ;;
    z3_knobs) bench z3_knobs "${PRESET[@]}" --zero-stage 3 --persistence-threshold 1e6 \
                  --prefetch-bucket-size 5e8 --max-live-parameters 3e9 ;;
    persist) bench persist --iterations 2 --skip-baselines --persistence-threshold 1e9 ;;
    zero2) bench zero2 --iterations 2 --skip-baselines --zero-stage 2 ;;
    micro32) bench micro32 --iterations 2 --skip-baselines --persistence-threshold 1e9 \
                 --micro-batch 32 --score-micro-batch 64 ;;
    compiled) bench compiled --iterations 2 --skip-baselines --zero-stage auto --compile-step ;;
    # shellcheck disable=SC2086
    decode) step decode "$PY" -m ds_ppo.bench.decode --shape "${BENCH_SHAPE:-1b}" \
                --json "$RESULTS/decode.json" --profile-dir "$RESULTS" --greedy-check \
                ${DECODE_FLAGS:-} ;;
    # shellcheck disable=SC2086
    moe) step moe "$PY" -m ds_ppo.bench.decode --shape "$MOE_SHAPE" --rows 64 \
             --experts eager batched_mm grouped_mm --json "$RESULTS/moe.json" ${MOE_FLAGS:-} ;;
    # shellcheck disable=SC2086
    schedule) step schedule "$PY" -m ds_ppo.bench --shape "${BENCH_SHAPE:-1b}" \
                  --output-dir "$MODELS" --json "$RESULTS/schedule.json" --iterations 3 \
                  --zero-stage 2 --schedule sync,one_step_off ${BENCH_FLAGS:-} ;;
    peer)
      if "$PY" -c "import trl" 2>/dev/null; then
        # shellcheck disable=SC2086
        step peer "$PY" -m ds_ppo.bench.peer --iterations 3 --runs trl,ppo \
            --out-dir "$RESULTS/peer" --json "$RESULTS/peer.json" ${PEER_FLAGS:-}
      else
        steps+=("peer: skipped (trl is not installed: add it to prepare_wheels.sh's wheels)")
      fi ;;
    *) echo "[bench_gpu] unknown run $run (preset, z3, z3_knobs, decode, moe, schedule, peer," \
            "main, persist, zero2, micro32, compiled)"; exit 2 ;;
  esac
done

tar -czf /tmp/bench_gpu_results.$$.tar.gz -C "$RESULTS" --exclude=bench_gpu_results.tar.gz . \
  && mv /tmp/bench_gpu_results.$$.tar.gz "$RESULTS/bench_gpu_results.tar.gz"
echo
if [[ -f "$RESULTS/main.json" ]]; then
  sed -n '/^ds-ppo bench/,/^targets/p' "$RESULTS/main.log"
  echo
fi
echo "elapsed $(( $(date +%s) - START ))s of ${BUDGET}s; every result: $RESULTS/bench_gpu_results.tar.gz"
if (( ${#ran[@]} )); then
  "$PY" -m ds_ppo.bench --summarize "${ran[@]}"
else
  echo "[bench_gpu] no bench run finished"
fi
if [[ -f "$RESULTS/decode.log" ]]; then
  echo
  grep -E '^\||^greedy fp32' "$RESULTS/decode.log"
fi
if [[ -f "$RESULTS/moe.log" ]]; then
  echo
  grep -E '^\|' "$RESULTS/moe.log"
fi
if [[ -f "$RESULTS/schedule.json" ]]; then
  echo
  grep -E '^ds-ppo bench --schedule|^\|' "$RESULTS/schedule.log"
fi
if (( ${#steps[@]} )); then
  echo
  printf '%s\n' "${steps[@]}"
fi
(( ${#ran[@]} )) || exit 1
