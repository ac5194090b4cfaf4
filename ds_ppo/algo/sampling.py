"""Next-token choice for our own decoding loop: sampling on the device from the logits that
`distribution.shape_logits` shaped, and each chosen token's log-prob.

Every function is a fixed sequence of tensor ops with no host synchronisation and no shape that
depends on tensor values, so a decoding step built from them can be captured in a CUDA graph.

Shapes: (B, V) float logits of the next position (B = sequences, V = vocabulary).
Imports only torch.
"""
from __future__ import annotations

import torch

from .distribution import LogitShape, block_tokens, filter_logits, shape_logits  # noqa: F401
from .logits import logprobs_from_logits


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


def next_tokens_with_logprobs(logits: torch.Tensor, temperature: float,
                              generator: torch.Generator | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits already shaped by `shape_logits` -> (B,) long chosen tokens (greedy argmax
    when temperature == 0, else a sample) and (B,) float32 each chosen token's log-prob under
    that distribution, the rollout log-probs a trainer compares with its own (Yao et al. 2025).

    Greedy: the log-prob under the shaped logits at temperature 1, what the training forward
    computes at temperature 0 (a point mass would say 0 and mean nothing). Computed as the
    training forward computes its log-probs (`logprobs_from_logits` over the same shaped
    logits), so in float32 with the same model logits the two agree to the last bit."""
    chosen = logits.argmax(dim=-1) if temperature == 0 else sample_from_logits(logits, generator)
    return chosen, logprobs_from_logits(logits[:, None], chosen[:, None])[:, 0]
