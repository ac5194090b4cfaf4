"""The `ppo` section: batch sizes, the estimator, KL and the losses of the algorithm (the
choices' tables are ds_ppo/algo/choices.py; the policy loss's keys: config/policy_loss.py)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ds_ppo.algo.choices import (ESTIMATORS, EntropyScope, EstimatorName, KLEstimator,
                                 LossAggregation, OldLogprobs, Placement, RolloutCorrection,
                                 Schedule, describe_estimators, max_lag)
from ds_ppo.config.policy_loss import PolicyLossFields
from ds_ppo.config.section_base import Section


class DistillConfig(Section):
    """On-policy distillation (ppo.advantage_estimator = distill, docs/GUIDE.md): each token the
    student samples gets the advantage log pi_teacher - log pi_student of that token (the
    sampled reverse KL, negated), optionally discounted, plus a task reward's group advantage."""

    discount: float = Field(
        0.0, ge=0, le=1, description="Discount of the per-token distillation rewards along the "
        "response: A_t = sum_{j >= t} discount^(j - t) (log pi_teacher(y_j) - log "
        "pi_student(y_j)). 0 (default): each token's own log-ratio, as on-policy distillation "
        "is usually run (Lu 2025); 1: the reverse KL of the rest of the response (an "
        "episode's observations take no step).")
    reward_coef: float = Field(
        0.0, ge=0, description="Mix a task reward in: advantage = the distillation advantage + "
        "reward_coef x the group advantage (reward_estimator) of the response's reward "
        "(reward.function / model / url, and an env's turn rewards), on every token, so "
        "'distil, then RL' is one run. 0: the reward is computed (metrics score/*) but not "
        "trained on. Needs ppo.samples_per_prompt >= 2.")
    reward_estimator: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo", description="The group estimator of the reward's part (reward_coef > 0): grpo "
        "(mean and std of the group), dr_grpo (mean), rloo (leave-one-out mean).")


