"""ds_ppo/engine/batch_invariant.py: the kernels give each row the same bits whatever else is
in the batch and however its keys are laid out, agree with torch's to rounding, and the block
swaps them in and out."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_ppo.engine.batch_invariant import (active, attention, batch_invariant, linear,
                                           matmul)


def test_matmul_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 96, generator=g), torch.randn(130, 96, generator=g)
    whole = matmul(x, w)
    for rows in ([0], [5, 6, 7], list(range(0, 300, 7))):
        assert torch.equal(matmul(x[rows], w), whole[rows])
    torch.testing.assert_close(whole, x @ w.T, rtol=1e-5, atol=1e-4)


def test_linear_backward_is_the_ordinary_one():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 12, generator=g, requires_grad=True)
    w = torch.randn(7, 12, generator=g, requires_grad=True)
    b = torch.randn(7, generator=g, requires_grad=True)
    up = torch.randn(2, 5, 7, generator=g)
    grads = torch.autograd.grad((linear(x, w, b) * up).sum(), (x, w, b))
    want = torch.autograd.grad((F.linear(x, w, b) * up).sum(), (x, w, b))
    for a, e in zip(grads, want):
        torch.testing.assert_close(a, e)


def test_attention_depends_on_the_set_of_keys_only():
    """The same query over the same keys, laid out in another order among masked columns of
    other widths (a ring cache's columns, left padding), gives the same bits; the result is
    sdpa's to rounding (grouped-query heads, a bool mask, an additive one, causal)."""
    g = torch.Generator().manual_seed(2)
    B, H, KVH, Q, K, D = 2, 4, 2, 3, 9, 8
    q = torch.randn(B, H, Q, D, generator=g)
    k, v = torch.randn(B, KVH, K, D, generator=g), torch.randn(B, KVH, K, D, generator=g)
    out, _ = attention(None, q, k, v, None)
    rep = lambda t: t.repeat_interleave(H // KVH, dim=1)  # noqa: E731
    ref = F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=False,
                                         attn_mask=torch.ones(Q, K, dtype=torch.bool).tril(K - Q))
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    # the last query attends to all 9 keys: permuted, among 7 masked columns of junk
    perm = torch.randperm(K, generator=g)
    wide = 16
    cols = torch.randperm(wide, generator=g)[:K]
    k2, v2 = torch.randn(B, KVH, wide, D, generator=g), torch.randn(B, KVH, wide, D, generator=g)
    k2[:, :, cols], v2[:, :, cols] = k[:, :, perm], v[:, :, perm]
    keep = torch.zeros(B, 1, 1, wide, dtype=torch.bool)
    keep[..., cols] = True
    ringed, _ = attention(None, q[:, :, -1:], k2, v2, keep)
    assert torch.equal(ringed[:, 0], out[:, -1])
    additive = torch.zeros(B, 1, 1, wide).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert torch.equal(attention(None, q[:, :, -1:], k2, v2, additive)[0], ringed)


def test_the_block_swaps_the_kernels_in_and_out():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    plain = F.linear
    with batch_invariant(False):
        assert F.linear is plain and not active()
    with batch_invariant():
        with batch_invariant():
            assert F.linear is linear and ALL_ATTENTION_FUNCTIONS["sdpa"] is attention
        assert active() and ALL_ATTENTION_FUNCTIONS["eager"] is attention
    assert F.linear is plain and not active()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not attention
    assert "eager" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_a_lora_layer_with_a_released_zero3_weight_runs_its_own_forward():
    """lora.merged_linear reads the layer's weights directly, so it steps aside (None) when
    ZeRO-3 has released one to its shard: the layer's own forward then gathers it."""
    import peft

    from ds_ppo.engine import lora

    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 4)), peft.LoraConfig(
        r=2, target_modules=["0"], lora_dropout=0.0), adapter_name=lora.ADAPTER)
    layer = model.base_model.model[0]
    x = torch.randn(3, 8)
    weight = layer.base_layer.weight
    weight.ds_id, weight.ds_numel = 0, weight.numel()  # a ZeRO-3 parameter, gathered
    torch.testing.assert_close(lora.merged_linear(layer, x), layer(x))
    weight.data = torch.empty(0)  # released to this rank's (empty) shard
    assert lora.merged_linear(layer, x) is None
