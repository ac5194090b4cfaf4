"""Transient bytes of a forward or backward pass: activations, logits and the KV cache."""
from __future__ import annotations

from ds_ppo.plan.shapes import ModelShape


def layer_activation_bytes(shape: ModelShape, seq: int, batch: int, eager: bool) -> int:
    """16-bit activations one decoder layer saves for backward (pre-norm, gated MLP, GQA, no
    dropout), counted the way Korthikanti et al. 2022 count a GPT layer's 34*s*b*h:

      attention: 2sbh input of QKV + 2sbh Q + 4*s*b*kv_dim K and V + 2sbh input of the output
                 projection; eager attention adds scores and probabilities, 4*a*s^2*b
                 (SDPA/flash kernels never store them, the 5as/h term of the paper goes away)
      MLP:       2sbh input + 8*s*b*i for gate, up, act(gate) and act(gate)*up
      norms:     2 x 4sbh, the fp32 inputs of the two RMSNorms
    """
    s, b, h, i = seq, batch, shape.hidden, shape.intermediate
    kv_dim = shape.kv_heads * shape.head_dim
    total = s * b * (16 * h + 4 * kv_dim + 8 * i)
    if eager:
        total += 4 * shape.heads * s * s * b
    return total


def train_activation_bytes(shape: ModelShape, seq: int, batch: int, checkpointing: bool,
                           eager: bool) -> int:
    """Activations of one forward/backward: every layer's, or with (per-layer) checkpointing
    each layer's 16-bit input plus one layer recomputed in full during backward."""
    layer = layer_activation_bytes(shape, seq, batch, eager)
    if checkpointing:
        return shape.layers * 2 * seq * batch * shape.hidden + layer
    return shape.layers * layer


def prefill_activation_bytes(shape: ModelShape, tokens: int, batch: int, eager: bool,
                             tp: int = 1) -> int:
    """Peak activations of a prefill through the generation replica (no grad, layers one after
    another, so only one layer's tensors are alive besides the residual stream), per rank.
    16-bit tensors, h = hidden, kv = kv_heads * head_dim, i = intermediate; the projections'
    outputs are 1/tp wide under tensor parallelism, the residual stream is whole. Per token:

      RMSNorm:   2h residual + 8h (its fp32 upcast and the fp32 normalised copy)        = 10h
      attention: 2h residual + 2h normed + (2h q + 4kv k, v + 2h + 2kv rotated q, k
                 + 2h attention output) / tp + 2h output projection     = 6h + (6h + 6kv)/tp
      MLP:       2h residual + 2h normed + 6i/tp (act(gate), up, their product)  = 4h + 6i/tp

    and the peak is the largest of the three; eager attention adds its scores and
    probabilities, 4 * (heads/tp) * s^2 * b. The KV cache and the last position's logits (both
    loops prefill with logits_to_keep=1) are separate terms of the plan."""
    h, i = shape.hidden, shape.intermediate
    kv = shape.kv_heads * shape.head_dim
    per_token = max(10 * h, 6 * h + (6 * h + 6 * kv) // tp, 4 * h + 6 * i // tp)
    total = tokens * batch * per_token
    if eager:
        total += 4 * (shape.heads // tp) * tokens * tokens * batch
    return total


def logits_bytes(shape: ModelShape, tokens: int, batch: int) -> int:
    """16-bit logits plus the fp32 log-softmax taken of them (computed in chunks or not, one
    fp32 copy is alive at the peak)."""
    return batch * tokens * shape.vocab * (2 + 4)


def tiled_logits_bytes(shape: ModelShape, tile_tokens: int) -> int:
    """Tiled logits (ppo.tiled_logits, ds_ppo.algo.tiled): one tile's 16-bit logits, their fp32
    copy and, in backward, the fp32 gradient buffer; whatever the response length."""
    return tile_tokens * shape.vocab * (2 + 4 + 4)


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int) -> int:
    """16-bit K and V of every layer for `batch` sequences of `tokens` tokens."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch * 2
