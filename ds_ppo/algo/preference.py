"""The preference losses of `ds-ppo dpo`, one registered function each (`dpo.loss`; the registry
reads `algo/choices.PREFERENCE_LOSSES` for everything but the math): a policy learns from
(chosen, rejected) pairs directly, with no reward model.

A pair's answers are scored by their sequence log-probs: the sum over the answer's counted
tokens, or the per-token mean for the losses whose row says `length_normalised` (IPO, SimPO).
`h` is the chosen answer's log-ratio to the reference less the rejected one's:

    h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))

and a pair's implicit rewards are beta x each answer's log-ratio (SimPO: beta x its mean
log-prob, there is no reference). Each loss returns one term per pair: the caller sums them and
divides by the global batch's pair count, so the gradient is that of the pair mean at any world
size or micro-batch split (as the rm loss does).

IPO: Azar et al. write h with whole-sequence log-probs; the common implementations (TRL's
`loss_type="ipo"`, the IPO authors' follow-ups) average them per token, since a target of
1 / (2 beta) nats on a sum grows meaningless with the answer's length. Here h uses per-token
means (the table row's `length_normalised`).

Shapes: P = pairs; B = sequences, T = tokens for `sequence_logps`. Imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .choices import PREFERENCE_LOSSES


@dataclass(frozen=True)
class PreferenceSettings:
    """The settings of every preference loss (config dpo.*; each loss reads the ones it needs)."""

    beta: float  # the inverse temperature of the implicit reward (all losses)
    label_smoothing: float = 0.0  # sigmoid, simpo: probability eps that a pair's label is wrong
    simpo_gamma: float = 0.0  # simpo: the target reward margin gamma (nats, beta-scaled rewards)


@dataclass(frozen=True)
class PairLogps:
    """A micro-batch's sequence log-probs, one per pair and answer (sums, or per-token means
    for a length-normalised loss). The reference's are None for a loss without one."""

    chosen: torch.Tensor  # (P,) policy log-prob of the chosen answer, with grad
    rejected: torch.Tensor  # (P,) policy log-prob of the rejected answer, with grad
    ref_chosen: torch.Tensor | None = None  # (P,) reference's, no grad
    ref_rejected: torch.Tensor | None = None  # (P,)


@dataclass(frozen=True)
class PreferenceOut:
    """One preference loss on a micro-batch: a term per pair and the implicit rewards."""

    losses: torch.Tensor  # (P,) float32, with grad
    chosen_rewards: torch.Tensor  # (P,) float32, detached
    rejected_rewards: torch.Tensor  # (P,) float32, detached


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor, mean: bool = False
                   ) -> torch.Tensor:
    """(B,) float32 log-prob of each sequence's counted tokens: their sum, or with `mean`
    their mean (SimPO's length-normalised score; a row without counted tokens gives 0).
    logprobs: (B, T) token log-probs (nats); mask: (B, T) bool, True on the answer's tokens.
    Values outside the mask never change the result."""
    mask = mask.bool()
    x = torch.where(mask, logprobs.float(), torch.zeros((), device=logprobs.device))
    total = x.sum(-1)
    if not mean:
        return total
    return total / mask.sum(-1).clamp(min=1).float()


Loss = Callable[[PairLogps, PreferenceSettings], PreferenceOut]
_FUNCTIONS: dict[str, Loss] = {}


def register_preference_loss(name: str) -> Callable[[Loss], Loss]:
    """Decorator: `fn` computes the preference loss of the table row `name` (algo/choices.py)."""
    if name not in PREFERENCE_LOSSES:
        raise ValueError(f"{name!r} has no row in algo/choices.PREFERENCE_LOSSES")

    def add(fn: Loss) -> Loss:
        _FUNCTIONS[name] = fn
        return fn
    return add


def preference_loss_for(name: str, x: PairLogps, s: PreferenceSettings) -> PreferenceOut:
    """The preference loss `name` (dpo.loss) on micro-batch `x`."""
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown preference loss {name!r}; valid: {', '.join(_FUNCTIONS)}")
    if PREFERENCE_LOSSES[name].reference and (x.ref_chosen is None or x.ref_rejected is None):
        raise ValueError(f"preference loss {name!r} needs the reference's log-probs")
    return _FUNCTIONS[name](x, s)


def registered() -> tuple[str, ...]:
    return tuple(_FUNCTIONS)


def _log_ratios(x: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) each answer's log-ratio log pi - log ref (the reference's carry no gradient)."""
    return (x.chosen.float() - x.ref_chosen.detach().float(),
            x.rejected.float() - x.ref_rejected.detach().float())


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """(P,) -(1 - eps) log sigmoid(z) - eps log sigmoid(-z): the Bradley-Terry loss of a label
    that is wrong with probability eps (conservative DPO, Mitchell 2023)."""
    return -(1.0 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


@register_preference_loss("sigmoid")
def _sigmoid(x: PairLogps, s: PreferenceSettings) -> PreferenceOut:
    # DPO, Rafailov et al. 2023, Eq. 7: -log sigmoid(beta h)
    chosen, rejected = _log_ratios(x)
    losses = _smoothed(s.beta * (chosen - rejected), s.label_smoothing)
    return PreferenceOut(losses, s.beta * chosen.detach(), s.beta * rejected.detach())


@register_preference_loss("ipo")
def _ipo(x: PairLogps, s: PreferenceSettings) -> PreferenceOut:
    # IPO, Azar et al. 2023, Eq. 17: (h - 1 / (2 tau))^2, tau = beta; h from per-token means
    chosen, rejected = _log_ratios(x)
    losses = (chosen - rejected - 1.0 / (2.0 * s.beta)).square()
    return PreferenceOut(losses, s.beta * chosen.detach(), s.beta * rejected.detach())


@register_preference_loss("simpo")
def _simpo(x: PairLogps, s: PreferenceSettings) -> PreferenceOut:
    # SimPO, Meng et al. 2024, Eq. 6: -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log
    # pi(y_l) - gamma); the inputs are already per-token means
    chosen, rejected = s.beta * x.chosen.float(), s.beta * x.rejected.float()
    losses = _smoothed(chosen - rejected - s.simpo_gamma, s.label_smoothing)
    return PreferenceOut(losses, chosen.detach(), rejected.detach())


def reward_stats(out: PreferenceOut) -> dict[str, torch.Tensor]:
    """Per-pair statistics of the implicit rewards, summed (per-rank; () float64 each, for a
    global mean by pair count): `correct` (pairs whose chosen answer has the higher reward),
    `margin` (chosen - rejected reward), `chosen`, `rejected` (the rewards)."""
    c, r = out.chosen_rewards.double(), out.rejected_rewards.double()
    return {"correct": (c > r).double().sum(), "margin": (c - r).sum(), "chosen": c.sum(),
            "rejected": r.sum()}
