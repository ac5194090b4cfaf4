"""The RLHF engine on CPU: one rank and two ranks (real `deepspeed` launcher, gloo), invariance of
the first update, varied response lengths without hangs, replica == trained policy, frozen
reference. The expensive processes run once per world size (tests/support/dist_checks.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, deepspeed_cmd, free_port

pytestmark = pytest.mark.launcher
LOSS_KEYS = ("loss/policy", "loss/value", "policy/approx_kl", "policy/clip_frac", "score/mean",
             "kl/sequence_mean", "policy/entropy", "response/length_mean")


def _run_checks(tmp_path_factory, ranks: int) -> dict:
    work = tmp_path_factory.mktemp(f"dist{ranks}")
    out = work / "results.json"
    script = [str(REPO / "tests" / "support" / "dist_checks.py"), "--out", str(out), "--work", str(work)]
    if ranks == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = deepspeed_cmd(ranks, free_port()) + script
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=work, env=clean_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and out.exists(), (
        f"dist_checks with {ranks} rank(s) failed ({proc.returncode})\n{proc.stdout[-5000:]}\n"
        f"{proc.stderr[-8000:]}")
    res = json.loads(out.read_text())
    res["_seconds"] = time.time() - t0
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, f"scenarios failed with {ranks} rank(s): {errors}\n{proc.stdout[-5000:]}"
    return res


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run_checks(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run_checks(tmp_path_factory, 2)


def _close(a: dict, b: dict, rel: float = 1e-3, abs_: float = 1e-6, keys=LOSS_KEYS) -> list[str]:
    """Differences beyond float noise. The tolerance is relative 1e-3: batching changes the order
    of float32 reductions (~1e-7 relative), and the second optimizer step's losses carry that
    through one AdamW step; a real bug (a wrong loss scale, a lost micro-batch) moves them by
    tens of percent."""
    return [f"{k}: {a[k]} vs {b[k]}" for k in keys
            if abs(a[k] - b[k]) > abs_ + rel * abs(a[k])]


def test_two_ranks_complete_with_zero3(two_ranks):
    assert two_ranks["world_size"] == 2
    for k in LOSS_KEYS:
        assert two_ranks["zero3_micro4"][k] == two_ranks["zero3_micro4"][k]  # not NaN


def test_first_update_matches_between_one_and_two_ranks(one_rank, two_ranks):
    assert one_rank["world_size"] == 1
    assert not _close(one_rank["zero3_micro4"], two_ranks["zero3_micro4"])
    # not trivially equal: the second optimizer step saw the first one's update
    assert one_rank["zero3_micro4"]["loss/value"] > 0
    assert one_rank["zero3_micro4"]["policy/approx_kl"] > 0
    assert one_rank["zero3_micro4"]["loss/policy"] != 0


@pytest.mark.parametrize("stage", ["zero3", "zero2"])
def test_tiled_logits_first_update_equals_untiled(one_rank, two_ranks, stage):
    """ppo.tiled_logits=true with 4-position tiles through the real engines: the same first
    update as the untiled run (ZeRO-3 gathers the head for each tile's call, and ZeRO-2/3 reduce
    its gradient once, after the last tile)."""
    for res in (one_rank, two_ranks):
        assert not _close(res[f"{stage}_micro4"], res[f"{stage}_tiled"])


def test_sequence_parallel_2_equals_1_logprobs_loss_and_gradients(two_ranks):
    """deepspeed.sequence_parallel_size = 2 (engine/sequence_parallel.py, DeepSpeed Ulysses) on 2
    gloo ranks: one row's log-probs, entropies, PPO loss (and every other ppo.policy_loss) and
    summed gradients equal SP = 1's (fp32; tests/support/sp_checks.py), worst over both ranks.
    Plain forwards of the same process are untouched by the registration; without the exchange
    the check would fail."""
    r = two_ranks["sequence_parallel"]
    assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 and r["loss"] < 1e-6, r
    assert r["grads"] < 1e-5 * max(1.0, r["grad_scale"]), r
    assert r["unsharded_after"] == 0.0 and r["masked_nonzero"] == 0.0, r
    assert r["ulysses_shapes"] == 1, r  # the sharded forward went through Ulysses
    assert r["without_exchange"] > 1e-3, r  # and the test can fail
    from ds_ppo.algo.choices import POLICY_LOSSES

    for name in POLICY_LOSSES:  # every ppo.policy_loss on the split row
        if name != "ppo":
            assert r[f"loss_{name}"] < 1e-6, (name, r)
            assert r[f"grads_{name}"] < 1e-5 * max(1.0, r[f"grad_scale_{name}"]), (name, r)
            assert r[f"grad_scale_{name}"] > 0, (name, r)


SP_METRICS = LOSS_KEYS + ("ema/distance", "loss/ptx")  # with the policy's EMA and PPO-ptx


def test_sequence_parallel_training_equals_one_rank(one_rank, two_ranks):
    """`ds-ppo train` with deepspeed.sequence_parallel_size = 2 on 2 gloo ranks (one
    data-parallel rank; rows of at least 16 tokens split across the pair, DeepSpeed Ulysses, the
    shorter ones and PPO-ptx's whole on both, ZeRO-3, fp32, the policy's EMA) gives SP = 1 on
    one rank's first iteration: losses and metrics of its two optimizer steps, the EMA's
    distance (summed over every rank's ZeRO-3 partitions). The pair decoded together
    (tensor_parallel), only the group's first rank bringing its 16 rows: each row decoded once."""
    one, two = one_rank["sp_train"], two_ranks["sp_train"]
    assert two["split_forwards"] > 0 and one["split_forwards"] == 0  # rows were split
    assert two["rows_brought"] == [[16], [0]]
    keys = tuple(f"{k}@1" for k in SP_METRICS)
    assert not _close(one, two, rel=0.0, abs_=1e-5, keys=keys)
    assert one["loss/value@1"] > 0 and one["policy/approx_kl@1"] > 0  # not trivially equal


def test_sequence_parallel_checkpoint_resumes_at_another_sp_size(one_rank, two_ranks):
    """The checkpoint of that first iteration (SP = 2, 2 ranks) resumed with SP = 1 on the same
    2 ranks (2 data-parallel ranks; the ZeRO layout is the world's, DeepSpeed is not told of SP
    groups): iteration 2 equals SP = 1's uninterrupted iteration 2 on one rank."""
    one, r = one_rank["sp_train"], two_ranks["sp_train"]
    assert r["resumed_iterations"] == 1
    resumed = {k.removeprefix("resumed_"): v for k, v in r.items() if k.startswith("resumed_")}
    keys = tuple(f"{k}@2" for k in SP_METRICS)
    assert not _close(one, resumed, rel=0.0, abs_=1e-5, keys=keys)
    assert one["kl/sequence_mean@2"] > 0  # iteration 2 starts from the updated policy


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "cispo", "gmpo", "sapo"])
def test_each_policy_loss_on_two_ranks_packed_equals_one_rank_tiled(one_rank, two_ranks,
                                                                      name):
    """ppo.policy_loss with grpo through the real engines (ZeRO-3): the first update on two
    ranks with packed micro-batches and tiled logits (tile counts that differ between the
    ranks: ZeRO-3's head calls are collective) gives one rank's with row micro-batches and
    tiled logits, losses and every statistic of the loss (clip fractions at its level) alike."""
    from ds_ppo.algo.choices import POLICY_LOSSES

    assert sorted(POLICY_LOSSES) == sorted(["ppo", "gspo", "gspo_token", "cispo", "gmpo",
                                            "sapo"])  # a new row gets a case here
    one, two = one_rank[f"policy_loss_{name}"], two_ranks[f"policy_loss_{name}"]
    assert set(one) == set(two) and {"loss/policy", "policy/ratio_mean"} <= set(one)
    assert not _close(one, two, keys=tuple(one))
    assert one["policy/approx_kl"] > 0  # the second optimizer step saw the first one's update


