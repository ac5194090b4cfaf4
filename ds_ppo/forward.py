"""Forward passes over (prompt + response) sequences, shared by scoring and the update.

Sequences are [left-padded prompt (P) | right-padded response (T)]. Position ids count real
tokens only, so a left-padded prompt sees the same positions as an unpadded one (the same rule
HF `generate` uses). Token t of the response is predicted by the logits at position P - 1 + t.
"""
from __future__ import annotations

import torch

from ds_ppo.algo import entropy_from_logits, logprobs_from_logits
from ds_ppo.containers import Rollout


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions of real tokens (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _response_logits(model, ids: torch.Tensor, am: torch.Tensor, num_response: int,
                     temperature: float) -> torch.Tensor:
    """(B, T, V) logits predicting the last T tokens of `ids`, divided by the sampling
    temperature. Only the last T + 1 positions' logits are computed (`logits_to_keep`), so the
    prompt logits are never materialised."""
    out = model(input_ids=ids, attention_mask=am, position_ids=position_ids(am),
                logits_to_keep=num_response + 1, use_cache=False)
    logits = out.logits[:, :-1]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


def _full_width(x: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T') -> (B, T): zeros after the kept response columns (they are masked everywhere)."""
    return torch.nn.functional.pad(x, (0, T - x.shape[1]))


def response_logprobs(model, rollout: Rollout, temperature: float, with_entropy: bool = False):
    """(B, T) float32 log-probs of the response tokens (and (B, T) entropy if asked). The
    forward runs on `rollout.model_inputs()` (unused padding dropped); the columns after the
    longest counted response are 0, and like every masked position they mean nothing."""
    ids, am, keep = rollout.model_inputs()
    T = rollout.response_ids.shape[1]
    logits = _response_logits(model, ids, am, keep, temperature)
    logprobs = logprobs_from_logits(logits, ids[:, ids.shape[1] - keep:])
    entropy = _full_width(entropy_from_logits(logits.detach()), T) if with_entropy else None
    return _full_width(logprobs, T), entropy


def response_values(value_model, rollout: Rollout) -> torch.Tensor:
    """(B, T) float32 value of the state before each response token (the per-token head's output
    at position P - 1 + t); masked positions as in `response_logprobs`."""
    ids, am, keep = rollout.model_inputs()
    out = value_model(input_ids=ids, attention_mask=am, position_ids=position_ids(am),
                      use_cache=False)
    values = out.logits.squeeze(-1)[:, ids.shape[1] - keep - 1:ids.shape[1] - 1]  # (B, T')
    return _full_width(values.float(), rollout.response_ids.shape[1])


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last real token (works for left and right padding)."""
    L = attention_mask.shape[1]
    return L - 1 - attention_mask.long().flip(-1).argmax(-1)


class LastTokenScorer(torch.nn.Module):
    """The reward role's root module: an HF sequence-classification model whose score head is
    read at each row's last real token.

    The backbone and score head are called directly (rather than the pooled HF forward, which
    finds the last token by comparing ids to pad_token_id and so misreads rows ending in EOS when
    pad == eos). They are called inside this module's forward, so the DeepSpeed engine wraps it
    and the reward model runs through `engine.forward`: ZeRO-3 resets its parameter-fetch trace
    in the root module's forward hooks; called through the engine's attribute forwarding instead,
    its coordinator never completed a trace (no prefetch; measured in tests/test_reward_model.py).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) ids and mask (any padding side) -> (B,) float32 scores."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids(attention_mask),
                          use_cache=False).last_hidden_state
        last = last_token_index(attention_mask)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.model.score(picked).squeeze(-1).float()


def sequence_scores(reward_engine, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) float32 reward-model score read at each row's last real token, by the reward engine's
    own forward (its module is a `LastTokenScorer`)."""
    return reward_engine(input_ids=input_ids, attention_mask=attention_mask)
