"""ds_ppo.algo.tiled: log-probs and entropies from hidden states, the output head applied tile by
tile, equal to the untiled computation (values and gradients, fp32) and never creating a
vocabulary-wide tensor larger than one tile's."""
from __future__ import annotations

import pytest
import torch

from ds_ppo.algo import entropy_from_logits, logprobs_from_logits, tiled_logprobs
from support.big_tensors import LargestTensor

B, T, H, V = 2, 23, 8, 97


def _setup(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(H, V, bias=True).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    # a non-contiguous slice, as forward.py passes hidden[:, P-1:L-1]
    hidden = torch.randn(B, T + 3, H, generator=g).to(dtype)[:, 2:-1].requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)
    return head, hidden, labels, upstream


def _grads(head, hidden):
    out = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    for p in head.parameters():
        p.grad = None
    return out


@pytest.mark.parametrize("tile", [1, 5, 23, 1000])
def test_tiled_equals_untiled_values_entropy_and_gradients(tile):
    head, hidden, labels, upstream = _setup()
    logits = head(hidden) / 0.7
    ref = logprobs_from_logits(logits, labels)
    ref_ent = entropy_from_logits(logits.detach())
    (ref * upstream).sum().backward()
    ref_grads = _grads(head, hidden)
    flags = []
    lp, ent = tiled_logprobs(hidden, labels, lambda h: head(h) / 0.7, tile, with_entropy=True,
                             before_backward_tile=flags.append)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (B, T)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert not ent.requires_grad  # a metric
    (lp * upstream).sum().backward()
    for got, want in zip(_grads(head, hidden), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tiles = -(-B * T // tile)
    assert flags == [False] * (tiles - 1) + [True]  # ZeRO reduces the head's grad once, last


@pytest.mark.parametrize("tile", [1, 5, 1000])
def test_tiled_entropy_gradient_equals_untiled(tile):
    """entropy_grad (ppo.entropy_coef): a loss of both outputs, log-probs and entropy, has the
    gradient of the untiled computation, whose entropy autograd differentiates; without it the
    entropy carries no gradient."""
    head, hidden, labels, upstream = _setup()
    up_ent = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    logits = head(hidden) / 0.7
    z = logits.float()
    want_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)  # plain autograd, no custom kernel
    ((logprobs_from_logits(logits, labels) * upstream).sum()
     + (want_ent * up_ent).sum()).backward()
    ref_grads = _grads(head, hidden)
    lp, ent = tiled_logprobs(hidden, labels, lambda h: head(h) / 0.7, tile, with_entropy=True,
                             entropy_grad=True)
    torch.testing.assert_close(ent, want_ent.detach(), atol=1e-5, rtol=0)
    assert ent.requires_grad
    ((lp * upstream).sum() + (ent * up_ent).sum()).backward()
    for got, want in zip(_grads(head, hidden), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the entropy alone: its gradient differs from zero (the check above could not pass by
    # ignoring it: the log-prob part alone is a different gradient)
    _, ent = tiled_logprobs(hidden, labels, lambda h: head(h) / 0.7, tile, with_entropy=True,
                            entropy_grad=True)
    (ent * up_ent).sum().backward()
    assert _grads(head, hidden)[0].abs().max() > 1e-3


def test_tiled_16bit_logits_are_reduced_in_fp32():
    head, hidden, labels, _ = _setup(torch.bfloat16)
    want = logprobs_from_logits(head(hidden), labels)
    tiles, _ = tiled_logprobs(hidden, labels, head, 4)
    assert tiles.dtype == torch.float32
    # other matmul shapes round their bf16 logits differently (CPU kernels differ even for one
    # tile of the flattened rows): a 16-bit tolerance, logits ~ 10
    torch.testing.assert_close(tiles, want, atol=0.1, rtol=0)


def test_no_tensor_of_the_logits_size_is_created():
    """Forward and backward create nothing with B*T*V elements, while the untiled computation
    does (the check can fail). The largest tiled tensor is the head's weight gradient (V x H)
    or one tile's logits."""
    head, hidden, labels, upstream = _setup()
    with LargestTensor() as untiled:
        (logprobs_from_logits(head(hidden), labels) * upstream).sum().backward()
    assert untiled.numel >= B * T * V
    with LargestTensor() as tiled:
        lp, _ = tiled_logprobs(hidden, labels, head, 4, with_entropy=True)
        (lp * upstream).sum().backward()
    assert tiled.numel <= max(V * H, 4 * V) < B * T * V


def test_bad_shapes_and_tile():
    head, hidden, labels, _ = _setup()
    with pytest.raises(ValueError, match="expected hidden"):
        tiled_logprobs(hidden[0], labels, head, 4)
    with pytest.raises(ValueError, match="tile_tokens"):
        tiled_logprobs(hidden, labels, head, 0)


def test_extra_head_calls_change_nothing_but_the_call_count():
    """`calls` (ranks whose head calls are collective make equally many): the head runs that
    many times in forward and again in backward, the values and gradients those of the plain
    tiles, and ZeRO's reduce flag is set on the last call only."""
    head, hidden, labels, upstream = _setup()
    lp0, _ = tiled_logprobs(hidden, labels, head, 10)
    (lp0 * upstream).sum().backward()
    want = _grads(head, hidden)
    seen, flags = [], []

    def counted(h):
        seen.append(h.shape[0])
        return head(h)

    lp, _ = tiled_logprobs(hidden, labels, counted, 10, before_backward_tile=flags.append,
                           calls=7)
    assert seen == [10, 10, 10, 10, 6, 1, 1]  # 46 positions: 5 tiles, then 2 that keep step
    torch.testing.assert_close(lp, lp0, atol=0, rtol=0)
    (lp * upstream).sum().backward()
    assert seen[7:] == seen[:7] and flags == [False] * 6 + [True]
    for got, w in zip(_grads(head, hidden), want):
        torch.testing.assert_close(got, w, atol=0, rtol=0)
    # no positions at all (an empty packed micro-batch): the head still keeps step
    seen.clear()
    empty = hidden[:, :0].detach().requires_grad_()
    out, _ = tiled_logprobs(empty, labels[:, :0], counted, 10, calls=2)
    out.sum().backward()
    assert out.shape == (B, 0) and seen == [1, 1, 1, 1]