def test_first_update_matches_between_zero2_and_zero3(one_rank, two_ranks):
    assert not _close(one_rank["zero3_micro4"], one_rank["zero2_micro4"])
    assert not _close(two_ranks["zero3_micro4"], two_ranks["zero2_micro4"])


def test_first_update_invariant_to_micro_batch_times_accumulation(one_rank, two_ranks):
    # (micro 4, accumulation 1) vs (micro 2, accumulation 2) on two ranks; 8 vs 4 on one rank
    assert not _close(two_ranks["zero3_micro4"], two_ranks["zero3_micro2"])
    assert not _close(one_rank["zero3_micro4"], one_rank["zero3_micro2"])


@pytest.mark.parametrize("mode", ["zero3", "gathered"])
def test_ranks_with_different_response_lengths_do_not_hang(two_ranks, mode):
    res = two_ranks[f"varied_{mode}"]
    assert res["iterations"] == 2
    widths = res["widths_per_rank"]  # [rank][iteration]: each rank's longest response
    assert len(widths) == 2 and widths[0] != widths[1], widths


def test_reference_frozen_policy_trained(one_rank, two_ranks):
    for res in (one_rank["replica"], two_ranks["replica"]):
        assert res["reference_unchanged"]
        assert res["policy_changed"] and res["policy_max_change"] > 0


