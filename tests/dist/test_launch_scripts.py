"""The launch scripts: syntax, the commands they print (DS_PPO_DRY_RUN=1 runs nothing) and the
.deepspeed_env they write. Starting real multi-process runs is the launcher tests' job."""
from __future__ import annotations

import importlib.util
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import clean_env

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SCRIPTS = ["_common.sh", "single_node.sh", "multi_node.sh", "multinode_localhost.sh",
           "slurm.sbatch", "recipe_tiny.sh"]


def run(script: str, *args: str, cwd: Path, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    # a fresh shell's: no launcher variables (an in-process run earlier in this worker sets
    # MASTER_PORT, which the scripts would take instead of their default)
    full_env = {k: v for k, v in clean_env().items()
                if not k.startswith(("MLFLOW_", "NCCL_", "SLURM_", "DS_PPO_"))}
    full_env.update(DS_PPO_DRY_RUN="1", **(env or {}))
    res = subprocess.run(["bash", str(LAUNCH / script), *args], cwd=cwd, env=full_env,
                         capture_output=True, text=True, timeout=60)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def commands(res: subprocess.CompletedProcess) -> list[str]:
    return [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]


def read_env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\nnode-a slots=8\n\nnode-b slots=8\n")
    return path


@pytest.mark.parametrize("script", SCRIPTS)
def test_syntax(script):
    res = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_scripts_are_executable_and_strict():
    for script in SCRIPTS[1:]:
        path = LAUNCH / script
        assert path.stat().st_mode & stat.S_IXUSR, script
        assert "set -euo pipefail" in path.read_text(), script


def test_single_node(tmp_path):
    res = run("single_node.sh", "--num-gpus", "8", "--config", "8b", "ppo.kl_coef=0.05",
              cwd=tmp_path)
    assert commands(res) == ["deepspeed --num_gpus 8 --master_port 29500 --module ds_ppo train "
                             "--config 8b ppo.kl_coef=0.05"]
    assert not (tmp_path / ".deepspeed_env").exists()  # ranks inherit the environment


def test_multi_node_pdsh_forwards_mlflow_and_nccl(tmp_path, hostfile):
    env = {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000", "NCCL_DEBUG": "INFO",
           "UNRELATED_SECRET": "x"}
    res = run("multi_node.sh", "--hostfile", str(hostfile), "--config", "70b", "seed=1",
              cwd=tmp_path, env=env)
    [cmd] = commands(res)
    assert cmd.startswith(f"deepspeed --hostfile {hostfile} ")
    assert "--launcher pdsh" in cmd and cmd.endswith("--module ds_ppo train --config 70b seed=1")
    env_file = tmp_path / ".deepspeed_env"
    assert read_env_file(env_file) == {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000",
                                       "NCCL_DEBUG": "INFO"}
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600


def test_env_file_update_keeps_other_lines_and_is_readable_by_deepspeed(tmp_path, hostfile):
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("# a comment deepspeed would choke on\nLD_LIBRARY_PATH=/opt/x\n\n"
                        "MLFLOW_TRACKING_URI=http://old\n")
    run("multi_node.sh", "--hostfile", str(hostfile), cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": "http://new:5000", "MLFLOW_EXPERIMENT_NAME": "a b=c"})
    values = read_env_file(env_file)
    assert values == {"LD_LIBRARY_PATH": "/opt/x", "MLFLOW_TRACKING_URI": "http://new:5000",
                      "MLFLOW_EXPERIMENT_NAME": "a b=c"}
    # deepspeed's runner: every line must split at "=" (no blank or comment lines)
    assert all("=" in line for line in env_file.read_text().splitlines())


def test_env_file_name_follows_ds_env_file(tmp_path, hostfile):
    run("multi_node.sh", "--hostfile", str(hostfile), cwd=tmp_path,
        env={"DS_ENV_FILE": "my_env", "MLFLOW_TRACKING_URI": "http://m"})
    assert read_env_file(tmp_path / "my_env") == {"MLFLOW_TRACKING_URI": "http://m"}


@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_multi_node_mpi_and_slurm_use_the_entry_script(tmp_path, hostfile, launcher):
    res = run("multi_node.sh", "--hostfile", str(hostfile), "--launcher", launcher, "--config",
              "70b", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": "http://m"})
    [cmd] = commands(res)
    assert f"--launcher {launcher}" in cmd and "--master_addr node-a" in cmd
    assert f"{LAUNCH}/ds_ppo_entry.py --master-addr node-a --master-port 29500 --module ds_ppo " \
           "train --config 70b" in cmd
    assert ("--no_ssh_check" in cmd) == (launcher == "slurm")
    assert read_env_file(tmp_path / ".deepspeed_env")["MLFLOW_TRACKING_URI"] == "http://m"


def test_multi_node_no_ssh(tmp_path, hostfile):
    res = run("multi_node.sh", "--hostfile", str(hostfile), "--no-ssh", "--node-rank", "1",
              "--config", "70b", cwd=tmp_path)
    [cmd] = commands(res)
    assert "--no_ssh --node_rank 1 --master_addr node-a" in cmd
    assert cmd.endswith("--module ds_ppo train --config 70b")


def test_multi_node_errors(tmp_path, hostfile):
    res = run("multi_node.sh", "--hostfile", str(tmp_path / "missing"), cwd=tmp_path, check=False)
    assert res.returncode == 2 and "not found" in res.stderr
    res = run("multi_node.sh", "--hostfile", str(hostfile), "--launcher", "mvapich",
              cwd=tmp_path, check=False)
    assert res.returncode == 2 and "pdsh, openmpi or slurm" in res.stderr
    res = run("multi_node.sh", "--hostfile", str(hostfile), "--no-ssh", cwd=tmp_path, check=False)
    assert res.returncode == 2 and "--node-rank" in res.stderr


def test_multinode_localhost_starts_two_nodes(tmp_path):
    res = run("multinode_localhost.sh", "--master-port", "29555", "iterations=2", cwd=tmp_path)
    cmds = commands(res)
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        assert cmd.startswith("deepspeed --hostfile ")
        assert (f"--no_ssh --node_rank {rank} --master_addr 127.0.0.1 --master_port 29555 "
                "--module ds_ppo train iterations=2") in cmd


def test_slurm_batch_script(tmp_path):
    env = {"SLURM_JOB_NODELIST": "gpu1,gpu2", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "42",
           "SLURM_CPUS_PER_TASK": "96", "MLFLOW_TRACKING_URI": "http://m"}
    res = run("slurm.sbatch", "--config", "70b", cwd=tmp_path, env=env)
    [cmd] = commands(res)
    assert cmd.startswith("srun --nodes 2 --ntasks-per-node 1 ")
    assert "--cpus-per-task 96 --gpus-per-node 8" in cmd
    assert "--no-ssh --node-rank" in cmd and "SLURM_NODEID" in cmd
    assert cmd.endswith(f"{LAUNCH}/multi_node.sh hostfile.42 gpu1 29500 --config 70b")
    assert (tmp_path / "hostfile.42").read_text() == "gpu1 slots=8\ngpu2 slots=8\n"

    res = run("slurm.sbatch", "--config", "70b", cwd=tmp_path,
              env={**env, "DS_PPO_SLURM_MODE": "launcher"})
    [cmd] = commands(res)
    assert "--launcher slurm" in cmd and "--master_addr gpu1" in cmd
    assert read_env_file(tmp_path / ".deepspeed_env") == {"MLFLOW_TRACKING_URI": "http://m"}


def test_slurm_batch_script_outside_an_allocation(tmp_path):
    res = run("slurm.sbatch", cwd=tmp_path, check=False)
    assert res.returncode != 0 and "SLURM_JOB_NODELIST" in res.stderr


def test_entry_script_maps_launcher_ranks():
    spec = importlib.util.spec_from_file_location("ds_ppo_entry", LAUNCH / "ds_ppo_entry.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    ompi = {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert entry.rank_env(ompi, "h0", 1234) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                                                 "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "MASTER_PORT": "7"}
    assert entry.rank_env(slurm, "h0", 1234) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                                                  "MASTER_ADDR": "h0", "MASTER_PORT": "7"}
    launched = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a",
                "MASTER_PORT": "1"}
    assert entry.rank_env(launched, "h0", 1234) == {"MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(SystemExit):
        entry.rank_env({}, "h0", 1234)


def test_hostfile_example_parses_as_deepspeed_does():
    """The same pattern deepspeed.launcher.runner._parse_hostfile applies."""
    import re

    hosts = {}
    for line in (LAUNCH / "hostfile.example").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.search(r"^(\S+)\s+slots=(\d+)", line)
        assert match, line
        hosts[match.group(1)] = int(match.group(2))
    assert len(hosts) == 8 and set(hosts.values()) == {8}
