"""Critic-free advantage estimators: group baselines over several responses to one prompt, and
discounted returns for REINFORCE++.

Group layout: scores (B,) hold B / n groups of n = ``group_size`` responses to the same prompt,
contiguous: rows g*n .. g*n + n - 1 are group g. Every reduction here is per-rank (a group never
spans ranks), except the whitening REINFORCE++ applies afterwards (``masked_whiten``).

Imports only torch.
"""

from typing import Literal, get_args

import torch

from .turns import from_model_tokens, is_prefix, model_token_order, to_model_tokens
from .returns import BLOCKED_ABOVE, gae_blocked

GroupMethod = Literal["grpo", "dr_grpo", "rloo"]
GROUP_METHODS: tuple[str, ...] = get_args(GroupMethod)


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B / n, n); ValueError when B is not a multiple of n."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"the batch of {scores.shape[0]} scores is not a whole number of groups "
                         f"of group_size = {group_size}")
    return scores.reshape(-1, group_size)


def group_advantages(scores: torch.Tensor, group_size: int, method: GroupMethod,
                     eps: float = 1e-6) -> torch.Tensor:
    """One advantage per response from its group's scores, no critic.

    - ``grpo`` (Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2, outcome supervision):
      A_i = (s_i - mean(s)) / (std(s) + eps), std with Bessel's correction (torch.std's
      default); a group of one has std 0 and gives 0.
    - ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3.2):
      A_i = s_i - mean(s): GRPO without the std division (its question-difficulty bias).
    - ``rloo`` (Ahmadian et al. 2024, "Back to Basics", Eq. 5): A_i = s_i - mean_{j != i} s_j,
      the leave-one-out baseline; = n / (n - 1) * (s_i - mean(s)).

    A group whose scores are all equal gives zeros (never NaN): it carries no signal.

    Args:
        scores: (B,) float sequence scores (e.g. KL-shaped sequence rewards), contiguous groups.
        group_size: n, responses per prompt; B must be a multiple of it (rloo needs n >= 2).
        method: "grpo", "dr_grpo" or "rloo".
        eps: added to the std (grpo only).

    Returns:
        (B,) advantages in scores' dtype, in row order. Broadcast them to a response's tokens
        with ``broadcast_to_tokens``.
    """
    if method not in GROUP_METHODS:
        raise ValueError(f"unknown group method {method!r}; valid: {', '.join(GROUP_METHODS)}")
    if method == "rloo" and group_size < 2:
        raise ValueError("rloo needs group_size >= 2 (the baseline is the mean of the other "
                         f"responses of the group), got {group_size}")
    g = _groups(scores, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if method == "dr_grpo":
        adv = centred
    elif method == "rloo":
        adv = centred * (group_size / (group_size - 1))
    else:
        std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        adv = centred / (std + eps)
    # exact zeros for a constant group (the mean may differ from the scores by rounding)
    constant = (g == g[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv).reshape(-1)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence values -> (B, T): the value on every valid token, 0 outside the mask."""
    mask = mask.bool()
    out = seq_values.unsqueeze(-1).expand(mask.shape)
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def group_score_stats(scores: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group spread of the scores (per-rank).

    Args:
        scores: (B,) float, contiguous groups of ``group_size``.

    Returns:
        (std, constant): (B / n,) float64 std of each group (Bessel; 0 for n = 1) and (B / n,)
        bool, True where every score of the group is equal (no signal for a group baseline;
        DAPO's dynamic sampling, Yu et al. 2025, drops them).
    """
    g = _groups(scores.double(), group_size)
    std = g.std(dim=1) if group_size > 1 else torch.zeros_like(g[:, 0])
    return std, (g == g[:, :1]).all(dim=1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-token returns G_t = r_t + gamma * G_{t+1} inside the mask, 0 outside.

    REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", Sec. 3) takes them as advantages of the KL-shaped per-token rewards, then
    whitens them over the global batch. G is 0 at every masked position, so values of
    ``rewards`` outside the mask never leak in. A hole in a row's mask (a multi-turn episode's
    observation) is no step: the sum and the discount carry across it (``algo.turns``).

    Args:
        rewards: (B, T) float per-token rewards (e.g. from ``shape_rewards``).
        mask: (B, T) bool/0-1, True on response tokens that count.
        gamma: discount per token, in [0, 1].

    Returns:
        (B, T) returns in rewards' dtype.
    """
    mask = mask.bool()
    if not is_prefix(mask):  # a multi-turn episode: the observations take no step
        order = model_token_order(mask)
        return from_model_tokens(discounted_returns(to_model_tokens(rewards, order),
                                                    to_model_tokens(mask, order), gamma), order)
    r = torch.where(mask, rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    T = r.shape[-1]
    if T > BLOCKED_ABOVE:  # long responses: GAE with lambda = 1 and no values is exactly G,
        # scanned in blocks in O(B T) memory (the (T, T) matrix below: 8 GiB at T = 32768)
        return gae_blocked(r, torch.zeros_like(r), mask, gamma, 1.0)[0]
    # prefix masks: G = r @ D with D[j, t] = gamma^(j - t) for j >= t, in float64 (as
    # gae_matmul: one matmul instead of T small steps)
    idx = torch.arange(T, device=r.device)
    exponent = (idx.unsqueeze(1) - idx.unsqueeze(0)).double()  # [j, t] = j - t
    discount = torch.where(exponent >= 0,
                           torch.full_like(exponent, float(gamma)).pow(exponent.clamp(min=0)),
                           torch.zeros_like(exponent))
    returns = (r.double() @ discount).to(rewards.dtype)
    return torch.where(mask, returns, torch.zeros_like(returns))