def test_generation_replica_equals_trained_policy(one_rank, two_ranks):
    for res in (one_rank["replica"], two_ranks["replica"]):
        assert res["replica_equal_params"]
        assert res["replica_out"] == res["zero3_out"]
        assert res["kept_replica_refreshed"]  # generation.keep_replica: refreshed in place


def test_tensor_parallel_generation(one_rank, two_ranks):
    for res, world in ((one_rank["tensor_parallel"], 1), (two_ranks["tensor_parallel"], 2)):
        assert "error" not in res, res
        assert res["iterations"] == 2 and res["losses_finite"]
        # each rank's rows of the group's greedy decoding equal its own gathered replica's
        assert res["greedy_equal"] == [True] * world
        assert res["rows"] == [3 + r for r in range(world)]  # every rank got its own rows back
        assert res["group_outputs_equal"]  # ranks of a group sampled the same tokens
        assert res["sampled_tokens"] > 0


GROUP_KEYS = tuple(k for k in LOSS_KEYS if k != "loss/value") + (
    "loss/kl", "score/group_std_mean", "group/zero_std_frac")


@pytest.mark.parametrize("name", ["grpo_micro4", "rloo_micro4"])
def test_critic_free_first_update_matches_between_one_and_two_ranks(one_rank, two_ranks, name):
    # grpo: seq_mean_token_mean + a k3 KL loss; rloo: seq_mean_token_sum_norm, a KL loss,
    # clip-higher, dual clip, an entropy bonus and ppo.filter_zero_std_groups (one group of
    # four dropped)
    one, two = one_rank[name], two_ranks[name]
    keys = GROUP_KEYS + (("loss/entropy",) if name.startswith("rloo") else ())
    assert not _close(one, two, keys=keys)
    assert "loss/value" not in one  # no value model, no value loss
    assert one["policy/approx_kl"] > 0 and one["loss/policy"] != 0 and one["loss/kl"] != 0
    assert one["group/zero_std_frac"] == 0.25 and one["score/group_std_mean"] > 0


def test_distillation_first_update_matches_between_one_and_two_ranks(one_rank, two_ranks):
    """ppo.advantage_estimator = distill with a ZeRO-3 teacher on two ranks, the reward's group
    advantage mixed in and a KL loss: the first update (and the distillation metrics) of one
    rank on the whole batch."""
    keys = GROUP_KEYS + ("distill/reverse_kl", "distill/teacher_logprob", "distill/top1_match")
    one, two = one_rank["distill_micro4"], two_ranks["distill_micro4"]
    assert not _close(one, two, keys=keys)
    assert one["distill/reverse_kl"] > 0 and one["loss/kl"] != 0 and "loss/value" not in one


def test_critic_free_first_update_invariant_to_micro_batch_times_accumulation(one_rank,
                                                                              two_ranks):
    assert not _close(one_rank["grpo_micro4"], one_rank["grpo_micro2"], keys=GROUP_KEYS)
    assert not _close(two_ranks["grpo_micro4"], two_ranks["grpo_micro2"], keys=GROUP_KEYS)


