"""The names of the metrics each job can log (docs/METRICS.md says what each one means), named
once for the settings that name a metric: tracking.alarms.watch and checkpoint.keep_best.
tests/unit/test_metric_names.py checks that this list and docs/METRICS.md's name the same
metrics, and the end-to-end runs that every metric they log is in docs/METRICS.md. Imports only
the standard library.
"""
from __future__ import annotations

# `ds-ppo train`: every metric of docs/METRICS.md above its supervised-jobs section
PPO_METRICS = frozenset({
    # rollout and rewards
    "score/mean", "score/std", "reward/mean", "reward/std", "reward/input_cut_rate",
    "kl/sequence_mean", "kl/token_mean", "kl/clamped_frac", "kl_coef", "response/length_mean",
    "response/length_max", "response/eos_rate", "response/tokens_total", "reward/retries",
    "score/group_std_mean", "group/zero_std_frac", "advantage/zero_frac",
    # on-policy distillation (ppo.advantage_estimator = distill)
    "distill/reverse_kl", "distill/teacher_logprob", "distill/top1_match",
    # sampler against trainer
    "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/kl_k3",
    "rollout_is/weight_mean", "rollout_is/clipped_frac", "rollout/route_flip_frac",
    "generation/slot_utilisation",
    # multi-turn episodes (and env/<key>: ENV_PREFIX)
    "env/turns_mean", "env/observations_mean", "env/done_frac", "env/truncated_frac",
    "env/out_of_turns_frac", "env/model_tokens_mean", "env/observation_tokens_mean",
    "env/calls", "env/retries", "env/generate_calls", "time/env_s",
    # rollout schedule
    "async/staleness_mean", "async/staleness_max", "async/token_staleness_mean",
    "async/token_staleness_max", "async/off_policy_token_share", "async/continued_token_share",
    "async/queue_depth", "async/regenerated", "async/dropped", "async/training_wait_s",
    "async/training_idle_frac", "async/generation_idle_frac", "async/weight_sync_s",
    "async/weight_sync_bytes",
    # update
    "loss/policy", "loss/value", "loss/ptx", "loss/kl", "loss/entropy", "policy/moe_aux_loss",
    "value/moe_aux_loss", "policy/grad_norm", "value/grad_norm", "policy/entropy",
    "policy/entropy_coef", "policy/approx_kl", "policy/clip_frac", "policy/ratio_mean",
    "policy/ratio_clamped_frac", "policy/seq_clip_frac", "policy/seq_ratio_mean",
    "policy/gate_weight_mean", "value/values_mean", "value/vf_clip_frac",
    "value/explained_variance", "value/warmup", "ema/distance", "lr/policy", "lr/value",
    # time, throughput and memory
    "time/generation_s", "time/scoring_s", "time/update_s", "time/reward_s", "time/iteration_s",
    "tokens_per_s/generation", "tokens_per_s/scoring", "tokens_per_s/update",
    "tokens_per_s/iteration", "padding/scoring_positions_per_token",
    "padding/update_positions_per_token", "memory/peak_gib", "memory/peak_rss_gib",
    # evaluation
    "eval/score_mean", "eval/score_std", "eval/length_mean", "eval/eos_rate",
    "eval_ema/score_mean", "eval_ema/score_std", "eval_ema/length_mean", "eval_ema/eos_rate",
    # dynamic sampling
    "sampling/rounds", "sampling/prompts_drawn", "sampling/kept_frac", "sampling/filled_frac",
    # alarms
    "alarm/entropy", "alarm/zero_std", "alarm/drop",
})

# env/<key>: an environment's own numbers (its Step.info keys), named by the environment
ENV_PREFIX = "env/"

# `ds-ppo sft`, `ds-ppo rm` and `ds-ppo dpo`: the step's statistics (docs/METRICS.md, supervised jobs)
SUPERVISED_METRICS = {
    "sft": frozenset({"loss/sft", "sft/moe_aux_loss", "sft/grad_norm", "lr/sft", "sft/epoch",
                      "time/step_s", "eval/loss", "eval/perplexity"}),
    "rm": frozenset({"loss/rm", "rm/center", "rm/accuracy", "rm/ties", "rm/margin_mean",
                     "rm/chosen_mean", "rm/rejected_mean", "rm/moe_aux_loss", "rm/grad_norm",
                     "lr/rm", "rm/epoch", "time/step_s", "eval/loss", "eval/accuracy",
                     "eval/ties", "eval/margin_mean", "eval/center", "eval/chosen_mean",
                     "eval/rejected_mean"}),
    "dpo": frozenset({"loss/dpo", "dpo/reward_accuracy", "dpo/reward_margin",
                      "dpo/chosen_reward", "dpo/rejected_reward", "dpo/chosen_logp",
                      "dpo/rejected_logp", "dpo/moe_aux_loss", "dpo/grad_norm", "lr/dpo",
                      "dpo/epoch", "time/step_s", "eval/loss", "eval/reward_accuracy",
                      "eval/reward_margin", "eval/chosen_reward", "eval/rejected_reward",
                      "eval/chosen_logp", "eval/rejected_logp"}),
}


def job_metrics(job: str) -> frozenset[str]:
    """The metric names job `job` (ppo, sft, rm, dpo) can log, env/<key> left out (`is_logged`)."""
    return PPO_METRICS if job == "ppo" else SUPERVISED_METRICS[job]


def is_logged(name: str, job: str) -> bool:
    """Whether job `job` can log metric `name`: one of its names, or (ppo) an env/<key>."""
    if job == "ppo" and name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
        return True
    return name in job_metrics(job)
