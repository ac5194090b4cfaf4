"""Multi-turn responses: masks with holes.

An episode's response is its model turns with the environment's observations between them:
[turn 1 | observation 1 | turn 2 | ...]. ``mask`` (B, T) is True on the model's tokens only, so
a row's mask has holes where the observations sit. The observations are context (they are
attended to, and the values and log-probs after them see them) but not actions: no loss, no
KL, no reward, and no step of the return's discount.

The per-token recursions (GAE, discounted returns) therefore run over the model tokens alone:
``model_token_order`` moves each row's model tokens to the front, in order (a prefix mask),
the recursion runs there, and ``from_model_tokens`` puts the results back. The state after a
turn's last token is the state at the next turn's first token (its value sees the
observation), so the return carries across an observation.

Imports only torch.
"""

import torch


def is_prefix(mask: torch.Tensor) -> bool:
    """True when every row of the (B, T) mask is a prefix (no holes); one device read."""
    mask = mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def model_token_order(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) long: per row, the positions of the True entries of ``mask`` in order, then the
    False ones (a stable sort), so ``x.gather(-1, order)`` moves a row's model tokens to the
    front and ``mask.gather(-1, order)`` is a prefix mask."""
    return torch.sort((~mask.bool()).to(torch.int8), dim=-1, stable=True).indices


def to_model_tokens(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): each row's model tokens first (``model_token_order``)."""
    return x.gather(-1, order)


def from_model_tokens(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_model_tokens``: (B, T) in model-token order -> (B, T) in place."""
    return torch.empty_like(y).scatter_(-1, order, y)


def turn_ends(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True at the last model token of each turn: a True of ``mask`` followed by
    a False (or the row's end). A single-turn response has one, its last token."""
    mask = mask.bool()
    after = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    return mask & ~after


def turn_token_index(turn_starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True at the first token of each model turn -> (B, T) long, each position's
    distance from the last turn start at or before it (the token index the sampler had there;
    positions before the first start count from column 0)."""
    T = turn_starts.shape[-1]
    pos = torch.arange(T, device=turn_starts.device).expand_as(turn_starts)
    last = torch.where(turn_starts.bool(), pos, torch.zeros_like(pos)).cummax(dim=-1).values
    return pos - last
