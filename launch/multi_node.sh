#!/usr/bin/env bash
# PPO on several nodes listed in a DeepSpeed hostfile (see launch/hostfile.example).
#
#   launch/multi_node.sh [--hostfile FILE] [--launcher pdsh|openmpi|slurm]
#                        [--master-addr ADDR] [--master-port PORT] [--num-gpus G]
#                        [--launcher-args "..."] [--no-ssh --node-rank R]
#                        [--] [ds-ppo train arguments]
#
#   launch/multi_node.sh --hostfile hostfile --config 70b
#   launch/multi_node.sh --hostfile hostfile --launcher openmpi --config 70b
#   launch/multi_node.sh --hostfile hostfile --no-ssh --node-rank 3 --config 70b  # on node 3
#
# pdsh (default): run once, on the first node; the deepspeed runner ssh-es (pdsh) into every
#   host and starts `python -m deepspeed.launcher.launch ... --module ds_ppo train ARGS` there,
#   in this same directory: put the repository and output_dir on a shared filesystem.
# openmpi | slurm: the runner starts every rank with mpirun | srun, without DeepSpeed's
#   per-node launcher, so ranks go through launch/ds_ppo_entry.py, which sets RANK,
#   WORLD_SIZE and LOCAL_RANK from OpenMPI's or SLURM's variables.
# --no-ssh --node-rank R: no remote start at all; run this on every node, R = 0..N-1, with the
#   same hostfile and --master-addr (default: the hostfile's first host). Used by
#   launch/slurm.sbatch and launch/multinode_localhost.sh.
#
# With pdsh/openmpi/slurm this writes ./.deepspeed_env with the MLFLOW_* and NCCL_* variables
# of this shell, which the runner exports on every node (see _common.sh).
# DS_PPO_DRY_RUN=1 prints the command without running it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

hostfile="${DS_PPO_HOSTFILE:-hostfile}"
launcher="pdsh"
master_addr=""
master_port="${MASTER_PORT:-29500}"
num_gpus=""
launcher_args=""
no_ssh=0
node_rank=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hostfile) hostfile="$2"; shift 2 ;;
    --launcher) launcher="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --launcher-args) launcher_args="$2"; shift 2 ;;
    --no-ssh) no_ssh=1; shift ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

[[ -f "$hostfile" ]] || ds_ppo_die "hostfile '$hostfile' not found (pass --hostfile; format: launch/hostfile.example)"
first_host="$(ds_ppo_hosts "$hostfile" | head -n 1)"
[[ -n "$first_host" ]] || ds_ppo_die "hostfile '$hostfile' lists no '<host> slots=<n>' line"

cmd=(deepspeed --hostfile "$hostfile" --master_port "$master_port")
if [[ "$no_ssh" == 1 ]]; then
  [[ -n "$node_rank" ]] || ds_ppo_die "--no-ssh needs --node-rank (0 on the first host of $hostfile)"
  cmd+=(--no_ssh --node_rank "$node_rank" --master_addr "${master_addr:-$first_host}")
  [[ -n "$num_gpus" ]] && cmd+=(--num_gpus "$num_gpus")
  cmd+=(--module "$DS_PPO_MODULE" train "$@")
else
  [[ -z "$node_rank" ]] || ds_ppo_die "--node-rank only goes with --no-ssh"
  case "$launcher" in
    pdsh)
      [[ -n "$master_addr" ]] && cmd+=(--master_addr "$master_addr")
      [[ -n "$num_gpus" ]] && cmd+=(--num_gpus "$num_gpus")
      cmd+=(--launcher pdsh)
      [[ -n "$launcher_args" ]] && cmd+=(--launcher_args "$launcher_args")
      cmd+=(--module "$DS_PPO_MODULE" train "$@")
      ;;
    openmpi|slurm)
      # These runners neither set RANK/LOCAL_RANK nor keep --module (slurm drops it), so the
      # ranks start the entry script, which is given the rendezvous address explicitly.
      [[ -z "$num_gpus" || "$launcher" == slurm ]] \
        || ds_ppo_die "--num-gpus does not go with --launcher openmpi: list the slots in the hostfile"
      addr="${master_addr:-$first_host}"
      cmd+=(--master_addr "$addr" --launcher "$launcher")
      [[ "$launcher" == slurm ]] && cmd+=(--no_ssh_check)
      [[ -n "$num_gpus" ]] && cmd+=(--num_gpus "$num_gpus")
      [[ -n "$launcher_args" ]] && cmd+=(--launcher_args "$launcher_args")
      cmd+=("$DS_PPO_ROOT/launch/ds_ppo_entry.py" --master-addr "$addr" --master-port "$master_port"
            --module "$DS_PPO_MODULE" train "$@")
      ;;
    *) ds_ppo_die "--launcher must be pdsh, openmpi or slurm (got '$launcher')" ;;
  esac
  ds_ppo_write_env_file
fi

ds_ppo_run "${cmd[@]}"
