"""Pure PPO math for LLM RLHF: masks and masked statistics, KL estimators and
controllers, reward shaping, GAE, policy/value losses, log-probs from logits.

Names are loaded lazily (PEP 562): `ds_ppo.algo.choices`, the table of named choices
(estimators, KL estimators, loss aggregations) that the config reads, imports no torch.

Free functions over (B, T) response-token tensors (B = sequences, T = response
tokens) with ``mask`` True on tokens that count. Imports only torch: no deepspeed,
no transformers, no trainer state.

Decoding: decode_attention_mask, shape_logits (a LogitShape: block_tokens -> filter_logits) ->
next_tokens (sampling on the device, no host sync). The trainer's log-probs, entropy and KL
shape their logits with the same shape_logits, so they are of the distribution sampled.

Data flow: response_mask -> logprobs_from_logits (or tiled_logprobs from hidden states: no
(B, T, V) logits for long responses) -> shape_rewards -> gae ->
masked_whiten -> policy_loss_for (ppo.policy_loss: PPO's clip in losses.py, GSPO, CISPO,
GMPO, SAPO in policy_losses.py) / value_loss -> explained_variance (metrics).
Critic-free (group.py, aggregation.py): group_advantages (GRPO, Dr. GRPO, RLOO) or
discounted_returns (REINFORCE++) -> policy_loss with loss_token_weights (+ kl_loss,
- entropy_bonus, its coefficient from EntropyController).
On-policy distillation (distill.py, Agarwal et al. 2024; Lu 2025): distill_rewards (teacher minus
student log-prob of each sampled token) -> distill_advantages (discounted by distill.discount) ->
policy_loss, plus a group advantage of the reward (estimators.py, `distill`).
Rollout correction (importance_sampling.py, Yao et al. 2025): rollout_mismatch (sampler vs trainer
log-probs) -> rollout_is_weights (TIS / MIS) -> policy_loss token_weights.
Supervised jobs (supervised_losses.py): nll_sum (SFT), bradley_terry + reward_centering + pair_stats
(reward model).
"""

import importlib

# exported name -> the module (in this package) that defines it
_EXPORTS = {
    "AdaptiveKLController": "kl",
    "additive_mask": "packing",
    "advantages_for": "estimators",
    "block_causal_mask": "packing",
    "block_tokens": "distribution",
    "bradley_terry": "supervised_losses",
    "broadcast_to_tokens": "group",
    "cumulative_lengths": "packing",
    "decode_attention_mask": "masks",
    "discounted_returns": "group",
    "distill_advantages": "distill",
    "distill_rewards": "distill",
    "entropy_bonus": "aggregation",
    "EntropyController": "entropy",
    "entropy_from_logits": "logits",
    "estimator": "choices",
    "ESTIMATORS": "choices",
    "EstimatorSpec": "choices",
    "explained_variance": "stats",
    "filter_logits": "distribution",
    "from_model_tokens": "turns",
    "FixedKLController": "kl",
    "gae": "returns",
    "gae_blocked": "returns",
    "gae_loop": "returns",
    "gae_matmul": "returns",
    "group_advantages": "group",
    "is_prefix": "turns",
    "GROUP_METHODS": "group",
    "group_score_stats": "group",
    "GroupMethod": "group",
    "kl_clamped": "kl",
    "KL_CLIP": "kl",
    "kl_estimate": "kl",
    "KL_ESTIMATORS": "kl",
    "kl_loss": "aggregation",
    "KLEstimator": "kl",
    "last_valid_index": "masks",
    "lm_loss": "losses",
    "LOG_RATIO_CLAMP": "kl",
    "log_ratio_clamped": "kl",
    "logprobs_from_logits": "logits",
    "LogitShape": "distribution",
    "LOSS_AGGREGATIONS": "aggregation",
    "loss_divisor": "aggregation",
    "loss_token_weights": "aggregation",
    "LossAggregation": "aggregation",
    "masked_mean": "stats",
    "masked_sum": "stats",
    "masked_var": "stats",
    "masked_whiten": "stats",
    "model_token_order": "turns",
    "next_tokens": "sampling",
    "next_tokens_with_logprobs": "sampling",
    "nll_sum": "supervised_losses",
    "pair_stats": "supervised_losses",
    "OLD_LOGPROBS": "choices",
    "OldLogprobs": "choices",
    "packed_layout": "packing",
    "PackedLayout": "packing",
    "policy_loss": "losses",
    "policy_loss_for": "policy_losses",
    "policy_loss_spec": "choices",
    "POLICY_LOSSES": "choices",
    "PolicyLossInputs": "policy_losses",
    "PolicyLossOut": "policy_losses",
    "PolicyLossSettings": "policy_losses",
    "PolicyLossSpec": "choices",
    "response_mask": "masks",
    "response_predictors": "packing",
    "ROLLOUT_CORRECTIONS": "choices",
    "reward_centering": "supervised_losses",
    "rollout_is_weights": "importance_sampling",
    "rollout_mismatch": "importance_sampling",
    "RolloutCorrection": "choices",
    "sample_from_logits": "sampling",
    "shape_logits": "distribution",
    "shape_rewards": "shaping",
    "to_model_tokens": "turns",
    "tiled_logprobs": "tiled",
    "token_budget_batches": "packing",
    "turn_ends": "turns",
    "turn_token_index": "turns",
    "unpack": "packing",
    "value_loss": "losses",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
