#!/usr/bin/env bash
# The prepared GPU checks that follow launch/bench_gpu.sh in a GPU session (tools/GPU_CHECKS.md,
# "GPU checks still to run"); each step's output goes to RESULT_DIR/<step>.log and a summary line
# per step is printed last. Run from the repository root:
#
#   bash launch/gpu_checks.sh [RESULT_DIR]
#
#   1. packed forwards equal padded ones on the GPU's kernels (tests/stages/test_packing.py with
#      DS_PPO_TEST_DEVICE=cuda: sdpa and eager in fp32, flash-attention 2 in bf16 if installed)
#   2. packed vs row micro-batches, time of score + update on variable-length rows
#      (tools/measure_packing.py --device cuda; with flash-attention 2 too if installed)
#   3. tensor-parallel decoding captured as a CUDA graph with its NCCL all-reduces
#      (tests/stages/test_decode_tp.py -k nccl: needs two GPUs, reports the skip on one)
#   4. the sampler's log-probs against the trainer's in bf16, with and without
#      generation.batch_invariant, and what its kernels cost (tools/measure_exactness.py)
#
# GPU_CHECKS_DEVICE=cpu runs the same steps on a CPU (what the CPU test of this script does).
set -uo pipefail
RESULTS=${1:-${OUT:-./gpu_checks}}
DEVICE=${GPU_CHECKS_DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
summary=()

step() {  # step NAME CMD...: run it, keep its log, remember its exit code and last line
  local name=$1; shift
  echo "[gpu_checks] $name: $*"
  "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  summary+=("$name: exit $rc | $(grep -v '^\s*$' "$RESULTS/$name.log" | tail -n 1)")
}

# -o addopts=: the project's pytest options ask for xdist, which the GPU image need not have
step packed_equal env DS_PPO_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -o addopts= \
    -p no:cacheprovider tests/stages/test_packing.py -k logprobs_entropy_values_equal_padded -rs
step packed_time "$PY" tools/measure_packing.py --device "$DEVICE" --threads 4 \
    ${GPU_CHECKS_PACKING_FLAGS:-}
if "$PY" -c "import flash_attn" 2>/dev/null && [[ $DEVICE == cuda ]]; then
  step packed_time_flash "$PY" tools/measure_packing.py --device cuda \
      --attn flash_attention_2 --threads 4 ${GPU_CHECKS_PACKING_FLAGS:-}
fi
step tp_nccl_graph "$PY" -m pytest -q -o addopts= -p no:cacheprovider tests/stages/test_decode_tp.py \
    -k nccl -rs
step exactness "$PY" tools/measure_exactness.py --device "$DEVICE" \
    ${GPU_CHECKS_EXACT_FLAGS:---dtype bf16} --json "$RESULTS/exactness.json"

echo
printf '%s\n' "${summary[@]}"
