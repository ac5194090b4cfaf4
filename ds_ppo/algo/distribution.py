"""The distribution a response is sampled from: the model's logits shaped by the sampling
settings (`LogitShape`: EOS blocked before min_new_tokens, suppressed tokens, temperature,
top-k, top-p) with `shape_logits`. The decoding loop samples from it (`sampling.py`) and the
trainer computes its log-probs, entropy and KL from the same function (`logits.py`, `tiled.py`),
so PPO trains the distribution that was sampled (docs/SAMPLING.md).

Every function is a fixed sequence of tensor ops with no host synchronisation and no shape that
depends on tensor values, so a decoding step built from them can be captured in a CUDA graph.
They reproduce HF `generate`'s processors in HF's order (min-new-tokens, suppressed tokens, then
temperature, top-k, top-p) so that the same logits give the same greedy token and the same
sampling distribution.

Shapes: (..., V) float logits (V = vocabulary): (B, V) in a decoding step, (b, t, V) in the
trainer's blocks. Imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


def block_tokens(logits: torch.Tensor, token_ids: torch.Tensor,
                 blocked: torch.Tensor | bool = True) -> torch.Tensor:
    """Set the logits of `token_ids` (K,) long to -inf where `blocked` (a bool, or a bool tensor
    broadcastable to (B, 1), e.g. "fewer than min_new_tokens generated") holds. In place."""
    if isinstance(blocked, bool):  # no tensor made from a Python value: capture-safe
        if blocked:
            logits.index_fill_(-1, token_ids, float("-inf"))
        return logits
    current = logits.index_select(-1, token_ids)
    logits.index_copy_(-1, token_ids, current.masked_fill(blocked, float("-inf")))
    return logits


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering; removed tokens get -inf.

    Matches HF's TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper with
    min_tokens_to_keep=1: top-p keeps the smallest set of most likely tokens whose probability
    reaches top_p (at least one). temperature > 0; top_k = 0 is off; top_p = 1 is off.
    """
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1:] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass(frozen=True)
class LogitShape:
    """Everything that makes the distribution a response is sampled from differ from the
    model's plain softmax, in the order HF's processors apply it: EOS blocked before
    `min_new_tokens` tokens of a turn, `suppress_ids` never sampled (the pad token, which would
    read as padding downstream), then the temperature (0 = greedy: no division, no filter),
    top-k and top-p. The sampler and the trainer both shape their logits with `shape_logits`
    from one LogitShape, so PPO's log-probs, entropy and KL are those of the distribution that
    was sampled."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    suppress_ids: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    # device -> (suppress ids (K,) long, EOS ids (E,) long): made once, outside a CUDA graph
    _ids: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the distribution (never when greedy)."""
        return self.temperature != 0 and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def blocks_eos(self) -> bool:
        return self.min_new_tokens > 0 and bool(self.eos_ids)

    @property
    def is_plain(self) -> bool:
        """The model's own softmax: nothing blocked, no temperature, no filter."""
        return (self.temperature in (0.0, 1.0) and not self.truncates and not self.suppress_ids
                and not self.blocks_eos)

    def untruncated(self) -> "LogitShape":
        """The same shape without top-k / top-p (the reference's log-probs use it:
        `ds_ppo.engine.forward.logit_shape` says why)."""
        return replace(self, top_k=0, top_p=1.0, _ids={})

    def ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(suppress ids, EOS ids) as long tensors on `device`, made on the first call (call it
        once before capturing a step that shapes logits: no tensor is made inside)."""
        key = str(device)
        if key not in self._ids:
            self._ids[key] = tuple(torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)
                                   for ids in (self.suppress_ids, self.eos_ids))
        return self._ids[key]


def shape_logits(logits: torch.Tensor, shape: LogitShape, new_index: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) float logits -> (..., V) the logits of the distribution `shape` samples from
    (-inf on the tokens it cannot pick). Not in place.

    new_index: (...) long, each position's count of tokens already generated in its turn (EOS is
    blocked where it is < shape.min_new_tokens); None: no EOS blocking. keep: (...) long token
    ids never blocked (the trainer passes the sampled tokens: a near tie that the trainer's
    top-k / top-p resolves otherwise than the sampler's then costs a renormalisation, never a
    -inf log-prob; and masked positions, whose labels are e.g. the pad, stay finite).

    The ops are those of the sampler (`block_tokens`, `filter_logits`) over the last dimension,
    so the same float32 logits give the same bits whatever the leading shape: (B, V) in a
    decoding step, (b, t, V) in the trainer's blocks.
    """
    suppress_t, eos_t = shape.ids(logits.device)
    out = logits.clone() if suppress_t.numel() or (shape.blocks_eos and new_index is not None) \
        else logits
    if shape.blocks_eos and new_index is not None:
        block_tokens(out, eos_t, (new_index < shape.min_new_tokens)[..., None])
    if suppress_t.numel():
        block_tokens(out, suppress_t)
    if shape.temperature != 0:
        out = filter_logits(out, shape.temperature, shape.top_k, shape.top_p)
    if keep is not None and (out is not logits):
        kept = logits.gather(-1, keep[..., None])
        if shape.temperature not in (0.0, 1.0):
            kept = kept / shape.temperature
        out = out.scatter(-1, keep[..., None], kept)
    return out
