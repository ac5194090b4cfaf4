"""Token log-probs and entropies from hidden states, the output head applied one tile of tokens
at a time: the (B, T, V) logits are never materialised, in forward or in backward.

`logits.py` works from logits the model already computed, so a (B, T, V) tensor in the model's
dtype exists (for one 32k-token row of a 128k vocabulary, 8 GiB in bf16, 16 GiB in fp32).
Here the caller passes the final hidden states (B, T, H) and the head (hidden -> logits);
each tile of at most `tile_tokens` positions goes through the head, is reduced to one float per
position and dropped. Backward recomputes each tile's logits (one more head matmul per tile,
as activation checkpointing does for a layer) and accumulates the head's parameter gradients
tile by tile; the Function itself saves only the hidden states, the labels and nothing of size
V. The same idea as Liger-Kernel's fused linear cross-entropy and DeepSpeed ALST's
TiledFusedLogitsLoss (Bekman et al. 2025), for per-token log-probs rather than a scalar loss.

Shapes: B = sequences, T = positions whose next token is scored, H = hidden size, V =
vocabulary. Outputs are float32 (float64 for float64 inputs).

Imports only torch.
"""
from __future__ import annotations

from typing import Callable

import torch

from .distribution import LogitShape, shape_logits

Head = Callable[[torch.Tensor], torch.Tensor]  # (n, H) hidden -> (n, V) logits


def _shaped(logits: torch.Tensor, shape: "LogitShape | None", index: torch.Tensor | None,
            labels: torch.Tensor) -> torch.Tensor:
    """(n, V) logits in at least float32, shaped as the sampler shaped them (`shape_logits`,
    the labels kept); as they are without a shape."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if shape is None or shape.is_plain:
        return z
    return shape_logits(z, shape, index, labels)


def _chain(grad: torch.Tensor, shape: "LogitShape | None") -> torch.Tensor:
    """A gradient w.r.t. the shaped logits -> w.r.t. the head's logits (the temperature
    division; blocked tokens have p = 0, so no gradient)."""
    t = 1.0 if shape is None else shape.temperature
    return grad if t in (0.0, 1.0) else grad.div_(t)


def _tile_stats(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool,
                shape: "LogitShape | None" = None, index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n,) log p(label) and (n,) entropy (or None) of (n, V) logits (shaped by `shape`),
    computed in at least float32 (the formulas of logits.py: log p_y = z_y - logsumexp(z);
    H = logsumexp(z) - sum_k p_k z_k, blocked tokens adding 0)."""
    z = _shaped(logits, shape, index, labels)
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = lse - (torch.softmax(z, dim=-1) * z).nan_to_num(nan=0.0).sum(-1)
    return logprobs, entropy


