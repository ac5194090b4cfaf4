"""Next-token choice for our own decoding loop: logits processing and sampling on the device.

Every function is a fixed sequence of tensor ops with no host synchronisation and no shape that
depends on tensor values, so a decoding step built from them can be captured in a CUDA graph.
They reproduce HF `generate`'s processors in HF's order (min-new-tokens, suppressed tokens, then
temperature, top-k, top-p) so that the same logits give the same greedy token and the same
sampling distribution.

Shapes: (B, V) float logits of the next position (B = sequences, V = vocabulary).
Imports only torch.
"""
from __future__ import annotations

import torch


def block_tokens(logits: torch.Tensor, token_ids: torch.Tensor,
                 blocked: torch.Tensor | bool = True) -> torch.Tensor:
    """Set the logits of `token_ids` (K,) long to -inf where `blocked` (a bool, or a bool tensor
    broadcastable to (B, 1), e.g. "fewer than min_new_tokens generated") holds. In place."""
    if isinstance(blocked, bool):  # no tensor made from a Python value: capture-safe
        if blocked:
            logits.index_fill_(-1, token_ids, float("-inf"))
        return logits
    current = logits.index_select(-1, token_ids)
    logits.index_copy_(-1, token_ids, current.masked_fill(blocked, float("-inf")))
    return logits


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering; removed tokens get -inf.

    Matches HF's TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper with
    min_tokens_to_keep=1: top-p keeps the smallest set of most likely tokens whose probability
    reaches top_p (at least one). temperature > 0; top_k = 0 is off; top_p = 1 is off.
    """
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1:] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_from_logits(logits: torch.Tensor, generator: torch.Generator | None = None
                       ) -> torch.Tensor:
    """(B, V) logits -> (B,) long token ids drawn from softmax(logits).

    Exponential race (equivalent to the Gumbel-max trick): argmax_i p_i / E_i with E_i ~ Exp(1)
    picks i with probability p_i. Unlike torch.multinomial it never synchronises with the host,
    so it can sit inside a CUDA graph. Tokens with logit -inf have p = 0 and are never picked.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) processed logits -> (B,) long: greedy argmax when temperature == 0, else a sample
    after filter_logits."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_from_logits(filter_logits(logits, temperature, top_k, top_p), generator)


def next_tokens_with_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                              top_p: float = 1.0, generator: torch.Generator | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`next_tokens`, plus (B,) float32: each chosen token's log-prob under the distribution it
    was drawn from, the rollout log-probs a trainer compares with its own (Yao et al. 2025).

    Sampling: log softmax of the filtered logits (temperature, top-k, top-p, and whatever the
    caller blocked, e.g. pad or EOS before min_new_tokens). Greedy (temperature 0): log softmax
    of the processed logits at temperature 1, what the training forward computes at
    temperature 0 (a point mass would say 0 and mean nothing). Computed as the training
    forward computes its log-probs (`logprobs_from_logits`), so in float32 with the same
    logits the two agree to the last bit."""
    from .logits import logprobs_from_logits

    if temperature == 0:
        dist = logits
        chosen = logits.argmax(dim=-1)
    else:
        dist = filter_logits(logits, temperature, top_k, top_p)
        chosen = sample_from_logits(dist, generator)
    return chosen, logprobs_from_logits(dist[:, None], chosen[:, None])[:, 0]
