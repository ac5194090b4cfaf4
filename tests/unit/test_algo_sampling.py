"""ds_ppo.algo.sampling (on-device next-token choice) and the 4D decoding masks: checked against
HF's own logits processors and against exact probabilities."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from ds_ppo.algo.masks import decode_attention_mask
from ds_ppo.algo.sampling import block_tokens, filter_logits, next_tokens, sample_from_logits


def _hf_filter(logits, temperature, top_k, top_p):
    scores = logits.clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return scores


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.6, 20, 0.8), (1.3, 3, 0.5),
    (1.0, 0, 0.01),  # so small that only the most likely token survives
])
def test_filter_logits_matches_hf_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    ours = filter_logits(logits, temperature, top_k, top_p)
    theirs = _hf_filter(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite])
    kept = finite.sum(-1)
    assert (kept >= 1).all()
    if top_k:
        assert (kept <= top_k).all()
    if (temperature, top_k, top_p) != (1.0, 0, 1.0) and (top_k or top_p < 1):
        assert (kept < logits.shape[-1]).all()  # something was actually removed


def test_sample_from_logits_follows_softmax():
    # exact probabilities of a 6-token distribution with a blocked token, 200k draws
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    probs = torch.softmax(logits, -1)[0]
    g = torch.Generator().manual_seed(1)
    draws = sample_from_logits(logits.expand(200_000, -1), generator=g)
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    assert freq[4] == 0  # -inf is never drawn
    # binomial standard error at p ~ 0.5 and n = 200k is ~0.0011; 5 sigma
    assert (freq - probs.double()).abs().max() < 0.006, (freq, probs)


def test_next_tokens_greedy_is_argmax_and_sampling_respects_top_k():
    torch.manual_seed(0)
    logits = torch.randn(64, 30)
    assert torch.equal(next_tokens(logits, temperature=0.0), logits.argmax(-1))
    draws = torch.stack([next_tokens(logits, 1.0, top_k=3) for _ in range(50)])
    top3 = logits.topk(3, dim=-1).indices
    assert (draws.unsqueeze(-1) == top3).any(-1).all()
    assert len(torch.unique(draws[:, 0])) > 1  # it does sample


def test_block_tokens_python_bool_and_tensor_condition():
    logits = torch.zeros(3, 5)
    block_tokens(logits, torch.tensor([1, 3]))
    assert torch.isinf(logits[:, [1, 3]]).all() and not torch.isinf(logits[:, [0, 2, 4]]).any()
    logits = torch.zeros(3, 5)
    block_tokens(logits, torch.tensor([2]), torch.tensor([True, False, True]).unsqueeze(-1))
    assert torch.isinf(logits[[0, 2], 2]).all() and logits[1, 2] == 0
    logits = torch.zeros(2, 5)
    block_tokens(logits, torch.tensor([2]), torch.tensor([3]) < 2)  # condition false
    assert not torch.isinf(logits).any()


def test_decode_attention_masks():
    pm = torch.tensor([[False, False, True, True], [True, True, True, True]])
    dec = decode_attention_mask(pm, 7)
    assert dec.shape == (2, 1, 1, 7)
    assert dec[0, 0, 0].tolist() == [False, False, True, True, False, False, False]
    pre = decode_attention_mask(pm, 7, prefill=True)
    assert pre.shape == (2, 1, 4, 7)
    assert not pre[..., 4:][~pre[..., :4].all(-1)].any()  # no generated column at prefill
    # row 0: pads attend everywhere (finite), real tokens causally to real tokens only
    assert pre[0, 0, 0].all() and pre[0, 0, 1].all()
    assert pre[0, 0, 2].tolist() == [False, False, True, False, False, False, False]
    assert pre[0, 0, 3].tolist() == [False, False, True, True, False, False, False]
    assert torch.equal(pre[1, 0, :, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError):
        decode_attention_mask(pm, 3)
