"""The entropy bonus's coefficient: fixed (ppo.entropy_coef), or steered so the policy's entropy
stays near a target (ppo.entropy_target), as the adaptive KL controller steers the KL (kl.py).

A fixed bonus pushes every response token towards randomness for the whole run, the tokens that
decide the reward too, and keeps pushing while the entropy climbs. The controller pays the bonus
only while the entropy is below the target: it stops a collapse onto one answer and lets the
policy sharpen the tokens that matter once the others hold enough entropy.
"""
from __future__ import annotations

import torch

# the coefficient moves by at most 1/ENTROPY_STEPS of its ceiling per update: from 0 to the
# ceiling (or back) in no fewer than this many iterations
ENTROPY_STEPS = 10


class EntropyController:
    """The entropy bonus's coefficient c_t in [0, c_max] (c_max = ppo.entropy_coef), an integral
    controller of the policy's entropy H_t (nats per token) towards H_target:

        e_t = clip(1 - H_t / H_target, -1, 1)
        c_{t+1} = clip(c_t + c_max * e_t / ENTROPY_STEPS, 0, c_max)

    starting at c_0 = c_max. Entropy below the target raises the coefficient, above it lowers
    it, to 0 at most (the bonus never pushes an entropy that is already above the target).
    ``target=None``: c_t = c_max always (a fixed bonus). The state is plain Python floats: call
    ``update`` on every rank with the same value (the entropy averaged across the data-parallel
    group) or the coefficients drift apart between ranks.
    """

    def __init__(self, max_coef: float, target: float | None = None) -> None:
        if max_coef < 0:
            raise ValueError(f"max_coef must be >= 0, got {max_coef}")
        if target is not None and target <= 0:
            raise ValueError(f"target must be > 0 (nats per token), got {target}")
        self.max_coef = float(max_coef)
        self.target = None if target is None else float(target)
        self._value = self.max_coef

    @property
    def value(self) -> float:
        """The coefficient of the next update (dimensionless: loss per nat of entropy)."""
        return self._value

    def update(self, entropy: float | torch.Tensor) -> None:
        """Adjust the coefficient after an iteration whose policy had mean token entropy
        ``entropy`` (nats per token; the metric policy/entropy). No-op without a target."""
        if self.target is None:
            return
        error = min(max(1.0 - float(entropy) / self.target, -1.0), 1.0)
        self._value = min(max(self._value + self.max_coef * error / ENTROPY_STEPS, 0.0),
                          self.max_coef)

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore a saved coefficient; an empty state (a checkpoint written without one, or
        by a run with another setting) keeps the current one."""
        if "value" in state:
            self._value = min(max(float(state["value"]), 0.0), self.max_coef)