def tile_count(n: int, tile_tokens: int) -> int:
    """How many tiles of at most `tile_tokens` positions `n` positions make."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    return -(-n // tile_tokens)


def _tiles(n: int, tile_tokens: int, calls: int = 0) -> list[slice]:
    """The tiles of `n` positions, then empty ones up to `calls` in all (each an idle head call
    on one position of zeros: it keeps step with other ranks, its outputs dropped)."""
    count = tile_count(n, tile_tokens)
    tiles = [slice(a, min(a + tile_tokens, n)) for a in range(0, n, tile_tokens)]
    return tiles + [slice(0, 0)] * (calls - count)


class _TiledLogprobs(torch.autograd.Function):
    """(N, H) hidden -> (N,) log-probs [, (N,) entropy, differentiable only with `entropy_grad`];
    see the module docstring. `before_backward_tile(last)` runs before each tile's backward
    (ZeRO uses it to reduce the head's gradient once, after the last tile). `calls`: the head
    runs at least this many times in forward and again in backward, the extra calls on an empty
    tile (a ZeRO-3 head's calls are collective: every rank must make as many)."""

    @staticmethod
    def forward(ctx, hidden, labels, head, tile_tokens, with_entropy, before_backward_tile,
                shape, index, entropy_grad, calls):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device) if with_entropy else None
        with torch.no_grad():
            for s in _tiles(n, tile_tokens, calls):
                if s.stop == s.start:
                    head(hidden.new_zeros((1, hidden.shape[-1])))  # idle
                    continue
                lp, ent = _tile_stats(head(hidden[s]), labels[s], with_entropy, shape,
                                      None if index is None else index[s])
                logprobs[s] = lp
                if with_entropy:
                    entropy[s] = ent
        ctx.head, ctx.tile_tokens, ctx.hook = head, tile_tokens, before_backward_tile
        ctx.calls = calls
        ctx.shape, ctx.index = shape, index
        ctx.entropy_grad = entropy is not None and entropy_grad
        if ctx.entropy_grad:  # dH/dz needs H: one float per position
            ctx.save_for_backward(hidden, labels, entropy)
        else:
            ctx.save_for_backward(hidden, labels)
        if entropy is None:
            return logprobs, None
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, labels = ctx.saved_tensors[:2]
        entropy = ctx.saved_tensors[2] if ctx.entropy_grad else None
        if entropy is None or grad_entropy is None:
            grad_entropy = None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        tiles = _tiles(hidden.shape[0], ctx.tile_tokens, ctx.calls)
        for i, s in enumerate(tiles):
            if ctx.hook is not None:
                ctx.hook(i == len(tiles) - 1)
            if s.stop == s.start:  # idle: a zero gradient
                with torch.enable_grad():
                    logits = ctx.head(hidden.new_zeros((1, hidden.shape[-1])))
                torch.autograd.backward(logits, torch.zeros_like(logits))
                continue
            h = hidden[s].detach().requires_grad_(grad_hidden is not None)
            with torch.enable_grad():
                logits = ctx.head(h)  # (n, V), its graph through the head only
            # d log p_y / d z_k = 1[k = y] - p_k, written in place into one (n, V) buffer
            z = logits.detach().to(torch.promote_types(logits.dtype, torch.float32), copy=True)
            if ctx.shape is not None and not ctx.shape.is_plain:
                z = _shaped(z, ctx.shape, None if ctx.index is None else ctx.index[s], labels[s])
            z -= torch.logsumexp(z, dim=-1, keepdim=True)  # log p (-inf where blocked)
            g = grad_logprobs[s].unsqueeze(-1).to(z.dtype)
            if grad_entropy is None:
                grad_logits = z.exp_().mul_(-g)
            else:
                # dH/dz_k = -p_k (log p_k + H), added to the log-prob term's -g p_k; a blocked
                # token (p_k = 0, log p_k = -inf) gets none
                gh = grad_entropy[s].unsqueeze(-1).to(z.dtype)
                p = z.exp()
                scale = (z + entropy[s].unsqueeze(-1).to(z.dtype)).mul_(gh).add_(g)
                grad_logits = p.mul_(scale).neg_().masked_fill_(z == float("-inf"), 0.0)
                del scale
            grad_logits = _chain(grad_logits.scatter_add_(-1, labels[s].unsqueeze(-1), g),
                                 ctx.shape)
            # accumulates the head's parameter gradients (.grad) tile by tile, as reentrant
            # activation checkpointing does
            torch.autograd.backward(logits, grad_logits.to(logits.dtype))
            del logits, z, grad_logits  # else two tiles' (n, V) tensors meet at the next head call
            if grad_hidden is not None:
                grad_hidden[s] = h.grad
        return grad_hidden, None, None, None, None, None, None, None, None, None


def tiled_logprobs(hidden: torch.Tensor, labels: torch.Tensor, head: Head, tile_tokens: int,
                   with_entropy: bool = False,
                   before_backward_tile: Callable[[bool], None] | None = None,
                   shape: "LogitShape | None" = None, new_index: torch.Tensor | None = None,
                   entropy_grad: bool = False, calls: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden))[label] per position (and the entropy of that softmax), the head
    applied `tile_tokens` positions at a time; with `shape`, of the logits as the sampler
    shaped them (as `logprobs_from_logits`).

    Args:
        hidden: (B, T, H) final hidden states aligned with labels (hidden[:, t] predicts
            labels[:, t]); may be a non-contiguous slice; with grad for the update.
        labels: (B, T) long token ids in [0, V) (also at masked positions).
        head: (n, H) -> (n, V) logits (the output layer); its
            parameters get their gradients during backward, tile by tile.
        tile_tokens: positions per tile; peak extra memory about tile_tokens x V x (logits'
            bytes + 4 for the float32 copy), x2 in backward.
        with_entropy: also return the entropy.
        before_backward_tile: called with `last` (bool) before each tile's backward.
        shape, new_index ((B, T) long or None): as in `logprobs_from_logits`.
        entropy_grad: the entropy is differentiable too (an entropy bonus in the loss; backward
            needs one more (n, V) buffer per tile); else it is a metric without gradient.
        calls: the head is called at least this many times in forward and in backward (the
            extra calls on one position of zeros, their outputs dropped): where the head's calls
            are collective (ZeRO-3 gathers its weight for each), every rank passes the largest
            `tile_count` of any rank.

    Returns:
        (B, T) float32 log-probs (nats), differentiable w.r.t. hidden and the head's
        parameters; (B, T) float32 entropy (nats; differentiable with `entropy_grad`) or None.
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"expected hidden (B, T, H) and labels (B, T); got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")
    B, T, H = hidden.shape
    flat = hidden.reshape(B * T, H)
    index = None if new_index is None else new_index.reshape(B * T)
    lp, ent = _TiledLogprobs.apply(flat, labels.reshape(B * T).long(), head, tile_tokens,
                                   with_entropy, before_backward_tile, shape, index,
                                   entropy_grad, calls)
    return lp.view(B, T), (ent.view(B, T) if ent is not None else None)
