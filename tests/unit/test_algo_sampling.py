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


# ------------------------------------------------------------- one sampled distribution
SHAPES = [
    dict(temperature=1.0, suppress_ids=(0,)),
    dict(temperature=0.7, suppress_ids=(0,), eos_ids=(1, 4), min_new_tokens=3),
    dict(temperature=1.3, top_k=5, suppress_ids=(0,)),
    dict(temperature=0.8, top_p=0.7, eos_ids=(1,), min_new_tokens=2),
    dict(temperature=0.9, top_k=12, top_p=0.8, suppress_ids=(0, 2), eos_ids=(1,),
         min_new_tokens=1),
    dict(temperature=0.0, suppress_ids=(0,), eos_ids=(1,), min_new_tokens=2),  # greedy
]


def _shaped_case(shape_kw, seed=0, B=3, T=5, V=40):
    from ds_ppo.algo.distribution import LogitShape

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    index = torch.arange(T).expand(B, T)
    shape = LogitShape(**shape_kw)
    # the sampled tokens: drawn from the shaped distribution, as the sampler draws them
    from ds_ppo.algo.distribution import shape_logits

    shaped = shape_logits(logits, shape, index)
    labels = (shaped if shape.temperature else shaped * 50).softmax(-1).reshape(-1, V) \
        .multinomial(1, generator=g).reshape(B, T)
    return logits, labels, index, shape


@pytest.mark.parametrize("shape_kw", SHAPES)
def test_sampler_and_trainer_shape_the_same_bits(shape_kw):
    """The decoding step's (B, V) logits and the trainer's (b, t, V) blocks of the same
    float32 logits give the same log-probs to the last bit: one function shapes both."""
    from ds_ppo.algo import logprobs_from_logits
    from ds_ppo.algo.distribution import shape_logits
    from ds_ppo.algo.sampling import next_tokens_with_logprobs

    logits, labels, index, shape = _shaped_case(shape_kw)
    B, T, V = logits.shape
    trainer = logprobs_from_logits(logits, labels, chunk_size=4, shape=shape, new_index=index)
    for t in range(T):  # one decoding step per position, the step's token forced to the label
        step = shape_logits(logits[:, t].clone(), shape, index[:, t])
        chosen, lp = next_tokens_with_logprobs(step, shape.temperature)
        # the step's log-prob of the label, as next_tokens_with_logprobs computes the chosen's
        sampled = logprobs_from_logits(step[:, None], labels[:, t, None])[:, 0]
        assert torch.equal(trainer[:, t], sampled), t
        if shape.temperature == 0:
            assert torch.equal(chosen, step.argmax(-1))
        assert torch.equal(lp, logprobs_from_logits(step[:, None], chosen[:, None])[:, 0])
    assert torch.isfinite(trainer).all()
    # what the shape does: EOS blocked before min_new_tokens, the suppressed ids never
    shaped = shape_logits(logits, shape, index)
    for tok in shape.suppress_ids:
        assert torch.isinf(shaped[..., tok]).all()
    if shape.min_new_tokens:
        early = index < shape.min_new_tokens
        for tok in shape.eos_ids:
            assert torch.isinf(shaped[..., tok][early]).all()
            assert torch.isfinite(shaped[..., tok][~early]).any()


def _reference(logits, labels, index, shape):
    """Log-probs and entropy of the shaped distribution by plain autograd ops."""
    from ds_ppo.algo.distribution import shape_logits

    shaped = shape_logits(logits, shape, index, keep=labels)
    logp = torch.log_softmax(shaped, -1)
    blocked = torch.isinf(shaped)
    entropy = torch.logsumexp(shaped, -1) - (logp.exp() * shaped.masked_fill(blocked, 0)).sum(-1)
    return logp.gather(-1, labels[..., None])[..., 0], entropy


@pytest.mark.parametrize("shape_kw", SHAPES)
def test_shaped_logprobs_and_entropy_and_their_gradients(shape_kw):
    """The block-wise Functions (and the tiled one, from hidden states) give the shaped
    distribution's log-probs and entropy and their gradients, as autograd through the shaped
    logits does: blocked tokens have no mass and no gradient, the temperature scales it."""
    from ds_ppo.algo import entropy_from_logits, logprobs_from_logits, tiled_logprobs

    logits, labels, index, shape = _shaped_case(shape_kw, seed=1)
    logits = logits.double()
    w = torch.randn(logits.shape[:2], dtype=torch.float64)
    ref_in = logits.clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_in, labels, index, shape)
    ref_grad, = torch.autograd.grad((ref_lp * w).sum(), ref_in, retain_graph=True)
    ref_ent_grad, = torch.autograd.grad((ref_ent * w).sum(), ref_in)

    x = logits.clone().requires_grad_()
    lp = logprobs_from_logits(x, labels, chunk_size=4, shape=shape, new_index=index)
    (lp * w).sum().backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(x.grad, ref_grad)
    x.grad = None
    ent = entropy_from_logits(x, chunk_size=4, shape=shape, new_index=index, labels=labels)
    (ent * w).sum().backward()
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(x.grad, ref_ent_grad)

    # tiled: the same logits as head(hidden) = hidden @ W with W the identity
    hidden = logits.clone().requires_grad_()
    head = torch.nn.Linear(logits.shape[-1], logits.shape[-1], bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.eye(logits.shape[-1], dtype=torch.float64))
    tlp, tent = tiled_logprobs(hidden, labels, head, 4, with_entropy=True, shape=shape,
                               new_index=index)
    (tlp * w).sum().backward()
    torch.testing.assert_close(tlp, ref_lp)
    torch.testing.assert_close(tent, ref_ent.detach())
    torch.testing.assert_close(hidden.grad, ref_grad)


def test_the_reference_untruncated_and_the_sampled_token_kept():
    """truncate=False leaves top-k / top-p out (the reference's log-probs: finite for a token
    outside its own top-k), keeps the blocked pad; a sampled token the trainer's top-k would
    cut (a near tie) keeps its logit, so its log-prob is finite."""
    from ds_ppo.algo import logprobs_from_logits
    from ds_ppo.algo.distribution import LogitShape

    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.5, 0.0]]])
    shape = LogitShape(temperature=1.0, top_k=2, suppress_ids=(4,))
    outside = torch.tensor([[3]])  # not in the top 2
    truncated = logprobs_from_logits(logits, outside, shape=shape)
    full = logprobs_from_logits(logits, outside, shape=shape, truncate=False)
    kept = torch.tensor([3.0, 2.0, 0.5])  # top 2 and the label
    torch.testing.assert_close(truncated[0, 0], 0.5 - torch.logsumexp(kept, 0))
    torch.testing.assert_close(full[0, 0], 0.5 - torch.logsumexp(logits[0, 0, :4], 0))


def test_turn_token_index_counts_from_each_turn_start():
    from ds_ppo.algo import turn_token_index

    starts = torch.tensor([[1, 0, 0, 0, 0, 1, 0], [0, 0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    assert turn_token_index(starts).tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 0, 1, 0, 1, 2]]
