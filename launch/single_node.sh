#!/usr/bin/env bash
# PPO on one node: one rank per GPU (or one CPU rank on a machine without GPUs).
#
#   launch/single_node.sh [--num-gpus N] [--master-port P] [--] [ds-ppo train arguments]
#
#   launch/single_node.sh --num-gpus 8 --config 8b
#   launch/single_node.sh --config my_run.yaml ppo.kl_coef=0.05 output_dir=outputs/kl005
#
# Runs: deepspeed --num_gpus N --master_port P --module ds_ppo train ARGS
# N defaults to $NUM_GPUS, else the GPUs nvidia-smi lists, else 1. The ranks inherit this
# shell's environment (MLFLOW_*, NCCL_*), so no .deepspeed_env is needed on one node.
# DS_PPO_DRY_RUN=1 prints the command without running it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

num_gpus="${NUM_GPUS:-}"
master_port="${MASTER_PORT:-29500}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [[ -z "$num_gpus" ]]; then
  num_gpus="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
  [[ "$num_gpus" -gt 0 ]] || num_gpus=1
fi

ds_ppo_run deepspeed --num_gpus "$num_gpus" --master_port "$master_port" \
  --module "$DS_PPO_MODULE" train "$@"
