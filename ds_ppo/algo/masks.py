"""The one place a response mask is derived.

Convention used across ``ds_ppo``: ``mask`` is a (B, T) bool tensor over the
response tokens (B = sequences, T = response tokens) that is True on tokens that
count, i.e. a prefix of each row: every generated token up to and including the
first EOS. Everything after it (padding, tokens generated after EOS) is False.

Imports only torch.
"""

from typing import Sequence

import torch


def response_mask(tokens: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """Mask of the response tokens that count: up to and including the first EOS.

    Args:
        tokens: (B, T) long, generated response token ids (no prompt).
        eos_token_ids: one id or several; the first occurrence of any of them ends
            the response.

    Returns:
        (B, T) bool. Row b is True on positions ``0..e`` where ``e`` is the first EOS
        position, False after it. A row with no EOS (truncated at T) is all True.
    """
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    if len(eos_token_ids) == 0:
        raise ValueError("eos_token_ids is empty: give at least one EOS token id")
    eos = torch.as_tensor(list(eos_token_ids), dtype=tokens.dtype, device=tokens.device)
    is_eos = torch.isin(tokens, eos).long()
    # Number of EOS tokens strictly before each position; zero means "not yet ended",
    # so the first EOS itself is kept.
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos
    return eos_before == 0


def counted_tokens(tokens: list[int], eos_token_ids: set[int]) -> list[int]:
    """One response's tokens that count, as a list (`response_mask` of one row): up to and
    including the first EOS; all of them without one."""
    for k, t in enumerate(tokens):
        if t in eos_token_ids:
            return tokens[:k + 1]
    return tokens


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) long index of the last True position of each row; -1 for empty rows.

    Uses the position of the last True element, not ``mask.sum() - 1``, so it stays
    right even if a mask is not a prefix.
    """
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).amax(dim=-1)


def decode_attention_mask(prompt_mask: torch.Tensor, total_len: int,
                          prefill: bool = False) -> torch.Tensor:
    """4D keep-masks (True = may attend) over a static KV cache of `total_len` columns whose
    first P columns hold the left-padded prompts (B, P) bool.

    prefill=False: (B, 1, 1, total_len), the prompt's real tokens only; a decoding loop sets one
    more column per generated token. prefill=True: (B, 1, P, total_len), causal over the
    prompt's real tokens; a query with nothing to attend (a left pad) attends to every column
    instead, so its unused output stays finite (an all-masked softmax row is NaN, which would
    then be written to the cache and poison later steps through 0 * NaN).
    """
    prompt_mask = prompt_mask.bool()
    B, P = prompt_mask.shape
    if total_len < P:
        raise ValueError(f"total_len {total_len} < prompt length {P}")
    queries = P if prefill else 1
    keep = torch.zeros(B, 1, queries, total_len, dtype=torch.bool, device=prompt_mask.device)
    keep[..., :P] = prompt_mask[:, None, None, :]
    if prefill:
        causal = torch.ones(P, P, dtype=torch.bool, device=prompt_mask.device).tril()
        keep[..., :P] &= causal
        keep |= ~keep.any(dim=-1, keepdim=True)
    return keep
