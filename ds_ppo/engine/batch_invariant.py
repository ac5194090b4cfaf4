"""Batch-invariant kernels (`generation.batch_invariant`): a model's outputs for one sequence
do not depend on what else is in the batch, on how the sequence is laid out (left padding, a
KV cache's columns) or on how many positions one forward computes, so the sampler's decoding
step and the trainer's whole-sequence forward give the same logits to the last bit.

Why the two differ otherwise: a matmul library picks its kernel and its split of the reduction
by the shape (a decoding step multiplies S rows, the training forward B x L rows), and attention
sums over the keys in an order that depends on the cache's width and columns; float addition is
not associative, so the last bits differ (He et al. 2025, "Defeating Nondeterminism in LLM
Inference", Thinking Machines Lab, whose batch_invariant_ops replaces the CUDA mm, log-softmax
and mean kernels with fixed-order Triton ones; vLLM's VLLM_BATCH_INVARIANT and SGLang's
deterministic mode build on it).

Here, in pure torch (a reference that runs on any device; on a GPU it is slow, see
docs/SAMPLING.md for what it costs):

- `linear`: each output element is the sum over K of x_k * w_k, multiplied elementwise and
  reduced along the contiguous last axis of a (rows, N, K) block, so its order depends on K
  only, never on the number of rows; float32 accumulation. Its backward is the ordinary matmul
  (gradients need no invariance).
- `attention`: scores as q * k summed over the head dimension; the softmax's denominator and
  the weighted sum of values are sums over keys taken in sorted order with a sequential
  cumulative sum, so they depend on the set of (unmasked) keys only: not on their columns, nor
  on the masked columns around them (each adds an exact 0).
- RMSNorm and the log-softmax reduce each row along its own last axis: already invariant.

`batch_invariant()` swaps them in for torch.nn.functional.linear and the sdpa / eager
attention of transformers models for the block (the trainer holds it around each iteration);
`active()` says whether it is on (the decoding loop then leaves its grouped attention aside).
Imports torch and transformers only.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

BLOCK_ELEMENTS = 2**24  # products materialised at a time by `linear` (64 MiB in float32)
_DEPTH = [0]


def active() -> bool:
    """Whether a `batch_invariant()` block is running."""
    return _DEPTH[0] > 0


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(..., K) @ (N, K)^T -> (..., N) in float32, each element reduced in an order that
    depends on K only (module docstring); rows in blocks of at most BLOCK_ELEMENTS products."""
    K, N = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, K).float()
    w = weight.float()
    out = torch.empty(flat.shape[0], N, dtype=torch.float32, device=x.device)
    rows = max(1, BLOCK_ELEMENTS // max(N * K, 1))
    for a in range(0, flat.shape[0], rows):
        out[a:a + rows] = (flat[a:a + rows, None, :] * w[None]).sum(-1)
    return out.reshape(*x.shape[:-1], N)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        out = matmul(x, weight)
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat_g = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight.to(grad.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (flat_g.T @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        grad_b = flat_g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """torch.nn.functional.linear, batch-invariant in forward (`matmul`)."""
    return _Linear.apply(x, weight, bias)


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum along `dim` of the values in ascending order, added one after another: it
    depends on the multiset of values only (extra zeros add exact 0s)."""
    return torch.sort(x, dim=dim).values.cumsum(dim).select(dim, -1)


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function (query (B, H, Q, D), key/value (B, KVH, K, D)) ->
    ((B, Q, H, D), None), batch-invariant (module docstring). attention_mask: bool (True =
    attend, as sdpa takes it), additive (0 = attend, as eager adds it) or None (causal, the
    queries being the last Q positions)."""
    B, H, Q, D = query.shape
    K = key.shape[2]
    if key.shape[1] != H:  # grouped-query heads: head h reads KV head h // (H / KVH)
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    scale = D ** -0.5 if scaling is None else scaling
    scores = (query.float()[..., :, None, :] * key.float()[..., None, :, :]).sum(-1) * scale
    if attention_mask is None:
        rows = torch.arange(Q, device=query.device)[:, None] + (K - Q)
        keep = torch.arange(K, device=query.device)[None, :] <= rows
    else:
        mask = attention_mask[..., :K]
        keep = mask if mask.dtype == torch.bool else mask == 0
    scores = scores.masked_fill(~keep, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a query with no key
    weights = torch.exp(scores - top)  # (B, H, Q, K), 0 on masked keys
    total = _ordered_sum(weights, -1)  # (B, H, Q)
    summed = _ordered_sum(weights[..., None] * value.float()[:, :, None], -2)  # (B, H, Q, D)
    out = summed / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _lora_forward(forward):
    """peft's LoRA Linear forward, computing with the merged weight where it can
    (`lora.merged_linear`), else `forward` (the layer's own)."""
    from ds_ppo.engine.lora import merged_linear

    def merged(layer, x, *args, **kwargs):
        out = None if args or kwargs else merged_linear(layer, x)
        return forward(layer, x, *args, **kwargs) if out is None else out
    return merged


@contextmanager
def batch_invariant(on: bool = True):
    """Within the block, torch.nn.functional.linear and transformers' sdpa / eager attention
    are the batch-invariant `linear` and `attention`, and a peft LoRA Linear layer (peft
    imported) computes with its merged weight as the replica does (`lora.merged_linear`);
    off: nothing changes. Nestable."""
    if not on:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    functional = torch.nn.functional
    lora = sys.modules.get("peft.tuners.lora")  # no LoRA model exists without it
    if _DEPTH[0] == 0:
        saved = (functional.linear, {k: ALL_ATTENTION_FUNCTIONS._local_mapping.get(k)
                                     for k in ("sdpa", "eager")},
                 lora and lora.Linear.forward)
        functional.linear = linear
        for k in ("sdpa", "eager"):
            ALL_ATTENTION_FUNCTIONS[k] = attention
        if lora:
            lora.Linear.forward = _lora_forward(lora.Linear.forward)
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            functional.linear = saved[0]
            for k, fn in saved[1].items():
                if fn is None:
                    del ALL_ATTENTION_FUNCTIONS[k]
                else:
                    ALL_ATTENTION_FUNCTIONS[k] = fn
            if saved[2]:
                lora.Linear.forward = saved[2]
