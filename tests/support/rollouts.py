"""Rollouts built by hand for stage tests: lists of token ids, padded as generation pads them."""
from __future__ import annotations

import torch

from ds_ppo.containers import Rollout


def padded_rollout(prompts: list[list[int]], responses: list[list[int]], P: int, T: int,
                   pad: int = 0) -> Rollout:
    """A Rollout of unpadded prompt/response id lists: prompts left-padded to P, responses
    right-padded to T (wider than any row: extra columns nothing needs)."""
    B = len(prompts)
    prompt_ids = torch.full((B, P), pad)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.full((B, T), pad)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (pr, rs) in enumerate(zip(prompts, responses)):
        prompt_ids[b, P - len(pr):], prompt_mask[b, P - len(pr):] = torch.tensor(pr), True
        response_ids[b, :len(rs)], mask[b, :len(rs)] = torch.tensor(rs), True
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   mask=mask, ended=torch.ones(B, dtype=torch.bool), prompts=[""] * B,
                   responses=[""] * B, prompt_lens=[len(x) for x in prompts],
                   response_lens=[len(x) for x in responses], extras=[{}] * B)
