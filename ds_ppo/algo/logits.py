"""Token log-probs and entropies from logits without a float32 (B, T, V) copy.

With 16-bit logits of shape (B, T, V), ``logits.float().log_softmax(-1)`` would
materialise a float32 tensor twice the size of the logits (and autograd would keep
it for backward). Here the work is done in blocks of at most ``chunk_size`` (b, t)
rows: each block is upcast to float32, reduced, and dropped. Autograd is handled
by custom Functions that save only the original logits plus one float per row and
recompute each block's softmax in backward, so peak extra memory is one block,
in forward and in backward.

Shapes: B = sequences, T = tokens (the positions whose next token is scored),
V = vocabulary. Outputs are float32 (float64 if the logits are float64).

Imports only torch.
"""

from typing import Iterator

import torch


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


class _LogprobsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        B, T, _ = logits.shape
        dtype = _compute_dtype(logits)
        out = torch.empty(B, T, dtype=dtype, device=logits.device)
        lse = torch.empty(B, T, dtype=dtype, device=logits.device)
        for bs, ts in _blocks(B, T, chunk_size):
            block = logits[bs, ts].to(dtype)
            lse[bs, ts] = torch.logsumexp(block, dim=-1)
            out[bs, ts] = block.gather(-1, labels[bs, ts].unsqueeze(-1)).squeeze(-1) - lse[bs, ts]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        B, T, _ = logits.shape
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for bs, ts in _blocks(B, T, ctx.chunk_size):
            # d log p_y / d z_k = 1[k = y] - p_k
            probs = torch.exp(logits[bs, ts].to(lse.dtype) - lse[bs, ts].unsqueeze(-1))
            g = grad_out[bs, ts].unsqueeze(-1)
            block_grad = -probs * g
            block_grad.scatter_add_(-1, labels[bs, ts].unsqueeze(-1), g)
            grad_logits[bs, ts] = block_grad.to(logits.dtype)
        return grad_logits, None, None


class _EntropyFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        B, T, _ = logits.shape
        dtype = _compute_dtype(logits)
        out = torch.empty(B, T, dtype=dtype, device=logits.device)
        lse = torch.empty(B, T, dtype=dtype, device=logits.device)
        for bs, ts in _blocks(B, T, chunk_size):
            block = logits[bs, ts].to(dtype)
            block_lse = torch.logsumexp(block, dim=-1)
            probs = torch.exp(block - block_lse.unsqueeze(-1))
            # H = -sum_k p_k log p_k = logsumexp(z) - sum_k p_k z_k
            out[bs, ts] = block_lse - (probs * block).sum(-1)
            lse[bs, ts] = block_lse
        ctx.save_for_backward(logits, lse, out)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, entropy = ctx.saved_tensors
        B, T, _ = logits.shape
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for bs, ts in _blocks(B, T, ctx.chunk_size):
            # dH/dz_k = -p_k * (log p_k + H)
            log_probs = logits[bs, ts].to(lse.dtype) - lse[bs, ts].unsqueeze(-1)
            block_grad = -torch.exp(log_probs) * (log_probs + entropy[bs, ts].unsqueeze(-1))
            grad_logits[bs, ts] = (block_grad * grad_out[bs, ts].unsqueeze(-1)).to(logits.dtype)
        return grad_logits, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits)[label] per position, computed block by block.

    Args:
        logits: (B, T, V) float of any dtype (bf16/fp16/fp32), already aligned with
            labels (logits at position t score labels[:, t]); may be a non-contiguous
            slice.
        labels: (B, T) long token ids in [0, V) (also at masked positions: use the pad id, not -100).
        chunk_size: (b, t) rows upcast to float32 at a time; peak extra memory is about
            chunk_size * V * 4 bytes (x2 in backward).

    Returns:
        (B, T) float32 log-probs (nats), differentiable w.r.t. logits.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits (B, T, V) and labels (B, T); got {tuple(logits.shape)} and {tuple(labels.shape)}")
    return _LogprobsFromLogits.apply(logits, labels.long(), chunk_size)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) per position, computed block by block.

    Args:
        logits: (B, T, V) float of any dtype; may be a non-contiguous slice.
        chunk_size: as in ``logprobs_from_logits``.

    Returns:
        (B, T) float32 entropy (nats), differentiable w.r.t. logits (entropy bonus).
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits (B, T, V); got {tuple(logits.shape)}")
    return _EntropyFromLogits.apply(logits, chunk_size)
