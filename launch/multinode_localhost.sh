#!/usr/bin/env bash
# Several "nodes" on this one machine, each started on its own with the launcher's --no_ssh
# --node_rank, as separate machines would be: CI's multi-node test (CPU, gloo), and a way to
# try a multi-node config without a cluster.
#
#   launch/multinode_localhost.sh [--nodes N] [--ranks-per-node R] [--master-port P]
#                                 [--] [ds-ppo train arguments]
#
#   launch/multinode_localhost.sh iterations=2          # the tiny default, 2 nodes x 1 rank
#
# Writes a hostfile node0..node{N-1} (names only: with --no_ssh nothing connects to them),
# then starts, for each node R:
#   deepspeed --hostfile H --no_ssh --node_rank R --master_addr 127.0.0.1 --master_port P
#             --module ds_ppo train ARGS
# and waits for all; when one fails the others are stopped. P defaults to a free port.
# The nodes inherit this shell's environment, so no .deepspeed_env is needed.
# DS_PPO_DRY_RUN=1 prints the commands without running them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

nodes=2
per_node=1
master_port="${MASTER_PORT:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --ranks-per-node) per_node="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$nodes" -ge 1 && "$per_node" -ge 1 ]] || ds_ppo_die "--nodes and --ranks-per-node must be >= 1"
if [[ -z "$master_port" ]]; then
  master_port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

hostfile="$(mktemp "${TMPDIR:-/tmp}/ds_ppo_hostfile.XXXXXX")"
for ((r = 0; r < nodes; r++)); do
  echo "node${r} slots=${per_node}" >>"$hostfile"
done

pgids=()
cleanup() {
  local pgid
  for pgid in "${pgids[@]}"; do
    kill -TERM -- "-${pgid}" 2>/dev/null || true
  done
  rm -f "$hostfile"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Job control: each node gets its own process group, so stopping a node stops its launcher
# and its ranks together.
[[ "${DS_PPO_DRY_RUN:-0}" == "1" ]] || set -m
for ((r = 0; r < nodes; r++)); do
  cmd=(deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$r"
       --master_addr 127.0.0.1 --master_port "$master_port"
       --module "$DS_PPO_MODULE" train "$@")
  if [[ "${DS_PPO_DRY_RUN:-0}" == "1" ]]; then
    ds_ppo_run "${cmd[@]}"
  else
    ds_ppo_run "${cmd[@]}" &
    pgids+=("$!")
  fi
done

status=0
for _ in "${pgids[@]}"; do
  if wait -n; then
    continue
  else
    status=$?
    echo "multinode_localhost.sh: a node exited with status ${status}; stopping the others" >&2
    break
  fi
done
exit "$status"
