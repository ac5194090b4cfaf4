"""KL estimators and KL-coefficient controllers.

Imports only torch (and stdlib typing).
"""

import torch

from .choices import KL_ESTIMATORS, KLEstimator  # noqa: F401  (re-exported)

# Bound on a log-ratio before it is squared (k2) or exponentiated (k3, the PPO ratio): e^20 ~ 5e8
# is far beyond any ratio a healthy update sees, yet exp and its gradient stay finite in float32
# (e^88 overflows) and a reward of -kl_coef * e^20 cannot overflow an update. OpenRLHF and verl
# clamp at +-10 to +-20. Tokens beyond it are counted (`log_ratio_clamped`; metrics
# kl/clamped_frac, policy/ratio_clamped_frac).
LOG_RATIO_CLAMP = 20.0


def log_ratio_clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where |log_ratio| exceeds LOG_RATIO_CLAMP (the value was clamped)."""
    return log_ratio.abs() > LOG_RATIO_CLAMP


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    Estimators from Schulman 2020, "Approximating KL Divergence"
    (http://joschu.net/blog/kl-approx.html), with log r = ref_logprobs - logprobs
    for tokens sampled from the policy:
      k1 = -log r = logprobs - ref_logprobs              (unbiased, high variance, can be < 0)
      k2 = 0.5 * (log r)^2                               (biased, low variance, >= 0)
      k3 = (r - 1) - log r = exp(ref - logp) - 1 - (ref - logp)   (unbiased, >= 0)

    For k2 and k3 the log-ratio is first clamped to +-LOG_RATIO_CLAMP (20 nats), so a tail
    token cannot put e^100 (inf in float32) into a reward; k1 is linear and left as it is.

    Args:
        logprobs: (B, T) float, log-prob of each sampled response token under the policy (nats).
        ref_logprobs: (B, T) float, the same tokens under the reference model (nats).
        estimator: "k1", "k2" or "k3".

    Returns:
        (B, T) per-token KL estimate in nats, unmasked (mask it yourself, e.g. with
        ``masked_mean(kl, mask)`` for a metric; that reduction is per-rank).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    # k3 with log r = -log_ratio: (r - 1) - log r
    return torch.expm1(-log_ratio) + log_ratio


class FixedKLController:
    """Constant KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", the non-adaptive setting)."""

    def __init__(self, kl_coef: float = 0.1) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self._value = float(kl_coef)

    @property
    def value(self) -> float:
        """Current KL coefficient (dimensionless; reward per nat of KL)."""
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers are interchangeable."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered towards a target KL, Ziegler et al. 2019, Sec. 2.2:

        e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)
        beta_{t+1} = beta_t * (1 + K_beta * e_t),  K_beta = n_steps / horizon

    (the paper uses horizon = 10000 episodes). ``n_steps`` and ``horizon`` must be in
    the same unit, e.g. sequences. The controller holds plain Python floats: call
    ``update`` on every rank with the same value (the KL averaged across the
    data-parallel group) or the coefficients drift apart between ranks.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0 (nats), got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self._value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    @property
    def value(self) -> float:
        """Current KL coefficient."""
        return self._value

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Adjust the coefficient after observing mean KL ``current_kl`` (nats; the
        same quantity as ``target``, e.g. the per-sequence summed KL as in the paper)
        over ``n_steps`` steps."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self._value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
