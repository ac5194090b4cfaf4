"""Masked statistics over response tokens.

Shapes: x and mask are (B, T) (B = sequences, T = response tokens) unless stated;
``mask`` is True (or 1) on tokens that count. Positions outside the mask are never
read: they are replaced by 0 with ``torch.where`` before any arithmetic, so NaN/inf
garbage there cannot leak into results or gradients.

Every reduction here is per-rank (this process's tensor only), except
``masked_whiten(..., distributed=True)`` and ``explained_variance(..., distributed=True)``,
which reduce across the data-parallel group.

Imports only torch.
"""

import torch
import torch.distributed as dist


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over valid positions (per-rank). dim=None sums everything -> 0-dim tensor."""
    mask = mask.bool()
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over valid positions (per-rank).

    dim=None averages over every valid element -> 0-dim tensor; an int averages along
    that dim (e.g. dim=-1 gives a (B,) per-sequence mean). An empty mask (or empty
    row) gives 0, not NaN, so a micro-batch without valid tokens contributes nothing.
    """
    mask = mask.bool()
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def _masked_moments(
    x: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool,
    group: "dist.ProcessGroup | None",
    across_ranks: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked (mean, var) as float64 0-dim tensors, optionally across ranks.

    Two passes (mean first, then the sum of centred squares) rather than
    E[x^2] - E[x]^2, which cancels catastrophically when |mean| >> std; float64
    sums for the same reason and so that partial sums from many ranks add exactly
    enough. Across ranks: one all_reduce of [sum, count], one of the centred sum.
    """
    mask = mask.bool()
    x64 = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).double()
    sum_count = torch.stack([x64.sum(), mask.sum().double()])
    if across_ranks:
        dist.all_reduce(sum_count, op=dist.ReduceOp.SUM, group=group)
    total, count = sum_count[0], sum_count[1]
    mean = total / count.clamp(min=1.0)
    centred = torch.where(mask, x64 - mean, torch.zeros((), dtype=torch.float64, device=x.device))
    sq_sum = (centred * centred).sum()
    if across_ranks:
        dist.all_reduce(sq_sum, op=dist.ReduceOp.SUM, group=group)
    # Bessel's correction; with fewer than 2 valid elements the centred sum is 0, so
    # clamping the denominator makes the variance 0 instead of NaN/inf.
    denom = (count - 1.0) if unbiased else count
    return mean, sq_sum / denom.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all valid positions (per-rank) -> 0-dim tensor in x's dtype.

    unbiased=True divides by (n - 1) (Bessel), else by n. Accumulated in float64.
    Fewer than two valid elements give 0.
    """
    _, var = _masked_moments(x, mask, unbiased, group=None, across_ranks=False)
    return var.to(x.dtype)


def _dist_active(group: "dist.ProcessGroup | None") -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    distributed: bool = True,
    eps: float = 1e-8,
    group: "dist.ProcessGroup | None" = None,
) -> torch.Tensor:
    """Normalise x to zero mean and unit variance over valid positions.

    ``(x - mean) / sqrt(var + eps)`` with the unbiased (n - 1) masked variance; with
    shift_mean=False the mean is added back (scale only). Positions outside the mask
    come out exactly 0.

    Reduction scope: when torch.distributed is available and initialised (world size
    > 1) and distributed=True, mean and variance are over the valid tokens of ALL
    ranks in ``group`` (default: the world group), so every rank whitens with the same
    statistics, exactly as one process would on the concatenated batch. This is a
    collective: every rank in the group must call it. Pass distributed=False for
    per-rank statistics. The statistics tensor lives on x's device, so the backend
    must support it (gloo: CPU, NCCL: CUDA). Cross-rank statistics are computed
    without autograd (whitening is meant for advantages, which carry no gradient);
    the per-rank path is differentiable.

    Args:
        x: (B, T) float, e.g. advantages.
        mask: (B, T) bool/0-1.
        shift_mean: subtract the mean (True) or keep it (False).
        distributed: reduce statistics across ranks when a process group is active.
        eps: added to the variance inside the sqrt.
        group: process group for the cross-rank statistics.

    Returns:
        (B, T) tensor in x's dtype.
    """
    mask = mask.bool()
    across_ranks = distributed and _dist_active(group)
    if across_ranks:
        with torch.no_grad():
            mean, var = _masked_moments(x, mask, True, group, across_ranks=True)
    else:
        mean, var = _masked_moments(x, mask, True, group=None, across_ranks=False)
    mean, var = mean.to(x.dtype), var.to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros((), dtype=whitened.dtype, device=x.device))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       distributed: bool = True,
                       group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over valid tokens, a metric.

    values, returns: (B, T); -> detached 0-dim float64 tensor. 1 is a perfect critic, 0
    is no better than predicting the mean, negative is worse. NaN when returns have no
    variance (CleanRL's ppo.py convention: explained variance is undefined there).

    Reduction scope as in masked_whiten: over the valid tokens of all ranks in ``group`` when
    a process group of more than one rank is active and distributed=True (a collective: every
    rank must call it), else per-rank. The variances are two-pass in float64
    (``_masked_moments``): E[x^2] - E[x]^2 loses every digit when |mean| >> std.
    """
    across_ranks = distributed and _dist_active(group)
    with torch.no_grad():
        _, var_returns = _masked_moments(returns, mask, False, group, across_ranks)
        _, var_error = _masked_moments(returns - values, mask, False, group, across_ranks)
        # where, not `if`, so no host sync for a metric.
        nan = torch.full_like(var_returns, float("nan"))
        return torch.where(var_returns == 0, nan, 1.0 - var_error / var_returns)
