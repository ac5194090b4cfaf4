"""Token log-probs and entropies from logits without a float32 (B, T, V) copy.

With 16-bit logits of shape (B, T, V), ``logits.float().log_softmax(-1)`` would
materialise a float32 tensor twice the size of the logits (and autograd would keep
it for backward). Here the work is done in blocks of at most ``chunk_size`` (b, t)
rows: each block is upcast to float32, reduced, and dropped. Autograd is handled
by custom Functions that save only the original logits plus one float per row and
recompute each block's softmax in backward, so peak extra memory is one block,
in forward and in backward.

With a `LogitShape` (the sampling settings: temperature, blocked tokens, top-k, top-p), each
float32 block is shaped by `distribution.shape_logits` before it is reduced, so the log-probs
and entropies are those of the distribution the sampler drew from; backward recomputes the
shaped block (blocked tokens have p = 0, hence no gradient) and divides by the temperature.

Shapes: B = sequences, T = tokens (the positions whose next token is scored),
V = vocabulary. Outputs are float32 (float64 if the logits are float64).

Imports only torch.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .distribution import LogitShape, shape_logits


def _blocks(B: int, T: int, chunk_size: int) -> Iterator[tuple[slice, slice]]:
    """(batch, time) slices covering (B, T) with at most chunk_size rows each.

    Blocks are rectangles of the 3-D tensor, not slices of a flattened (B*T, V) view,
    because ``logits[:, a:b]`` (the usual prompt-stripping slice) cannot be flattened
    without a copy.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if T <= chunk_size:
        rows = chunk_size // max(T, 1)
        for b0 in range(0, B, rows):
            yield slice(b0, min(b0 + rows, B)), slice(0, T)
    else:
        for b in range(B):
            for t0 in range(0, T, chunk_size):
                yield slice(b, b + 1), slice(t0, min(t0 + chunk_size, T))


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


class _Shaper:
    """Applies a `LogitShape` to one (b, t, V) float block of the logits, with the block's
    rows of `new_index` and `keep` (B, T); the identity when there is no shape.
    `chain(grad)`: a gradient w.r.t. the shaped block -> w.r.t. the raw block (the temperature
    division; blocked tokens have p = 0 and so no gradient). `finite(x)`: x with the NaNs of
    0 x -inf (blocked tokens in p_k z_k) made 0."""

    def __init__(self, shape: "LogitShape | None", new_index: torch.Tensor | None,
                 keep: torch.Tensor | None, truncate: bool = True):
        if shape is not None and not truncate and shape.truncates:
            shape = shape.untruncated()
        self.plain = shape is None or shape.is_plain
        self.shape, self.new_index, self.keep = shape, new_index, keep
        self.masks = not self.plain and (bool(shape.suppress_ids) or shape.blocks_eos
                                         or shape.truncates)

    def __call__(self, block: torch.Tensor, bs: slice, ts: slice) -> torch.Tensor:
        if self.plain:
            return block
        def rows(x):
            return None if x is None else x[bs, ts]
        return shape_logits(block, self.shape, rows(self.new_index), rows(self.keep))

    def chain(self, grad: torch.Tensor) -> torch.Tensor:
        t = 1.0 if self.shape is None else self.shape.temperature
        return grad if t in (0.0, 1.0) else grad / t

    def finite(self, x: torch.Tensor) -> torch.Tensor:
        return x.nan_to_num(nan=0.0) if self.masks else x


class _LogprobsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                shaper: "_Shaper") -> torch.Tensor:
        B, T, _ = logits.shape
        dtype = _compute_dtype(logits)
        out = torch.empty(B, T, dtype=dtype, device=logits.device)
        lse = torch.empty(B, T, dtype=dtype, device=logits.device)
        for bs, ts in _blocks(B, T, chunk_size):
            block = shaper(logits[bs, ts].to(dtype), bs, ts)
            lse[bs, ts] = torch.logsumexp(block, dim=-1)
            out[bs, ts] = block.gather(-1, labels[bs, ts].unsqueeze(-1)).squeeze(-1) - lse[bs, ts]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size, ctx.shaper = chunk_size, shaper
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        B, T, _ = logits.shape
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for bs, ts in _blocks(B, T, ctx.chunk_size):
            # d log p_y / d z_k = 1[k = y] - p_k (p_k = 0 on blocked tokens), then / temperature
            block = ctx.shaper(logits[bs, ts].to(lse.dtype), bs, ts)
            probs = torch.exp(block - lse[bs, ts].unsqueeze(-1))
            g = grad_out[bs, ts].unsqueeze(-1)
            block_grad = -probs * g
            block_grad.scatter_add_(-1, labels[bs, ts].unsqueeze(-1), g)
            grad_logits[bs, ts] = ctx.shaper.chain(block_grad).to(logits.dtype)
        return grad_logits, None, None, None


