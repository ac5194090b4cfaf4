"""A causal LM whose responses have lengths chosen in advance, for measuring how a decoding
loop uses its slots (the tests of continuous batching, tools/measure_continuous.py).

`ForcedLengths` wraps an HF causal LM: the model runs as usual (its compute is what is timed),
then the logits are replaced by a countdown: a row whose last input token is FIRST + k
(k >= 1) puts all its mass on FIRST + k - 1, and on `eos` when k == 1. A prompt ending in
FIRST + L therefore gets a response of exactly L tokens (EOS included), whatever the sampling
temperature. Token ids FIRST .. FIRST + max length must exist in the vocabulary."""
from __future__ import annotations

import torch

FIRST = 10


class ForcedLengths(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, eos: int):
        super().__init__()
        self.model, self.eos = model, eos
        self.config = model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                use_cache=None, logits_to_keep=0):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=use_cache,
                         logits_to_keep=logits_to_keep)
        last = input_ids[:, -1:]
        nxt = torch.where(last > FIRST + 1, last - 1, torch.full_like(last, self.eos))
        forced = torch.full_like(out.logits, -1e4)
        forced[:, -1:].scatter_(-1, nxt[..., None], 1e4)
        out.logits = forced
        return out


def forced_prompts(lengths: list[int], prompt_len: int, vocab: int, pad: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, prompt_len) random prompts (ids above FIRST + max length) whose last token asks for
    a response of lengths[i] tokens, and their (all True) mask."""
    g = torch.Generator().manual_seed(seed)
    low = FIRST + max(lengths) + 1
    ids = torch.randint(low, vocab, (len(lengths), prompt_len), generator=g)
    ids[:, -1] = FIRST + torch.tensor(lengths)
    return ids, torch.ones_like(ids, dtype=torch.bool)


def lognormal_lengths(n: int, median: float, max_len: int, sigma: float = 1.0, seed: int = 0
                      ) -> list[int]:
    """n response lengths drawn log-normal around `median`, clipped to [1, max_len]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * sigma
    return [int(v) for v in (median * x.exp()).round().clamp(1, max_len)]
