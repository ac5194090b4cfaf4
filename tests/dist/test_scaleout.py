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

And a critic-free run (no value model) with a LoRA policy:
  D. launch/single_node.sh --num-gpus 2 ... grpo + policy.lora, 1 iteration, saved
  E. ds-ppo train ... (one rank) on D's output_dir   resumes it through the universal checkpoint
"""
from __future__ import annotations

import shutil
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


# ----------------------------------------------- critic-free, LoRA: another world size (D, E)
CRITIC_FREE = ["tracking.enabled=false", "ppo.rollout_batch_size=16", "ppo.mini_batch_size=8",
               "ppo.micro_batch_size=4", "generation.max_new_tokens=8", "checkpoint.every=1",
               "checkpoint.export_at_end=false", "policy.lora.r=8",
               "ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=2"]


@pytest.fixture(scope="module")
def critic_free(tmp_path_factory):
    work = tmp_path_factory.mktemp("critic_free")
    out = work / "d"
    _script("single_node.sh", ["--num-gpus", "2", "--", *CRITIC_FREE, "iterations=1",
                               f"output_dir={out}"], work)
    saved = work / "saved"  # D's checkpoint as saved, before E converts it
    shutil.copytree(out / "checkpoints" / "iter_000001", saved)
    e = run_cli(["train", *CRITIC_FREE, "iterations=2", f"output_dir={out}"], cwd=work)
    return out, saved, e


def test_critic_free_lora_trains_on_two_ranks_without_a_value_model(critic_free):
    out, saved, _ = critic_free
    rows = read_metrics(out)
    assert rows[0]["kl/sequence_mean"] == 0.0  # zero-init adapters: the policy is its base
    assert "loss/value" not in rows[0] and "score/group_std_mean" in rows[0]
    assert not (saved / "value").exists() and (saved / "hf" / "adapter_config.json").is_file()


def test_critic_free_lora_resumes_on_another_world_size(critic_free):
    """Refused before ("value was saved without ZeRO"): the conversion asked for a value model
    the run never had. The adapters come through: at iteration 2 the policy differs from its
    base (a KL estimate that is not exactly 0), which freshly initialised (zero) adapters, the
    base itself, would not."""
    out, _, e = critic_free
    assert "world size 2 -> 1 via a universal checkpoint" in e.stdout
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[1]["kl/sequence_mean"] != 0.0


def test_a_missing_shard_is_named_on_another_world_size(critic_free, tmp_path):
    """Rank 1's optimizer shard deleted, resumed on one rank: the manifest names the file before
    any conversion; without the manifest's check (checkpoint.verify=false), the conversion's
    failure is one message naming the checkpoint, not ds_to_universal's traceback."""
    from ds_ppo.engine.checkpoint import ensure_universal
    from ds_ppo.engine.checkpoint.files import find_resume
    from ds_ppo.errors import CheckpointError

    _, saved, _ = critic_free
    ckpt = tmp_path / "checkpoints" / "iter_000001"
    shutil.copytree(saved, ckpt)
    shard = next((ckpt / "policy" / "ds").glob("zero_pp_rank_1_*optim_states.pt"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"is unusable: {shard} is missing"):
        find_resume(tmp_path, str(ckpt))
    assert find_resume(tmp_path, str(ckpt), verify=False) == ckpt
    with pytest.raises(CheckpointError) as err:
        ensure_universal(ckpt)
    assert str(err.value).startswith(f"checkpoint {ckpt} is unusable: {ckpt / 'policy' / 'ds'} "
                                     "cannot be converted for another world size")
    assert len(str(err.value).splitlines()) == 1


# ------------------------------ ds-ppo sft: another world size through the driver (F, G)
SFT = ["tracking.enabled=false", f"data.path={REPO / 'examples' / 'demos.jsonl'}",
       "sft.batch_size=8", "sft.micro_batch_size=4", "sft.max_len=32", "checkpoint.every=2",
       "checkpoint.export_at_end=false"]
SFT_KEYS = ("loss/sft",)  # (one rank: ZeRO-0, which reports no gradient norm)


@pytest.fixture(scope="module")
def sft_scaleout(tmp_path_factory):
    """F: `ds-ppo sft` on two ranks (ZeRO-3), 2 steps, saved; G: the same command on one rank
    with sft.steps=4 continues it through the universal checkpoint; H: 4 steps on one rank."""
    from conftest import deepspeed_cmd

    work = tmp_path_factory.mktemp("sft_scaleout")
    proc = subprocess.run([*deepspeed_cmd(2, free_port()), "--module", "ds_ppo", "sft", *SFT,
                           "sft.steps=2", f"output_dir={work / 'f'}"], cwd=work,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    g = run_cli(["sft", *SFT, "sft.steps=4", f"output_dir={work / 'f'}"], cwd=work)
    run_cli(["sft", *SFT, "sft.steps=4", f"output_dir={work / 'h'}"], cwd=work)
    again = run_cli(["sft", *SFT, "sft.steps=4", f"output_dir={work / 'f'}"], cwd=work)
    return work, g, again


def test_sft_resumes_two_ranks_on_one_through_the_universal_checkpoint(sft_scaleout):
    work, g, _ = sft_scaleout
    assert "world size 2 -> 1 via a universal checkpoint" in g.stdout + g.stderr
    f, h = read_metrics(work / "f"), read_metrics(work / "h")
    assert [r["iteration"] for r in f] == [1, 2, 3, 4]
    for x, y in zip(f, h):  # the SFT loss is the same at any world size (tests/dist/test_engine)
        bad = [k for k in SFT_KEYS if not _close(x[k], y[k])]
        assert not bad, (x["iteration"], {k: (x[k], y[k]) for k in bad})


def test_a_finished_sft_run_stops_before_loading_a_model(sft_scaleout):
    _, _, again = sft_scaleout
    assert "already completed 4 of sft.steps=4" in again.stdout
    assert "nothing to train: raise sft.steps to continue" in again.stdout
    assert "ZeRO stage" not in again.stdout + again.stderr and "sft step" not in again.stdout
