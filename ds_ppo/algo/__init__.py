"""Pure PPO math for LLM RLHF: masks and masked statistics, KL estimators and
controllers, reward shaping, GAE, policy/value losses, log-probs from logits.

Free functions over (B, T) response-token tensors (B = sequences, T = response
tokens) with ``mask`` True on tokens that count. Imports only torch: no deepspeed,
no transformers, no trainer state.

Decoding: decode_attention_mask, block_tokens -> filter_logits -> next_tokens (sampling on the
device, no host sync).

Data flow: response_mask -> logprobs_from_logits (or tiled_logprobs from hidden states: no
(B, T, V) logits for long responses) -> shape_rewards -> gae ->
masked_whiten -> policy_loss / value_loss -> explained_variance (metrics).
Critic-free (group.py, aggregation.py): group_advantages (GRPO, Dr. GRPO, RLOO) or
discounted_returns (REINFORCE++) -> policy_loss with loss_token_weights (+ kl_loss).
"""

from .gae import gae, gae_blocked, gae_loop, gae_matmul
from .aggregation import (LOSS_AGGREGATIONS, LossAggregation, kl_loss, loss_divisor,
                          loss_token_weights)
from .group import (GROUP_METHODS, GroupMethod, broadcast_to_tokens, discounted_returns,
                    group_advantages, group_score_stats)
from .kl import (KL_ESTIMATORS, LOG_RATIO_CLAMP, AdaptiveKLController, FixedKLController,
                 KLEstimator, kl_estimate, log_ratio_clamped)
from .logits import entropy_from_logits, logprobs_from_logits
from .tiled import tiled_logprobs
from .losses import policy_loss, value_loss
from .masks import decode_attention_mask, last_valid_index, response_mask
from .packing import (PackedLayout, additive_mask, block_causal_mask, cumulative_lengths,
                      packed_layout, response_predictors, token_budget_batches, unpack)
from .shaping import shape_rewards
from .sampling import block_tokens, filter_logits, next_tokens, sample_from_logits
from .stats import explained_variance, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "GROUP_METHODS",
    "GroupMethod",
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "broadcast_to_tokens",
    "discounted_returns",
    "group_advantages",
    "group_score_stats",
    "kl_loss",
    "loss_divisor",
    "loss_token_weights",
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "block_tokens",
    "decode_attention_mask",
    "entropy_from_logits",
    "explained_variance",
    "filter_logits",
    "gae",
    "gae_blocked",
    "gae_loop",
    "gae_matmul",
    "PackedLayout",
    "additive_mask",
    "block_causal_mask",
    "cumulative_lengths",
    "packed_layout",
    "response_predictors",
    "token_budget_batches",
    "unpack",
    "kl_estimate",
    "last_valid_index",
    "log_ratio_clamped",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_tokens",
    "policy_loss",
    "response_mask",
    "sample_from_logits",
    "shape_rewards",
    "tiled_logprobs",
    "value_loss",
]