def test_first_update_invariant_to_packing(one_rank, two_ranks):
    """ppo.micro_batch_tokens: packed micro-batches give the update of row micro-batches, on
    ZeRO-3 and ZeRO-2, with and without a critic, at one and two ranks."""
    for res in (one_rank, two_ranks):
        assert not _close(res["zero3_micro4"], res["zero3_packed"])
        assert not _close(res["zero3_micro4"], res["zero2_packed"])
        assert not _close(res["grpo_micro4"], res["grpo_packed"], keys=GROUP_KEYS)
    assert one_rank["zero3_packed"]["padding/update_positions_per_token"] == 1.0  # no padding
    # on two ranks the ranks' micro-batch counts differ in some mini-batch: the idle micro-batches
    # the rank with fewer runs (to keep its ZeRO collectives in step) count as computed positions
    assert two_ranks["zero3_packed"]["padding/update_positions_per_token"] > 1.0


def test_critic_free_estimator_builds_no_value_engine(one_rank, two_ranks):
    for res in (one_rank["critic_free_engines"], two_ranks["critic_free_engines"]):
        assert res == {"value_is_none": True, "ds_configs": ["policy", "reference"]}


# ------------------------------------------------------------------------------- LoRA
def test_lora_first_update_matches_between_one_and_two_ranks(one_rank, two_ranks):
    """policy.lora and value.lora on ZeRO-3: the adapters start at B = 0, so the policy is its
    base and the first iteration's KL to the reference (the same base) is exactly 0; the update
    is the same at any world size."""
    for res in (one_rank["zero3_lora"], two_ranks["zero3_lora"]):
        assert res["kl/sequence_mean"] == 0.0
        assert res["policy/approx_kl"] > 0  # the second optimizer step saw the first one's update
    assert not _close(one_rank["zero3_lora"], two_ranks["zero3_lora"])
    # packed (the reference: the policy engine with its adapters off, through lora.AdaptersOff)
    assert not _close(one_rank["zero3_lora"], one_rank["zero3_lora_packed"])
    assert not _close(two_ranks["zero3_lora"], two_ranks["zero3_lora_packed"])


def test_lora_trains_adapters_and_head_only_and_reference_stays_the_base(one_rank, two_ranks):
    for res in (one_rank["lora"], two_ranks["lora"]):
        trained, changed = res["trained"], res["changed"]
        assert trained["policy"] and all(".lora_" in n for n in trained["policy"])
        head = [n for n in trained["value"] if ".lora_" not in n]
        assert head == ["base_model.model.score.weight"], head  # the scalar head, fully trained
        for role in ("policy", "value"):  # every trained tensor moved, no base tensor did
            assert changed[role] == trained[role], role
        # the reference is the policy engine with its adapters off (no engine of its own): the
        # untouched base, exactly
        assert not res["reference_engine_built"]
        assert res["reference_equal_base"], res["reference_vs_base_max"]
        assert res["policy_vs_base_max"] > 1e-3  # while the adapted policy moved away from it
        # the replica holds W + alpha/r B A: the adapted policy's log-probs (fp32 rounding)
        assert res["merged_replica_vs_policy_max"] < 1e-5
        assert res["replica_out"] == res["zero3_out"]  # zero3 mode decodes through the adapters
        # the adapters-only sync of a schedule's replica (ZeRO-3 gathers of A and B alone)
        assert res["adapter_sync_equals_full"]
        assert res["adapter_sync_weights"] == res["adapted_layers"] > 0


# ------------------------------------------------------------------ the RLHF recipe's extras
PTX_KEYS = LOSS_KEYS + ("loss/ptx", "ema/distance")


def test_ptx_and_ema_first_update_matches_between_one_and_two_ranks(one_rank, two_ranks):
    """ppo.ptx_coef: the LM loss is a token mean over the global mini-batch's ptx rows, so the
    update (and the EMA that follows it, each rank its own ZeRO-3 partitions) is the same at
    one and two ranks (its micro-batch split: tests/stages/test_recipe_extras.py)."""
    one, two = one_rank["zero3_ptx_ema"], two_ranks["zero3_ptx_ema"]
    assert not _close(one, two, keys=PTX_KEYS)
    assert one["loss/ptx"] > 1.0 and one["ema/distance"] > 0
    # and ptx changes the update: the second step's policy loss differs from the plain run's
    assert one["policy/approx_kl"] != one_rank["zero3_micro4"]["policy/approx_kl"]


