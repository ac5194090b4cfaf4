"""Mixture-of-experts policies (tiny random-init Qwen3-MoE and Mixtral: 2 layers, 4 experts,
top-2) through every job on one rank and on two (real `deepspeed` launcher, gloo, ZeRO-3 with
each MoE block one leaf module): the same update at both world sizes, the load-balancing loss
in the loss and the metrics, router replay, exact resume (also on another world size), and an
export that plain transformers loads with the trained weights' logits; on two ranks also
expert parallelism (DeepSpeed AutoEP, 2 experts per rank) against the same runs without it.
The expensive processes run once per world size (tests/support/moe_checks.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, deepspeed_cmd, free_port, read_metrics, run_cli

pytestmark = pytest.mark.launcher
SCRIPT = REPO / "tests" / "support" / "moe_checks.py"


def _run(tmp_path_factory, ranks: int) -> tuple[dict, object]:
    work = tmp_path_factory.mktemp(f"moe{ranks}")
    out = work / "results.json"
    args = [str(SCRIPT), "--out", str(out), "--work", str(work)]
    cmd = [sys.executable, *args] if ranks == 1 else deepspeed_cmd(ranks, free_port()) + args
    proc = subprocess.run(cmd, cwd=work, env=clean_env(), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0 and out.exists(), (
        f"moe_checks with {ranks} rank(s) failed ({proc.returncode})\n{proc.stdout[-5000:]}\n"
        f"{proc.stderr[-8000:]}")
    res = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, f"scenarios failed with {ranks} rank(s): {errors}\n{proc.stdout[-5000:]}"
    return res, work


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory, 1)[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory, 2)


def _close(a: dict, b: dict, rel: float = 1e-3, abs_: float = 1e-6) -> list[str]:
    """Differences beyond float noise (tests/dist/test_engine.py says why 1e-3)."""
    return [f"{k}: {a[k]} vs {b[k]}" for k in a if abs(a[k] - b[k]) > abs_ + rel * abs(a[k])]


SAME_UPDATE = ["qwen_gae", "qwen_replay", "mixtral_dense_value", "qwen_grpo", "mixtral_lora",
               "qwen_sft", "qwen_rm"]


@pytest.mark.parametrize("scenario", SAME_UPDATE)
def test_moe_update_matches_between_one_and_two_ranks(one_rank, two_ranks, scenario):
    """PPO with an MoE critic, with router replay, a Mixtral policy next to a dense critic,
    GRPO, LoRA (attention: the fused experts are no linear layers), SFT and RM: two optimizer
    steps give the same losses at world size 1 (ZeRO-0) and 2 (ZeRO-3, MoE blocks as leaves).
    The load-balancing loss is left out of these (its coefficient 0): per micro-batch, as
    transformers computes it, it depends on which rows share a micro-batch."""
    one, two = one_rank[scenario], two_ranks[0][scenario]
    keys = [k for k in one if "moe_aux_loss" not in k]
    assert not _close({k: one[k] for k in keys}, {k: two[k] for k in keys})
    assert any(one[k] != 0 for k in keys if k.startswith("loss/"))


def test_load_balancing_loss_is_logged_and_trained(one_rank, two_ranks):
    """Every trained MoE role logs <role>/moe_aux_loss (~1 per expert choice when balanced:
    E x sum f_e P_e = 2 for top-2 of 4 uniform experts), and with a coefficient it changes the
    update."""
    for res in (one_rank, two_ranks[0]):
        for scenario, keys in (("qwen_gae", ("policy/moe_aux_loss", "value/moe_aux_loss")),
                               ("qwen_sft", ("sft/moe_aux_loss@0",)),
                               ("qwen_rm", ("rm/moe_aux_loss@0",))):
            for k in keys:
                assert 1.5 < res[scenario][k] < 4.0, (scenario, k, res[scenario][k])
        plain, aux = res["qwen_gae"], res["qwen_gae_aux"]
        assert aux["loss/policy"] != plain["loss/policy"]  # the second step saw the aux term
        assert aux["score/mean"] == plain["score/mean"]  # same rollout


def test_router_replay_changes_only_the_update(one_rank):
    """Sampler and trainer route alike on CPU in float32 (no flip at scoring); in the second
    optimizer step the updated policy would route some tokens otherwise than the sampler did,
    and replay sends them to the sampler's experts: the update differs from the plain run's."""
    rep, plain = one_rank["qwen_replay"], one_rank["qwen_gae"]
    assert rep["rollout/route_flip_frac"] == 0.0
    assert rep["rollout/logprob_abs_diff_max"] < 1e-5
    assert rep["policy/entropy"] == plain["policy/entropy"]
    assert rep["loss/policy"] != plain["loss/policy"]


def test_moe_resume_is_exact_and_the_export_loads_in_plain_transformers(one_rank, two_ranks):
    """Resumed from its iteration-1 checkpoint, iteration 2 equals the uninterrupted run's
    (bit for bit, at each world size); the streamed export (one tensor per expert, as
    save_pretrained writes them) loads with AutoModelForCausalLM and gives the logits of the
    weights in DeepSpeed's checkpoint (read by zero_to_fp32)."""
    for res in (one_rank, two_ranks[0]):
        r = res["resume_export"]
        assert r["resumed_iterations"] == 1 and r["resumed"] == r["whole"]
        e = r["export"]
        assert e["max_abs_diff"] == 0.0 and not e["missing"] and not e["unexpected"], e
        assert e["architectures"] == ["Qwen3MoeForCausalLM"] and e["per_expert_keys"] == 6


