"""Forward passes over (prompt + response) sequences, shared by scoring and the update.

Sequences are [left-padded prompt (P) | right-padded response (T)]. Position ids count real
tokens only, so a left-padded prompt sees the same positions as an unpadded one (the same rule
HF `generate` uses). Token t of the response is predicted by the logits at position P - 1 + t.
"""
from __future__ import annotations

import torch

from ds_ppo.algo import entropy_from_logits, logprobs_from_logits


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions of real tokens (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    num_response: int, temperature: float) -> torch.Tensor:
    """(B, T, V) logits predicting the T response tokens, divided by the sampling temperature.

    Only the last T + 1 positions' logits are computed (`logits_to_keep`), so the (B, P+T, V)
    prompt logits are never materialised.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids(attention_mask), logits_to_keep=num_response + 1,
                use_cache=False)
    logits = out.logits[:, :-1]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


def response_logprobs(model, input_ids, attention_mask, response_ids, temperature,
                      with_entropy: bool = False):
    """(B, T) float32 log-probs of the response tokens (and (B, T) entropy if asked)."""
    logits = response_logits(model, input_ids, attention_mask, response_ids.shape[1], temperature)
    logprobs = logprobs_from_logits(logits, response_ids)
    entropy = entropy_from_logits(logits.detach()) if with_entropy else None
    return logprobs, entropy


def response_values(value_model, input_ids, attention_mask, num_response: int) -> torch.Tensor:
    """(B, T) float32 value of the state before each response token (the per-token head's output
    at position P - 1 + t)."""
    out = value_model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids(attention_mask), use_cache=False)
    values = out.logits.squeeze(-1)  # (B, P+T)
    return values[:, -num_response - 1:-1].float()


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last real token (works for left and right padding)."""
    L = attention_mask.shape[1]
    return L - 1 - attention_mask.long().flip(-1).argmax(-1)


def sequence_scores(reward_model, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) float32 reward-model score read at each row's last real token.

    The backbone and score head are called directly (rather than the pooled HF forward, which
    finds the last token by comparing ids to pad_token_id and so misreads rows ending in EOS when
    pad == eos).
    """
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
    last = last_token_index(attention_mask)
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return reward_model.score(picked).squeeze(-1).float()
