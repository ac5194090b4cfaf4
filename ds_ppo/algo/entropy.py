"""The entropy bonus's coefficient: fixed (ppo.entropy_coef), or set from the policy's entropy so
that it stays near a target (ppo.entropy_target), in the spirit of the adaptive KL controller
(kl.py).

A fixed bonus pushes every response token towards randomness for the whole run, the tokens that
decide the reward too, and keeps pushing while the entropy climbs. The controller pays a bonus
that grows as the entropy falls below the target and none above it: it holds off a collapse onto
one answer without feeding an entropy that is already high.

The target applies to one of two things (ppo.entropy_target_scope, algo.choices.EntropyScope):
the mean token entropy, through the coefficient (EntropyController), or each token, through a
weight on its entropy in the bonus (``entropy_bonus``'s ``floor``; the coefficient then stays at
its maximum). A mean can stay above the target on random filler tokens while the token that decides
the reward has collapsed: the per-token floor reaches that token.
"""
from __future__ import annotations

import torch


class EntropyController:
    """The entropy bonus's coefficient c_t in [0, c_max] (c_max = ppo.entropy_coef), proportional
    to how far the policy's last measured entropy H_t (nats per token) is below H_target:

        c_{t+1} = c_max * clip(1 - H_t / H_target, 0, 1)

    starting at c_1 = c_max (before any entropy is measured). At the target and above it there
    is no bonus; at entropy 0 the bonus is c_max. A proportional law reacts within one
    iteration: an entropy that falls fast (a policy collapsing onto one answer) meets the bonus
    at once, where an integral controller would still be winding up. ``target=None``:
    c_t = c_max always (a fixed bonus). The state is plain Python floats: call ``update`` on
    every rank with the same value (the entropy averaged across the data-parallel group) or the
    coefficients drift apart between ranks.
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
        """Set the next coefficient from an iteration whose policy had mean token entropy
        ``entropy`` (nats per token; the metric policy/entropy). No-op without a target."""
        if self.target is None:
            return
        self._value = self.max_coef * min(max(1.0 - float(entropy) / self.target, 0.0), 1.0)

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore a saved coefficient; an empty state (a checkpoint written without one, or
        by a run with another setting) keeps the current one."""
        if "value" in state:
            self._value = min(max(float(state["value"]), 0.0), self.max_coef)
