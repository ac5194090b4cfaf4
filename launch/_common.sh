# Helpers sourced by the ds_ppo launch scripts (not run on its own).
#
#   ds_ppo_run CMD...        print "+ CMD" (shell-quoted), then run it; with DS_PPO_DRY_RUN=1
#                            only print it
#   ds_ppo_write_env_file    write/update the .deepspeed_env the deepspeed runner reads
#   ds_ppo_hosts FILE        the host names of a hostfile, one per line
#
# Environment read here:
#   DS_PPO_DRY_RUN=1         print commands, run nothing (the .deepspeed_env is still written)
#   DS_PPO_ENV_PREFIXES      variables forwarded to every node (default "MLFLOW_ NCCL_")
#   DS_ENV_FILE              the env file's name, as deepspeed reads it (default .deepspeed_env)
#   DS_PPO_MODULE            the Python module the ranks run (default ds_ppo; for launcher smoke
#                            tests)

DS_PPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DS_PPO_MODULE="${DS_PPO_MODULE:-ds_ppo}"
# Ranks import ds_ppo from this checkout even when it is not pip-installed. The deepspeed
# runner forwards PYTHON* variables to every node (EXPORT_ENVS in deepspeed/launcher/runner.py).
export PYTHONPATH="${DS_PPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

ds_ppo_run() {
  local arg line="+"
  for arg in "$@"; do
    if [[ -n "$arg" && "$arg" != *[!A-Za-z0-9_./:=@%+,-]* ]]; then
      line+=" $arg"
    else  # single-quoted, as shlex.join would print it
      line+=" '${arg//\'/\'\\\'\'}'"
    fi
  done
  printf '%s\n' "$line"
  if [[ "${DS_PPO_DRY_RUN:-0}" == "1" ]]; then
    return 0
  fi
  "$@"
}

# The deepspeed runner (multi-node: pdsh, openmpi, slurm) exports every KEY=VALUE line of
# ~/.deepspeed_env and ./.deepspeed_env (name overridable with DS_ENV_FILE) on every node.
# It splits each line at the first "=" and fails on a line without one, so the file holds no
# comments or blank lines. Lines for other variables are kept; the forwarded ones are replaced
# by their current values. Mode 600: MLFLOW_TRACKING_TOKEN and the like are secrets.
ds_ppo_write_env_file() {
  local file="${DS_ENV_FILE:-.deepspeed_env}"
  local prefixes="${DS_PPO_ENV_PREFIXES:-MLFLOW_ NCCL_}"
  local names=() name prefix line
  for name in $(compgen -e | sort); do
    for prefix in $prefixes; do
      if [[ "$name" == "$prefix"* && "${!name}" != *$'\n'* ]]; then
        names+=("$name")
        break
      fi
    done
  done
  local tmp
  tmp="$(mktemp "${file}.XXXXXX")"
  chmod 600 "$tmp"
  if [[ -f "$file" ]]; then
    while IFS= read -r line || [[ -n "$line" ]]; do
      [[ "$line" == *=* ]] || continue
      name="${line%%=*}"
      [[ " ${names[*]} " == *" ${name} "* ]] && continue
      printf '%s\n' "$line" >>"$tmp"
    done <"$file"
  fi
  for name in "${names[@]}"; do
    printf '%s=%s\n' "$name" "${!name}" >>"$tmp"
  done
  mv -f "$tmp" "$file"
  if [[ ${#names[@]} -gt 0 ]]; then
    echo "ds_ppo: ${file} forwards ${names[*]} to every node" >&2
  else
    echo "ds_ppo: ${file}: no variable starting with ${prefixes// / or } is set" >&2
  fi
}

ds_ppo_hosts() {
  local file="$1"
  awk '!/^[[:space:]]*(#|$)/ && /slots=/ {print $1}' "$file"
}

ds_ppo_die() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}