def _resume_on_one_rank(work, name: str, extra: list[str], tmp_path) -> tuple[dict, object]:
    """The two-rank run `name`'s iteration-1 checkpoint (ZeRO-3) resumed by one rank (DeepSpeed's
    universal checkpoint) to iteration 2, its RESUME_BASE settings and `extra`: (iteration 2's
    metrics, the run directory)."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from dist_checks import BASE
    from moe_checks import RESUME_BASE

    run = tmp_path / name
    shutil.copytree(work / name, run)
    shutil.rmtree(run / "checkpoints" / "iter_000002")
    shutil.rmtree(run / "final", ignore_errors=True)
    (run / "checkpoints" / "latest").write_text("iter_000001\n")
    rows = [r for r in read_metrics(run) if r["iteration"] == 1]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_cli(["train", *BASE, *RESUME_BASE, *extra, f"output_dir={run}", "iterations=2",
             "resume=auto"], cwd=tmp_path)
    return [r for r in read_metrics(run) if r["iteration"] == 2][-1], run


def test_moe_two_rank_checkpoint_resumes_on_one_rank(one_rank, two_ranks, tmp_path):
    """The two-rank run's iteration-1 checkpoint (ZeRO-3) resumed by one rank (DeepSpeed's
    universal checkpoint): its iteration 2 equals the uninterrupted two-rank run's. Within
    5e-3: the load-balancing loss (on here, coefficient 0.001) of a micro-batch depends on
    which rows share it, which the world size changes (measured 1.2e-3 on loss/policy; a lost
    or doubled state would move the losses by tens of percent)."""
    res, work = two_ranks
    second, _ = _resume_on_one_rank(work, "split", [], tmp_path)
    whole = res["resume_export"]["whole"]
    assert not _close(whole, {k: second[k] for k in whole}, rel=5e-3)


def test_expert_parallel_checkpoint_resumes_on_one_rank_at_expert_parallel_size_1(
        two_ranks, tmp_path):
    """The expert-parallel run's iteration-1 checkpoint (2 ranks, EP 2 for policy and critic)
    resumed by one rank without expert parallelism: the roles are built with AutoEP's layers at
    size 1 (the checkpoint's parameter names are AutoEP's) and load through the universal
    checkpoint, which gathers each layer's experts; iteration 2 equals the uninterrupted EP 2
    run's within the world-size tolerance above (measured 1.2e-3 on loss/policy), and the new
    checkpoint records EP size 1, so it resumes again with AutoEP's layers."""
    res, work = two_ranks
    second, run = _resume_on_one_rank(work, "ep_split", ["deepspeed.policy.offload_optimizer=true"],
                                      tmp_path)
    ep = res["ep_resume_export"]["resumed"]
    assert not _close(ep, {k: second[k] for k in ep}, rel=5e-3)
    state = json.loads((run / "checkpoints" / "iter_000002" / "trainer_state.json").read_text())
    assert state["expert_parallel"] == {"policy": 1, "value": 1} and state["world_size"] == 1


def test_a_rank_whose_tokens_skip_experts_does_not_hang(one_rank, two_ranks):
    """Rank 1 routes every token to experts 0 and 1, rank 0 as its routers choose: under
    ZeRO-3 the iteration completes (each MoE block is one ZeRO-3 leaf module: its experts are
    gathered together whichever a rank's tokens use). One rank runs ZeRO-0: no leaves."""
    r = two_ranks[0]["skipped_experts"]
    assert r["leaf_classes"] == ["Qwen3MoeSparseMoeBlock"]
    assert all(v == v for v in r.values() if isinstance(v, float))  # finite, not NaN
    assert one_rank["skipped_experts"]["leaf_classes"] == []


def test_expert_parallel_gives_the_update_of_data_parallel(two_ranks):
    """Expert parallelism (DeepSpeed AutoEP, 2 experts per rank) for the policy and the MoE
    critic on two ranks, with router replay: the rollout (from the generation replica, its
    experts collected from both ranks), the routes replayed, the losses and the update equal
    those of the same run with every expert on every rank (ZeRO-3 leaves); so do a Mixtral
    policy's next to a dense critic, and ds-ppo sft's and ds-ppo rm's two optimizer steps
    (with the load-balancing loss logged)."""
    res = two_ranks[0]
    for plain in ("qwen_replay", "mixtral_dense_value", "qwen_sft", "qwen_rm"):
        ep = plain.replace("_replay", "_ep_replay") if "replay" in plain else plain + "_ep"
        assert not _close(res[plain], res[ep]), ep