class _EntropyFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int, shaper: "_Shaper") -> torch.Tensor:
        B, T, _ = logits.shape
        dtype = _compute_dtype(logits)
        out = torch.empty(B, T, dtype=dtype, device=logits.device)
        lse = torch.empty(B, T, dtype=dtype, device=logits.device)
        for bs, ts in _blocks(B, T, chunk_size):
            block = shaper(logits[bs, ts].to(dtype), bs, ts)
            block_lse = torch.logsumexp(block, dim=-1)
            probs = torch.exp(block - block_lse.unsqueeze(-1))
            # H = -sum_k p_k log p_k = logsumexp(z) - sum_k p_k z_k (blocked: p_k z_k = 0)
            out[bs, ts] = block_lse - shaper.finite(probs * block).sum(-1)
            lse[bs, ts] = block_lse
        ctx.save_for_backward(logits, lse, out)
        ctx.chunk_size, ctx.shaper = chunk_size, shaper
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, entropy = ctx.saved_tensors
        B, T, _ = logits.shape
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for bs, ts in _blocks(B, T, ctx.chunk_size):
            # dH/dz_k = -p_k * (log p_k + H) (blocked: 0), then / temperature
            log_probs = ctx.shaper(logits[bs, ts].to(lse.dtype), bs, ts) \
                - lse[bs, ts].unsqueeze(-1)
            block_grad = ctx.shaper.finite(
                -torch.exp(log_probs) * (log_probs + entropy[bs, ts].unsqueeze(-1)))
            grad_logits[bs, ts] = ctx.shaper.chain(
                block_grad * grad_out[bs, ts].unsqueeze(-1)).to(logits.dtype)
        return grad_logits, None, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
                         shape: "LogitShape | None" = None,
                         new_index: torch.Tensor | None = None,
                         truncate: bool = True) -> torch.Tensor:
    """log softmax(logits)[label] per position, computed block by block; with `shape`, of the
    logits as the sampler shaped them (`distribution.shape_logits`, the labels kept).

    Args:
        logits: (B, T, V) float of any dtype (bf16/fp16/fp32), already aligned with
            labels (logits at position t score labels[:, t]); may be a non-contiguous
            slice.
        labels: (B, T) long token ids in [0, V) (also at masked positions: use the pad id, not -100).
        chunk_size: (b, t) rows upcast to float32 at a time; peak extra memory is about
            chunk_size * V * 4 bytes (x2 in backward).
        shape: the sampling distribution's `LogitShape` (temperature, blocked tokens, top-k,
            top-p), applied to each float32 block; None: the plain softmax.
        new_index: (B, T) long, tokens already generated in each position's turn (EOS is
            blocked before shape.min_new_tokens); None: no EOS blocking.
        truncate: False leaves out the shape's top-k / top-p.

    Returns:
        (B, T) float32 log-probs (nats), differentiable w.r.t. logits.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits (B, T, V) and labels (B, T); got {tuple(logits.shape)} and {tuple(labels.shape)}")
    labels = labels.long()
    return _LogprobsFromLogits.apply(logits, labels, chunk_size,
                                     _Shaper(shape, new_index, labels, truncate))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024,
                        shape: "LogitShape | None" = None, new_index: torch.Tensor | None = None,
                        labels: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) per position, computed block by block; with `shape`, of the
    distribution the sampler shaped (as in ``logprobs_from_logits``, `labels` kept).

    Args:
        logits: (B, T, V) float of any dtype; may be a non-contiguous slice.
        chunk_size, shape, new_index: as in ``logprobs_from_logits``.
        labels: (B, T) long, the tokens never blocked (the sampled ones); None: none.

    Returns:
        (B, T) float32 entropy (nats), differentiable w.r.t. logits (entropy bonus).
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits (B, T, V); got {tuple(logits.shape)}")
    keep = None if labels is None else labels.long()
    return _EntropyFromLogits.apply(logits, chunk_size, _Shaper(shape, new_index, keep))
