"""Generalised Advantage Estimation over response tokens.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
Advantage Estimation", Eq. 16:
    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = sum_{l >= 0} (gamma * lam)^l * delta_{t+l}
    R_t     = A_t + V_t            (the value target, "returns")

Each response is one episode of T token-actions; the state after the last valid
token (EOS, or truncation at T) is terminal: V = 0 there (the sequence score has
already been paid as the last token's reward). A multi-turn response's mask has holes
(the environment's observations): the recursion runs over the model's tokens only, the
value after a turn's last token being the next turn's first (``algo.turns``).

Imports only torch.
"""

import torch

from .turns import from_model_tokens, is_prefix, model_token_order, to_model_tokens


def _masked_inputs(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = mask.bool()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    # Zero everything outside the mask so garbage there (pad positions) cannot leak,
    # and so that V after the last valid token is 0: the terminal value.
    return torch.where(mask, rewards, zero), torch.where(mask, values.to(rewards.dtype), zero), mask


def _td_errors(rewards: torch.Tensor, values: torch.Tensor, gamma: float) -> torch.Tensor:
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    return rewards + gamma * next_values - values


def _masked_outputs(advantages: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns = advantages + values), both 0 outside the mask."""
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    return advantages, torch.where(mask, advantages + values, torch.zeros_like(advantages))


def gae_loop(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference GAE: the textbook reverse loop over T. Same contract as ``gae``."""
    rewards, values, mask = _masked_inputs(rewards, values, mask)
    deltas = _td_errors(rewards, values, gamma)
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[:, 0])
    for t in reversed(range(deltas.shape[1])):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    return _masked_outputs(advantages, values, mask)


def _discount_hankel(c: float, n: int, device) -> torch.Tensor:
    """(n, n) float64 Hankel matrix H[a, t] = c^(n-1-a-t) if a + t <= n-1 else 0, as sliding
    windows over [c^(n-1), ..., c^1, c^0, 0, ..., 0]: each power computed directly."""
    exponents = torch.arange(n - 1, -1, -1, dtype=torch.float64, device=device)
    powers = torch.full((n,), c, dtype=torch.float64, device=device).pow(exponents)
    padded = torch.cat([powers, torch.zeros(n - 1, dtype=torch.float64, device=device)])
    return padded.unfold(0, n, 1)


def gae_matmul(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised GAE as one (B, T) x (T, T) matmul. Same contract as ``gae``.

    A[b, t] = sum_{j >= t} c^(j - t) * delta[b, j], c = gamma * lam. Each power c^k is
    computed directly, so a small c only underflows terms that are truly negligible
    (unlike the cumsum trick A_t = c^-t * sum_j c^j delta_j, whose c^-t overflows).
    Done in float64: exact to float32 precision, and immune to TF32 matmuls enabled
    globally on GPUs. Memory O(T^2) (T = 4096 -> 128 MiB), cost O(B T^2).
    """
    rewards, values, mask = _masked_inputs(rewards, values, mask)
    deltas = _td_errors(rewards, values, gamma)
    # with j = T-1-a, H[a, t] is the discount c^(j - t) for j >= t, so A = flip(delta) @ H
    hankel = _discount_hankel(gamma * lam, deltas.shape[1], deltas.device)
    advantages = (deltas.double().flip(-1) @ hankel).to(deltas.dtype)
    return _masked_outputs(advantages, values, mask)


def gae_blocked(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as a reverse scan over blocks of ``block`` steps, each block one small matmul.
    Same contract as ``gae``.

    For a block [s, e): A_t = sum_{s <= t <= j < e} c^(j - t) delta_j + c^(e - t) A_e,
    c = gamma * lam: the in-block part is ``gae_matmul``'s (b, b) Hankel product, and the
    accumulator A_e (the advantage at the next block's first step, 0 after the last block)
    is carried from block to block. float64 throughout, like ``gae_matmul``. Memory
    O(B T + block^2) (T = 32768: a few MiB, where one (T, T) matrix needs 8 GiB); cost
    O(B T block) plus T / block sequential steps.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    rewards, values, mask = _masked_inputs(rewards, values, mask)
    deltas = _td_errors(rewards, values, gamma).double()
    B, T = deltas.shape
    device = deltas.device
    c = gamma * lam
    b = min(block, T)
    hankel = _discount_hankel(c, b, device).contiguous()  # (b, b), as in gae_matmul
    # carry[i] = c^(n - i) for a block of n steps: the weight of A_e at step s + i
    carry_powers = torch.full((b,), c, dtype=torch.float64, device=device).pow(
        torch.arange(b, 0, -1, dtype=torch.float64, device=device))
    advantages = torch.empty_like(deltas)
    carry = torch.zeros(B, dtype=torch.float64, device=device)  # A_e
    for e in range(T, 0, -b):
        s = max(0, e - b)
        n = e - s
        local = deltas[:, s:e].flip(-1) @ hankel[b - n:, :n]  # (B, n): the in-block sums
        advantages[:, s:e] = local + carry.unsqueeze(-1) * carry_powers[b - n:]
        carry = advantages[:, s]
    return _masked_outputs(advantages.to(rewards.dtype), values, mask)


# Above this many response tokens `gae` scans in blocks: the (T, T) matrix of gae_matmul
# would take 8 * T^2 bytes (T = 16384: 2 GiB; T = 32768: 8 GiB).
BLOCKED_ABOVE = 1024


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by GAE (Schulman et al. 2016), per row, no reduction.

    Args:
        rewards: (B, T) float, per-token rewards (e.g. from ``shape_rewards``).
        values: (B, T) float, critic values V(s_t) at rollout time.
        mask: (B, T) bool/0-1, True on response tokens that count (a prefix of each row).
        gamma: discount per token.
        lam: GAE lambda.

    Returns:
        (advantages, returns), each (B, T) in rewards' dtype; returns = advantages +
        values on valid tokens; both 0 outside the mask. Rewards and values at masked
        positions are ignored; the value after the last valid token is taken as 0
        (terminal). Not whitened: see ``masked_whiten``.

    Up to BLOCKED_ABOVE tokens one (T, T) matmul (``gae_matmul``), above it the blocked scan
    (``gae_blocked``): the same values, in O(B T) memory.

    A mask with holes (a multi-turn episode: False on observation tokens between turns) is
    run over each row's model tokens moved to the front: an observation takes no step, so
    the return and the discount carry across it (``algo.turns``).
    """
    if not is_prefix(mask):
        order = model_token_order(mask)
        adv, ret = gae(to_model_tokens(rewards, order), to_model_tokens(values, order),
                       to_model_tokens(mask.bool(), order), gamma, lam)
        return from_model_tokens(adv, order), from_model_tokens(ret, order)
    if rewards.shape[-1] > BLOCKED_ABOVE:
        return gae_blocked(rewards, values, mask, gamma, lam)
    return _GAE_IMPL(rewards, values, mask, gamma, lam)


# Chosen by timing both on B=64, T=512 float32, one CPU thread: loop ~5.5 ms,
# matmul ~1.3 ms. On a GPU the loop's 3T small kernel launches cost far more.
_GAE_IMPL = gae_matmul