def test_expert_parallel_policy_decodes_on_a_tensor_parallel_replica(two_ranks):
    """The expert-parallel policy's generation replica split over the two ranks
    (generation.mode=tensor_parallel: each rank keeps the 2 experts AutoEP gave it, attention
    split by heads), with router replay: the recorded expert choices are those the trainer
    routes (no flip, the sampler's log-probs are the trainer's), and the greedy rollout, losses
    and update equal those of the gathered replica's run."""
    res = two_ranks[0]
    tp = res["qwen_ep_tp_replay"]
    assert tp["rollout/route_flip_frac"] == 0.0 and tp["rollout/logprob_abs_diff_max"] < 1e-5
    assert not _close(res["qwen_ep_replay"], tp)


def test_expert_parallel_checkpoint_at_size_1_resumes_at_size_2(two_ranks):
    """A checkpoint saved with AutoEP's layers at EP 1 (two ranks each holding every expert,
    from the EP 2 run's iteration 2) resumed at EP 2 through the universal checkpoint: its
    iteration equals that of the same checkpoint resumed at EP 1 (float noise: the experts'
    arithmetic runs in another order at EP 2; measured 1e-5 relative on loss/policy), and the
    checkpoints record EP 1, then EP 2."""
    r = two_ranks[0]["ep_grow_resume"]
    assert len(r["grown"]) == len(r["stay"]) == 1
    assert not _close(r["stay"][0], r["grown"][0])
    assert r["expert_parallel"] == [{"policy": 1, "value": 1}, {"policy": 2, "value": 2}]


PRE_UPDATE_KEYS = ("score/mean", "kl/sequence_mean", "policy/entropy", "response/length_mean")


def test_checkpoint_saved_without_expert_parallelism_resumes_with_it(two_ranks):
    """The two-rank run's iteration-1 checkpoint (ZeRO-3, no expert parallelism) resumed with
    expert parallelism (EP 2) for policy and critic: the universal checkpoint is copied under
    AutoEP's names (router `gate` -> `router.gate`, fused `gate_up_proj` -> `w1` and `w3`,
    `down_proj` -> `w2`), every weight and Adam moment equal to the original's; iteration 2's
    rollout and scores (before the update: the loaded weights) equal those of the same
    checkpoint resumed without expert parallelism, and its losses within 5e-3 (5e-5 absolute on
    the small policy/approx_kl): float noise in the experts' gradients, which Adam's second
    step amplifies where a moment is near 0 (measured 1.8e-3 on loss/policy, 1.8e-5 on
    policy/approx_kl; the experts' moments zeroed move loss/policy by 5e-3 and the moments
    after the update by 20 times as much as here); the new checkpoint records EP 2."""
    r = two_ranks[0]["plain_to_ep_resume"]
    plain = two_ranks[0]["resume_export"]["resumed"]
    assert r["resumed_iterations"] == 1 and r["expert_parallel"] == {"policy": 2, "value": 2}
    assert r["autoep_copy"] == [f"model.layers.0.mlp.{n}" for n in (
        "experts.w1", "experts.w2", "experts.w3", "router.gate.weight")]
    for role in ("policy", "value"):
        assert r["copy_vs_universal"][role]["max_abs_diff"] == 0.0
        assert r["copy_vs_universal"][role]["tensors"] > 3 * 20, r["copy_vs_universal"]
    assert not _close({k: plain[k] for k in PRE_UPDATE_KEYS},
                      {k: r["resumed"][k] for k in PRE_UPDATE_KEYS})
    assert not _close(plain, r["resumed"], rel=5e-3, abs_=5e-5)
    e = r["export"]
    assert e["keys_equal"] and e["per_expert_keys"] == 6 and e["max_abs_diff"] < 2e-2, e


def test_expert_parallel_resume_and_the_export_is_plain_hf(two_ranks):
    """Expert-parallel policy (its optimizer on CPU, as in the 30b-a3b preset) and critic
    (load-balancing loss on), resumed from iteration 1's
    checkpoint at the same world size and EP size (which the checkpoint records): iteration 2
    equals that of the uninterrupted run without expert parallelism (float noise: the experts'
    arithmetic runs in another order), aux loss included; the streamed export (every expert,
    collected from the ranks that hold them) loads with AutoModelForCausalLM under the names
    of the run without expert parallelism, with its logits (up to the 16-bit export's rounding
    of weights that differ by float noise)."""
    r = two_ranks[0]["ep_resume_export"]
    assert r["resumed_iterations"] == 1 and r["expert_parallel"] == {"policy": 2, "value": 2}
    assert not _close(two_ranks[0]["resume_export"]["whole"], r["resumed"])
    assert 1.5 < r["resumed"]["policy/moe_aux_loss"] < 4.0
    e = r["export"]
    assert e["architectures"] == ["Qwen3MoeForCausalLM"] and e["per_expert_keys"] == 6
    assert e["keys_equal"] and e["max_abs_diff"] < 2e-3, e