def test_value_model_from_a_reward_model_export(one_rank, two_ranks):
    for res in (one_rank["value_from_rm"], two_ranks["value_from_rm"]):
        assert res["max_diff"] < 1e-5, res
        assert len(set(res["scores"])) == 3  # three different rows, three different scores


def test_ema_on_zero3_swaps_in_the_assembled_partitions_and_back(one_rank, two_ranks):
    for res in (one_rank["ema_swap"], two_ranks["ema_swap"]):
        assert res["swapped_wrong"] == [] and res["ema_differs"], res
        assert res["persistent"] > 0  # norms stay gathered on ZeRO-3: refreshed too
        assert res["restored"] and res["reloaded_equal"]

SFT_KEYS = tuple(f"{k}@{i}" for i in (0, 1) for k in ("loss/sft", "sft/grad_norm")) \
    + ("eval/loss@1",)
RM_KEYS = tuple(f"{k}@{i}" for i in (0, 1)
                for k in ("loss/rm", "rm/margin_mean", "rm/grad_norm")) \
    + ("eval/loss@1", "eval/margin_mean@1")


def test_sft_loss_invariant_to_world_size_and_micro_batches(one_rank, two_ranks):
    """ds-ppo sft: the same two optimizer steps at 1 and 2 ranks (2 or 1 micro-batches of 4 rows
    per rank), padded or packed (the loss divided by the global step's token count)."""
    ref = one_rank["sft_micro4"]
    for run in (two_ranks["sft_micro4"], one_rank["sft_packed"], two_ranks["sft_packed"]):
        assert not _close(ref, run, keys=SFT_KEYS)
    assert ref["loss/sft@1"] < ref["loss/sft@0"]  # the first step changed the weights


def test_rm_loss_invariant_to_world_size_and_micro_batches(one_rank, two_ranks):
    """ds-ppo rm: the Bradley-Terry loss with margins divided by the global pair count (2 or 1
    micro-batches of 4 pairs per rank)."""
    ref = one_rank["rm_micro4"]
    for run in (two_ranks["rm_micro4"],):
        assert not _close(ref, run, keys=RM_KEYS)
    assert ref["loss/rm@1"] != ref["loss/rm@0"]

DPO_KEYS = tuple(f"{k}@{i}" for i in (0, 1) for k in ("loss/dpo", "dpo/reward_margin",
                                                      "dpo/chosen_logp", "dpo/grad_norm")) \
    + ("eval/loss@1", "eval/reward_margin@1")


def test_dpo_loss_invariant_to_world_size_and_micro_batches(one_rank, two_ranks):
    """ds-ppo dpo: the preference loss divided by the global pair count (2 or 1 micro-batches of
    4 pairs per rank), the reference's log-probs computed on each rank's own pairs."""
    ref = one_rank["dpo_micro4"]
    assert not _close(ref, two_ranks["dpo_micro4"], keys=DPO_KEYS)
    assert ref["loss/dpo@0"] == pytest.approx(0.6931472, abs=1e-6)  # the policy is its reference
    assert ref["loss/dpo@1"] < ref["loss/dpo@0"]


# ---------------------------------------------------------------- multi-turn episodes
ENV_KEYS = LOSS_KEYS + ("env/turns_mean", "env/observation_tokens_mean", "env/model_tokens_mean")


def test_multi_turn_first_update_matches_between_one_and_two_ranks(one_rank, two_ranks):
    """env.function: two-turn episodes (an observation between the turns, a reward per turn):
    the same first update at one and two ranks, packed or not, and with LoRA."""
    for res in (one_rank, two_ranks):
        assert res["env_micro4"]["env/turns_mean"] == 2.0, res["env_micro4"]
        assert res["env_micro4"]["env/observation_tokens_mean"] > 0
        assert not _close(res["env_micro4"], res["env_packed"], keys=ENV_KEYS)
        assert res["env_lora"]["kl/sequence_mean"] == 0.0
    assert one_rank["env_micro4"]["loss/value"] > 0 and one_rank["env_micro4"]["loss/policy"] != 0
    for name in ("env_micro4", "env_packed", "env_lora"):
        assert not _close(one_rank[name], two_ranks[name], keys=ENV_KEYS), name
    assert one_rank["env_packed"]["padding/update_positions_per_token"] == 1.0
