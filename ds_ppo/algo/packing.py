"""Packed micro-batches: the rows of a micro-batch concatenated into one sequence (batch dim 1),
each row's real tokens only, position ids restarting at 0 for each row and attention confined to
the row (a block-diagonal causal mask). A forward over it computes exactly the real tokens: no
padding, whatever the rows' lengths.

Row-major order: packing takes `x[keep]` of a (B, L) tensor, so the packed sequence is row 0's
kept tokens, then row 1's, and so on. N = packed tokens, n = counted response tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def token_budget_batches(lengths: list[int], budget: int, rows: list[int] | None = None
                         ) -> list[list[int]]:
    """`rows` (default: all of `lengths`) cut into micro-batches whose lengths sum to at most
    `budget`: longest first, each row into the first micro-batch it still fits in
    (first-fit decreasing); a row longer than the budget gets a micro-batch of its own. Host
    values only: the cut never reads the device."""
    rows = list(range(len(lengths))) if rows is None else rows
    batches: list[list[int]] = []
    room: list[int] = []  # tokens each micro-batch can still take (negative: an over-long row)
    for i in sorted(rows, key=lambda i: -lengths[i]):
        for k, free in enumerate(room):
            if lengths[i] <= free:
                batches[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            batches.append([i])
            room.append(budget - lengths[i])
    return batches


class PackedLayout(NamedTuple):
    place: torch.Tensor  # (B, L) long, each kept token's index in the packed sequence; -1 elsewhere
    position_ids: torch.Tensor  # (N,) long, each packed token's position in its row, from 0
    row_of: torch.Tensor  # (N,) long, the row each packed token comes from


def packed_layout(keep: torch.Tensor) -> PackedLayout:
    """Where the kept tokens of (B, L) rows go in their packing. keep: (B, L) bool, True on the
    tokens a row keeps (any padding pattern; a row's kept tokens stay in their order)."""
    k = keep.long()
    place = (k.flatten().cumsum(0) - 1).view_as(k).masked_fill(~keep, -1)
    position_ids = (k.cumsum(1) - 1)[keep]
    rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)
    return PackedLayout(place, position_ids, rows[keep])


def cumulative_lengths(lengths: list[int], device: torch.device | None = None) -> torch.Tensor:
    """(R + 1,) int32 [0, l0, l0 + l1, ...]: where each of R packed rows starts, and the end
    (flash-attention's varlen `cu_seqlens`), from host lengths (no device read)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def block_causal_mask(row_of: torch.Tensor) -> torch.Tensor:
    """(1, 1, N, N) bool attention mask of a packed sequence, True where query i may attend to
    key j: j <= i and both tokens belong to the same row. row_of: (N,) long, from
    `packed_layout` (rows are contiguous in the packing)."""
    idx = torch.arange(row_of.shape[0], device=row_of.device)
    mask = (row_of[:, None] == row_of[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as the additive float mask eager attention adds to its
    scores: 0 where attended, the dtype's lowest value elsewhere. Same shape."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min)


def response_predictors(place: torch.Tensor, num_prompt: int, mask: torch.Tensor
                        ) -> torch.Tensor:
    """(n,) packed index of the position whose output predicts each counted response token (the
    one before it), in row-major order of `mask`. place: (B, P+T) from `packed_layout` of
    [prompt | response] rows; num_prompt: P; mask: (B, T) bool, the counted response tokens
    (kept in the packing). Every row keeps at least one prompt token, so a row's first response
    token is predicted by its own last prompt token."""
    return place[:, num_prompt:][mask] - 1


def unpack(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n,) per-token values in row-major order of `mask` -> (B, T) of packed's dtype, 0 where
    mask is False. Differentiable w.r.t. `packed`. mask: (B, T) bool with n True entries."""
    out = torch.zeros(mask.shape, dtype=packed.dtype, device=packed.device)
    return out.masked_scatter(mask, packed)
