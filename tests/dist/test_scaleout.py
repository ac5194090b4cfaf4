"""The main job through the real launchers, and resuming on a different world size.

Three processes trees, shared by the cases below:
  A. launch/single_node.sh --num-gpus 2 ...          one node, two CPU ranks, 4 iterations
  B. launch/multinode_localhost.sh ...               two "nodes" on localhost (--no_ssh
                                                     --node_rank), one rank each, 2 iterations,
                                                     a checkpoint at iteration 2
  C. ds-ppo train ... (one rank) on B's output_dir   resumes B's 2-rank checkpoint through
                                                     DeepSpeed's universal checkpoint, to 4
Greedy decoding makes the rollouts a function of the weights only, so A, B and C must agree,
also in the second PPO epoch, whose re-mixed mini-batches hold the same samples at any world size.
"""
from __future__ import annotations

import subprocess

import pytest

from conftest import REPO, clean_env, free_port, read_metrics, run_cli

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

ARGS = ["tracking.enabled=false", "ppo.rollout_batch_size=16", "ppo.mini_batch_size=8",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=8", "generation.temperature=0",
        "ppo.ppo_epochs=2", "checkpoint.every=2", "checkpoint.export_at_end=false"]
KEYS = ("score/mean", "loss/policy", "loss/value", "policy/approx_kl", "kl/sequence_mean",
        "policy/entropy", "value/explained_variance")


def _script(name: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(REPO / "launch" / name), *args], cwd=cwd,
                          env=clean_env(MASTER_PORT=str(free_port())), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("scaleout")
    a = _script("single_node.sh", ["--num-gpus", "2", "--", *ARGS, "iterations=4",
                                   f"output_dir={work / 'a'}"], work)
    b = _script("multinode_localhost.sh", ["--nodes", "2", "--", *ARGS, "iterations=2",
                                           f"output_dir={work / 'b'}"], work)
    c = run_cli(["train", *ARGS, "iterations=4", f"output_dir={work / 'b'}"], cwd=work)
    return work, a, b, c


def _close(x: float, y: float, rel: float = 1e-3, abs_: float = 1e-6) -> bool:
    return abs(x - y) <= abs_ + rel * abs(x)


def test_single_node_launcher_runs_two_ranks(runs):
    work, a, _, _ = runs
    assert "+ deepspeed --num_gpus 2" in a.stdout  # the script prints what it runs
    assert [r["iteration"] for r in read_metrics(work / "a")] == [1, 2, 3, 4]


def test_two_nodes_on_localhost_match_one_node(runs):
    work, _, b, _ = runs
    assert "--no_ssh" in b.stdout and "--node_rank 1" in b.stdout
    ra, rb = read_metrics(work / "a"), read_metrics(work / "b")
    for x, y in zip(ra[:2], rb[:2]):
        bad = [k for k in KEYS if not _close(x[k], y[k])]
        assert not bad, (x["iteration"], {k: (x[k], y[k]) for k in bad})


def test_resume_two_ranks_to_one_through_universal_checkpoint(runs):
    work, _, _, c = runs
    assert "world size 2 -> 1 via a universal checkpoint" in c.stdout
    ra, rb = read_metrics(work / "a"), read_metrics(work / "b")
    assert [r["iteration"] for r in rb] == [1, 2, 3, 4]
    # Iterations 3-4 on one rank after the 2 -> 1 conversion continue the 2-rank run: the
    # weights, Adam moments and LR schedule all came through the universal checkpoint.
    for x, y in zip(ra[2:], rb[2:]):
        bad = [k for k in KEYS if not _close(x[k], y[k])]
        assert not bad, (x["iteration"], {k: (x[k], y[k]) for k in bad})