class PPOConfig(PolicyLossFields):
    """The `ppo` section; the policy loss's keys (ppo.policy_loss, the clips) are in its base,
    config/policy_loss.py."""

    rollout_batch_size: int = Field(
        64, gt=0, description="Prompts per iteration, over all data-parallel ranks together.")
    mini_batch_size: int = Field(
        16, gt=0, description="Sequences (responses, not prompts) per optimizer step, over all "
        "ranks together.")
    micro_batch_size: int = Field(
        4, gt=0, description="Sequences per forward/backward on one rank; gradient accumulation "
        "= mini_batch_size / (micro_batch_size * world size).")
    score_micro_batch_size: int | None = Field(
        None, gt=0, description="Sequences per scoring forward on one rank; default micro_batch_size.")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="Token budget of a packed micro-batch (null: micro-batches of "
        "micro_batch_size / score_micro_batch_size rows, padded). Set: the policy, reference and "
        "value forwards of scoring and the update pack each mini-batch's rows, longest first, "
        "into micro-batches of at most this many real tokens (prompt + response; a longer row "
        "runs alone), each one sequence without padding; ranks with fewer micro-batches run "
        "zero-weight ones. micro_batch_size then only sets DeepSpeed's bookkeeping, and "
        "score_micro_batch_size only the reward model's micro-batches.")
    tiled_logits: Literal["auto"] | bool = Field(
        "auto", description="Log-probs and entropies of the policy and reference from the final "
        "hidden states, the output head applied logits_tile_tokens positions at a time (its "
        "backward recomputes each tile): no (B, T, V) logits tensor (16 GiB in fp32 for one "
        "32k-token response of a 128k vocabulary), the same numbers. auto: tiled when a "
        "forward's response logits would exceed 2^26 elements (positions x vocabulary; "
        "docs/PERFORMANCE.md, Long context).")
    logits_tile_tokens: int = Field(
        1024, gt=0, description="Positions per tile of tiled_logits: the tile's logits (tile x "
        "vocabulary, in fp32 about 4 bytes each, x2-3 while reduced) are the only vocabulary-wide "
        "tensors alive.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout; later passes re-mix "
                            "the mini-batches (the same samples in each at any world size).")
    value_clip_eps: float | None = Field(
        0.2, description="Value clip range around the old values (null: unclipped).")
    vf_coef: float = Field(0.5, gt=0, description="Value loss coefficient.")
    kl_coef: float = Field(0.1, ge=0, description="KL penalty coefficient in the reward "
                           "(the initial value when kl_controller=adaptive).")
    kl_estimator: KLEstimator = Field("k1", description="Per-token KL estimator (k1, k2, k3: "
                                      "Schulman 2020).")
    kl_clip: float | None = Field(
        10.0, gt=0, description="Cap on the per-token KL estimate, +-kl_clip nats, in the reward "
        "and in the KL loss (null: none). The log-ratio is clamped to +-20 nats first, so one "
        "tail token's k3 could reach e^20 = 4.9e8 (a reward of -2.4e7 at kl_coef 0.05); "
        "OpenRLHF caps every estimator at +-10, verl caps k3 at 10. A capped token carries no "
        "KL gradient; their share: metric kl/clamped_frac.")
    kl_controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: Ziegler et al. 2019 controller towards kl_target.")
    kl_target: float = Field(6.0, gt=0, description="Adaptive controller: target KL per sequence.")
    kl_horizon: int = Field(10000, gt=0, description="Adaptive controller: horizon in sequences.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    whiten_advantages: bool = Field(True, description="Whiten advantages over valid tokens "
                                    "(gae; reinforce_pp always whitens, grpo/dr_grpo/rloo never).")
    whiten_across_ranks: bool = Field(
        True, description="Whitening statistics over all ranks' tokens (else per rank).")
    advantage_estimator: EstimatorName = Field(
        "gae", description="How a response's tokens get their advantages (the table "
        "ds_ppo/algo/choices.py): " + describe_estimators() + ". Every estimator but gae is "
        "critic-free: no value model at all.")
    samples_per_prompt: int = Field(
        1, gt=0, description="Responses sampled per prompt (n); an iteration has "
        "rollout_batch_size x n responses, a prompt's n next to each other on one rank. "
        "mini_batch_size counts responses and must be a multiple of n.")
    kl_in_reward: bool = Field(
        True, description="KL penalty (kl_coef x per-token KL) in the reward. Default: true for "
        + ", ".join(n for n, s in ESTIMATORS.items() if s.kl_in_reward) + "; false for "
        + " and ".join(n for n, s in ESTIMATORS.items() if not s.kl_in_reward)
        + " (GRPO puts the KL in the loss: kl_loss_coef).")
    kl_loss_coef: float = Field(
        0.0, description="Weight of a KL(policy || reference) loss term (estimator kl_estimator; "
        "k3 is GRPO's), aggregated like the policy loss; 0 = off. Must be >= 0.")
    entropy_coef: float = Field(
        0.0, ge=0, description="Weight of an entropy bonus in the policy loss (PPO's c2, "
        "Schulman et al. 2017, Eq. 9; verl's entropy_coeff): the loss minus entropy_coef x the "
        "policy's entropy over the response tokens, aggregated like the policy loss "
        "(loss_aggregation; tiled like the log-probs), for every advantage_estimator. Keeps a "
        "policy that has found a reward from collapsing onto one answer (metric "
        "policy/entropy); 0 = off. Try 0.001-0.01: too large and the responses turn to noise. "
        "With entropy_target, the most the bonus's coefficient reaches.")
    entropy_target: float | None = Field(
        None, gt=0, description="Set the entropy bonus's coefficient (metric "
        "policy/entropy_coef) from the policy's entropy so that policy/entropy stays near this "
        "many nats per token: after each iteration entropy_coef x clip(1 - policy/entropy / "
        "entropy_target, 0, 1), so no bonus at or above the target and entropy_coef at entropy "
        "0; entropy_coef in the first iteration (ds_ppo/algo/entropy.py). Saved in checkpoints. "
        "null: a fixed coefficient entropy_coef. Needs entropy_coef > 0. The entropy settles "
        "below the target, where the bonus balances the policy gradient's sharpening: "
        "docs/RESULTS.md's lookup task uses 2.5 nats with entropy_coef 0.015. "
        "entropy_target_scope=token makes the target a floor on each token instead.")
    entropy_target_scope: EntropyScope = Field(
        "mean", description="What entropy_target is compared with. mean: policy/entropy, the "
        "mean over response tokens, sets the coefficient (entropy_target). token: each "
        "response token's entropy H_t, as a floor: the bonus weights that token by clip(1 - "
        "H_t / entropy_target, 0, 1) (held constant in the gradient) with the coefficient "
        "fixed at entropy_coef, so a collapsed token gets the whole bonus and one at or above "
        "the target none, whatever the other tokens' entropy (ds_ppo/algo/aggregation.py; "
        "metric policy/entropy_below_target, the share of tokens below it): a mean can stay "
        "high on random tokens while the token that decides the reward has collapsed, and an "
        "entropy above the target is never fed. docs/RESULTS.md's lookup task measures floors "
        "of 1, 2.5 and 4 nats.")
    rollout_correction: RolloutCorrection = Field(
        "none", description="Correct the policy loss for the gap between the distribution "
        "responses were sampled from (the generation replica: its kernels, dtype and batch "
        "shapes) and the trainer's (Yao et al. 2025, \"Your efficient RL framework secretly "
        "brings you off-policy RL training\"), with each token's ratio r = pi_old / "
        "pi_rollout: tis multiplies its policy loss by min(r, rollout_is_cap) (truncated "
        "importance sampling); mis drops the tokens whose r leaves [1/cap, cap] from the loss "
        "and weights the rest by r (masked importance sampling); none: off (the gap is still "
        "measured: metrics rollout/*). Needs the rollout log-probs of generation.loop=own.")
    old_logprobs: OldLogprobs = Field(
        "training", description="The PPO ratio's old log-probs: training = a scoring forward "
        "of the policy over the rollout; rollout = the log-probs the sampler drew each token "
        "with (generation.loop=own), which skips that forward (one policy forward over every "
        "sequence per iteration; verl's rollout-correction bypass mode). The trainer shapes its "
        "logits as the sampler did (temperature, the suppressed pad, min_new_tokens, stop "
        "tokens, top-k, top-p), so with any sampling setting and in multi-turn episodes the two "
        "are the same distribution: on CPU in float32 equal up to kernel rounding; on a GPU the "
        "replica's 16-bit kernels differ, and the first step's ratio absorbs that gap (the "
        "behaviour policy is the sampler's). Not with ppo.rollout_correction (it compares the "
        "two). policy/entropy is then measured in the first PPO epoch's forwards (not in critic "
        "warm-up iterations).")
    router_replay: bool = Field(
        False, description="A mixture-of-experts policy: the decoding loop records each "
        "token's chosen experts (top-k indices per MoE layer, prompt and response tokens) and "
        "the policy's scoring and update forwards route every token to those experts (R3, Ma et "
        "al. 2025); the gate weights stay differentiable (the router's softmax at the chosen "
        "experts). Without it, a token the trainer routes elsewhere than the sampler did gets "
        "a ratio between two different computations. Metric rollout/route_flip_frac: the share "
        "of tokens whose own routing would differ. Needs generation.loop=own, a replica "
        "(generation.mode gathered or tensor_parallel), deepspeed.sequence_parallel_size 1.")
    rollout_is_cap: float = Field(
        2.0, gt=1, description="ppo.rollout_correction: the cap C of the importance weights "
        "(tis: min(r, C); mis: the band [1/C, C]).")
    schedule: Schedule = Field(
        "sync", description="When rollouts are generated (docs/ASYNC.md): sync = generate, "
        "score and train in turn, on-policy; one_step_off = the next iteration's rollout is "
        "generated (and its reward function called) in a background worker on the generation "
        "replica while this iteration scores and trains, with the weights this iteration "
        "started from (every sample one update old); async = the replica refreshed every "
        "max_staleness updates, each refresh generating the next max_staleness rollouts in one "
        "go, their reward calls overlapping (samples up to max_staleness updates old). "
        "Off-policy schedules need ppo.rollout_correction (tis or mis) or "
        "ppo.old_logprobs=rollout.")
    max_staleness: int = Field(
        1, ge=0, le=64, description="schedule=async: the most updates a sample's weights may "
        "lag the weights it trains (0: generated after the previous update, the same updates as "
        "sync); a buffered sample older than this after a resume is regenerated "
        "(metric async/regenerated). Ignored (a warning) with sync and one_step_off, whose lag "
        "is fixed (0 and 1).")
    partial_rollouts: bool = Field(
        False, description="schedule=async with max_staleness N >= 2: every iteration refreshes "
        "the replica and the worker decodes the next segment (max_new_tokens / N tokens) of "
        "each of the N rollouts in flight, so a sequence keeps its tokens across a weight update "
        "and continues with the new weights (its KV cache rebuilt by a prefill of prompt and "
        "tokens so far). Each token records the version that sampled it and its sampler "
        "log-prob, which ppo.rollout_correction uses per token; tokens are 1 to N updates old, "
        "later tokens newer. Not with an env section or ppo.router_replay (docs/ASYNC.md, "
        "Partial rollouts).")
    placement: Placement = Field(
        "colocated", description="Which ranks generate (docs/ASYNC.md): colocated = every rank "
        "trains and, under an off-policy schedule, generates in a background worker on a 16-bit "
        "replica beside its training states; split = the last generation_ranks ranks only "
        "generate (a 16-bit replica and the reward function's calls, no ZeRO engine) and the "
        "others only train, their ZeRO states partitioned over the training ranks alone (the "
        "batch sizes then divide by the training ranks). split needs an off-policy schedule "
        "(one_step_off, or async with max_staleness >= 1). `ds-ppo plan` sizes both.")
    generation_ranks: int = Field(
        1, ge=1, le=65536, description="placement=split: how many ranks only generate (the "
        "last ones of the world; each serves whole training ranks, so at most the training "
        "ranks' count). Ignored with placement=colocated.")
    loss_aggregation: LossAggregation = \
        Field("token_mean", description="Policy (and KL) loss over a mini-batch: token_mean = "
              "mean over all its tokens; seq_mean_token_mean = mean over sequences of each "
              "one's token mean (GRPO); seq_mean_token_sum_norm = mean over sequences of each "
              "one's token sum / generation.max_new_tokens (Dr. GRPO). The value loss is always "
              "a token mean. Default: the policy loss's (policy_loss; seq_mean_token_mean for "
              "gspo, gspo_token, gmpo and sapo, token_mean otherwise).")
    critic_warmup_iterations: int = Field(
        0, ge=0, description="The first N iterations train the value model only (gae): the "
        "policy generates but takes no optimizer step (OpenRLHF's freezing_actor_steps, verl's "
        "critic_warmup), so a critic started from a reward model or the policy learns the "
        "returns before its advantages steer the policy. They count towards `iterations` and "
        "use prompts like any other; metric value/warmup is 1 in them.")
    ptx_coef: float = Field(
        0.0, ge=0, description="PPO-ptx (InstructGPT, Ouyang et al. 2022, eq. 2): weight of a "
        "language-modelling loss on data.ptx_path's rows added to the policy loss in every "
        "mini-batch (each optimizer step takes mini_batch_size ptx rows, split over the ranks; "
        "the loss is a token mean over the whole global mini-batch's ptx tokens). 0 = off.")
    filter_zero_std_groups: bool = Field(
        False, description="Leave groups whose n scores are all equal out of the update (DAPO's "
        "dynamic sampling, simplest form; their share: metric group/zero_std_frac).")

    zero_std_advantage: float = Field(
        0.0, ge=0, description="grpo, dr_grpo, rloo: a group whose scores are all equal "
        "(group/zero_std_frac) has advantage 0, so an answer the policy always gives for a "
        "prompt is never pushed up or down again. With this > 0 each response of such a group "
        "gets zero_std_advantage x its score whitened over the whole batch (all ranks: the "
        "batch's mean as its baseline, over the batch's std) instead: an answer that is always "
        "wrong is pushed down, and the probability it loses goes to the other answers, the "
        "right one among them; one that is always right is kept up. The groups with a spread "
        "keep their own advantages. The lookup preset uses 1.0 (0.25 was too little there: "
        "docs/RESULTS.md); 0 = off, the estimators as published.")

    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling with refill (Yu et al. 2025): generate "
        "rounds of rollout_batch_size prompts (samples_per_prompt responses each, scored by the "
        "reward) until the iteration holds rollout_batch_size prompts whose responses do not all "
        "score alike, and train on the first of those in draw order (the same batch at any world "
        "size; prompts drawn but not taken are skipped). A group whose scores are equal teaches "
        "a group estimator nothing unless ppo.zero_std_advantage gives it a batch baseline. "
        "Costs extra generation rounds (metrics sampling/*); the stream position is saved in "
        "checkpoints.")
    dynamic_sampling_max_rounds: int = Field(
        4, gt=0, le=64, description="dynamic_sampling: the most generation rounds per iteration "
        "(at most 64: every round's rollout is held until the batch is full); when they run "
        "out, the batch is completed with the earliest groups without signal (metric "
        "sampling/filled_frac). Ignored without dynamic_sampling.")

    @model_validator(mode="before")
    @classmethod
    def _estimator_defaults(cls, data: Any) -> Any:
        # kl_in_reward's default depends on the estimator (GRPO and Dr. GRPO: KL in the loss)
        spec = ESTIMATORS.get(data.get("advantage_estimator")) if isinstance(data, dict) else None
        if spec is not None and "kl_in_reward" not in data and not spec.kl_in_reward:
            data = {**data, "kl_in_reward": False}
        return data

    @property
    def max_lag(self) -> int:
        """The most updates a sample's weights may lag the weights that train on it under this
        schedule (algo/choices.max_lag: 0 sync, 1 one_step_off, max_staleness async): the one
        place the run, the checks and the planner read it."""
        return max_lag(self.schedule, self.max_staleness)

    @property
    def uses_critic(self) -> bool:
        """True when the estimator needs a value model (gae; algo/choices.ESTIMATORS)."""
        return ESTIMATORS[self.advantage_estimator].critic

    def problems(self) -> list[str]:
        p, n, out = self, self.samples_per_prompt, self.policy_loss_problems()
        if ESTIMATORS[p.advantage_estimator].teacher and p.kl_in_reward:
            out.append(f"ppo.kl_in_reward = true with ppo.advantage_estimator = "
                       f"{p.advantage_estimator!r}, whose advantages are not returns of a "
                       "reward: set ppo.kl_in_reward=false and a KL toward the reference with "
                       "ppo.kl_loss_coef (e.g. 0.01)")
        if ESTIMATORS[p.advantage_estimator].groups and n < 2:
            out.append(f"ppo.advantage_estimator = {p.advantage_estimator!r} compares the "
                       f"responses to one prompt, but ppo.samples_per_prompt = {n}: set "
                       "ppo.samples_per_prompt=4 (any n >= 2)")
        if p.kl_loss_coef < 0:
            out.append(f"ppo.kl_loss_coef = {p.kl_loss_coef} must be >= 0 (0 = no KL loss term)")
        if p.clip_eps_high is not None and p.clip_eps_high <= 0:
            out.append(f"ppo.clip_eps_high = {p.clip_eps_high} must be > 0, or null for the "
                       "same as ppo.clip_eps")
        if p.dual_clip is not None and p.dual_clip <= 1:
            out.append(f"ppo.dual_clip = {p.dual_clip} must be > 1 (e.g. 3.0), or null to turn "
                       "the dual clip off")
        if p.value_clip_eps is not None and p.value_clip_eps <= 0:
            out.append(f"ppo.value_clip_eps = {p.value_clip_eps} must be > 0 or null")
        if p.entropy_target is not None and p.entropy_coef <= 0:
            out.append(f"ppo.entropy_target = {p.entropy_target:g} steers the entropy bonus's "
                       "coefficient up to ppo.entropy_coef, which is 0: set ppo.entropy_coef "
                       "> 0 (e.g. 0.005), or ppo.entropy_target=null")
        if p.entropy_target_scope == "token" and p.entropy_target is None:
            out.append("ppo.entropy_target_scope = 'token' weights each token's entropy by how "
                       "far it is below ppo.entropy_target, which is null: set "
                       "ppo.entropy_target (nats per token, e.g. 4.0) and ppo.entropy_coef > 0")
        if p.dynamic_sampling and n < 2:
            out.append("ppo.dynamic_sampling = true keeps groups whose responses score "
                       "differently: set ppo.samples_per_prompt >= 2 (e.g. 4)")
        if p.filter_zero_std_groups and n < 2:
            out.append("ppo.filter_zero_std_groups = true needs groups: set "
                       "ppo.samples_per_prompt >= 2")
        if p.zero_std_advantage > 0 and not ESTIMATORS[p.advantage_estimator].groups:
            out.append(f"ppo.zero_std_advantage = {p.zero_std_advantage:g} gives the groups "
                       "whose scores are all equal a batch baseline, but "
                       f"ppo.advantage_estimator = {p.advantage_estimator!r} has no groups: "
                       "use grpo, dr_grpo or rloo, or set it to 0")
        if p.zero_std_advantage > 0 and p.filter_zero_std_groups:
            out.append(f"ppo.zero_std_advantage = {p.zero_std_advantage:g} trains on the groups "
                       "whose scores are all equal, which ppo.filter_zero_std_groups = true "
                       "leaves out: set one of them off")
        if p.critic_warmup_iterations and not p.uses_critic:
            out.append(f"ppo.critic_warmup_iterations = {p.critic_warmup_iterations} warms up "
                       f"a value model, but ppo.advantage_estimator = "
                       f"{p.advantage_estimator!r} has none: set it to 0, or use "
                       "ppo.advantage_estimator=gae")
        if p.old_logprobs == "rollout" and p.rollout_correction != "none":
            out.append(f"ppo.rollout_correction = {p.rollout_correction!r} weighs the "
                       "trainer's old log-probs against the sampler's, but ppo.old_logprobs = "
                       "'rollout' makes them the same (every weight 1): set "
                       "ppo.rollout_correction=none, or ppo.old_logprobs=training")
        if p.placement == "split" and p.max_lag == 0:
            out.append(f"ppo.placement = 'split' generates on ranks of its own while the others "
                       f"train, but ppo.schedule = {p.schedule!r}"
                       + (" with ppo.max_staleness = 0" if p.schedule == "async" else "")
                       + " makes each rollout wait for the previous update (the generation "
                       "ranks would idle): set ppo.schedule=one_step_off (or async with "
                       "ppo.max_staleness >= 1), or ppo.placement=colocated")
        if p.partial_rollouts and (p.schedule != "async" or p.max_staleness < 2):
            out.append(f"ppo.partial_rollouts = true continues sequences across the weight "
                       f"updates of ppo.schedule=async, but ppo.schedule = {p.schedule!r}"
                       + (f" with ppo.max_staleness = {p.max_staleness}"
                          if p.schedule == "async" else "")
                       + " decodes every rollout with one version's weights: set "
                       "ppo.schedule=async with ppo.max_staleness >= 2 (e.g. 2), or "
                       "ppo.partial_rollouts=false")
        if p.partial_rollouts and p.router_replay:
            out.append("ppo.partial_rollouts = true with ppo.router_replay = true: a continued "
                       "sequence's expert choices are not joined across segments (not supported "
                       "yet); set ppo.partial_rollouts=false")
        return out
