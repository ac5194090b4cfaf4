"""Sequence parallelism for long rows: DeepSpeed Ulysses attention (ALST, Bekman et al. 2025) for
Hugging Face models.

A row of L tokens is cut into N contiguous shards, one per rank of its sequence-parallel (SP)
group of N consecutive ranks. Every layer but attention works on its own shard; attention
exchanges shards for heads with an all-to-all (DeepSpeed's `UlyssesSPAttentionHF`: each rank
then holds the whole sequence for heads / N heads, and a second all-to-all gives the shards
back). Activations per rank are those of L / N tokens; the attention heads must divide by N
(the KV heads divide by N, or N by them).

The attention function is swapped in transformers' `ALL_ATTENTION_FUNCTIONS` under the model's
own kernel name (as DeepSpeed's `register_with_transformers` does), but behind a switch: only
forwards run inside `sharded()` take the Ulysses path, everything else in the process (padded
micro-batches, the generation replica, other roles) calls the kernel as before. DeepSpeed's own
registration would route every forward of the process through the all-to-alls.

Log-probs: each rank computes its shard's (tiled, ds_ppo.algo.tiled_logprobs) and the group
all-gathers them into the row's. Every rank of the group then computes the same loss from the
gathered row, so the gather's backward keeps each rank's own piece of the gradient (a
reduce-scatter would sum N equal copies): the group's parameter gradients sum to the row's.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager, nullcontext

import torch

from ds_ppo.algo import tiled_logprobs
from ds_ppo.containers import Rollout
from ds_ppo.engine.forward import (causal_lm, final_hidden, head_calls, logit_shape,
                                   output_head)
from ds_ppo.errors import ConfigError

_SHARDED = contextvars.ContextVar("ds_ppo_sequence_parallel", default=False)
_REGISTERED: dict[str, dict] = {}  # kernel name -> {"group", "core", "ulysses": {shape: attn}}


def new_group(size: int):
    """This rank's SP group: consecutive ranks [k*size, (k+1)*size) (DeepSpeed's
    parallel_state_sp layout, so ranks of one group share a node), and the data-parallel groups
    across them (`dist.set_sequence_parallel`). Collective."""
    from ds_ppo.engine import dist

    return dist.set_sequence_parallel(size)


def register(hf_config, group) -> None:
    """Route the attention of forwards inside `sharded()` through Ulysses on `group`, for
    models whose kernel is hf_config's (sdpa or a flash-attention kernel; eager needs the
    L x L mask Ulysses drops)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_ppo.config.model_checks import heads_problem

    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    problem = heads_problem(heads, getattr(text, "num_key_value_heads", None) or heads,
                            dist_size(group), "the model")
    if problem:
        raise ConfigError(problem)
    impl = hf_config._attn_implementation
    if impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError(f"deepspeed.sequence_parallel_size > 1 needs attn_implementation sdpa "
                          f"or flash_attention_2, not {impl!r}")
    if impl in _REGISTERED:
        return
    state = {"group": group, "core": ALL_ATTENTION_FUNCTIONS[impl], "ulysses": {}}
    _REGISTERED[impl] = state

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not _SHARDED.get():
            return state["core"](module, query, key, value, attention_mask, *args, **kwargs)
        # Ulysses drops the mask (the local shard's mask means nothing after the exchange):
        # causal over the whole row, positions from the gathered position ids
        return _ulysses(state, module)(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = attention


def _ulysses(state: dict, module):
    """DeepSpeed's UlyssesSPAttentionHF for this attention layer's head shape (one per shape:
    the policy and a value model of another shape can both be sharded)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    cfg = module.config.get_text_config()
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    key = (heads, kv, head_dim, cfg.num_hidden_layers)
    if key not in state["ulysses"]:
        state["ulysses"][key] = UlyssesSPAttentionHF(
            attn=state["core"], batch_size=1, attn_head_count=heads, attn_head_size=head_dim,
            kv_head_count=kv, num_hidden_layers=cfg.num_hidden_layers,
            process_group=state["group"], seq_length_is_variable=True)
    return state["ulysses"][key]


def dist_size(group) -> int:
    import deepspeed.comm as dist

    return dist.get_world_size(group)


@contextmanager
def sharded():
    """Forwards inside this block run their attention through Ulysses (`register`)."""
    token = _SHARDED.set(True)
    try:
        yield
    finally:
        _SHARDED.reset(token)


class _GatherRow(torch.autograd.Function):
    """(s,) piece per rank -> (N*s,) the group's pieces in rank order; backward keeps this
    rank's piece of the gradient (every rank computes the same loss from the gathered row)."""

    @staticmethod
    def forward(ctx, piece, group):
        import deepspeed.comm as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(parts, piece.contiguous(), group=group)
        ctx.bounds = (rank * piece.shape[0], (rank + 1) * piece.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.bounds
        return grad[a:b], None


def _shard(rollout: Rollout, group):
    """One row's real tokens (1, N*s + 1: padded at the end with its last token; causal, so
    nothing sees the pad) and this rank's slice of s positions, with (P, R, L): prompt,
    response and real tokens."""
    import deepspeed.comm as dist

    if len(rollout) != 1:
        raise ValueError(f"a split forward takes one row, got {len(rollout)}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    P, R = rollout.prompt_lens[0], rollout.response_lens[0]
    ids = torch.cat([rollout.prompt_ids[0, rollout.prompt_ids.shape[1] - P:],
                     rollout.response_ids[0, :R]])[None]  # (1, L) real tokens only
    L = ids.shape[1]
    s = -(-L // size)  # shard length
    ids = torch.nn.functional.pad(ids, (0, s * size + 1 - L), value=int(ids[0, -1]))
    return ids, slice(rank * s, (rank + 1) * s), (P, R, L)


def _positions(mine: slice, device) -> torch.Tensor:
    return torch.arange(mine.start, mine.stop, device=device)[None]


def row_logprobs(model, rollout: Rollout, temperature: float, group, tile_tokens: int,
                 with_entropy: bool = False, truncate: bool = True,
                 entropy_grad: bool = False):
    """(1, T) float32 log-probs (and entropy) of one row's response tokens, the row split
    across the SP group (module docstring); every rank of the group passes the same row and
    gets the same result. Positions after the counted response are 0, as in
    forward.response_logprobs. A LoRA reference (lora.AdaptersOff) keeps its adapters off for
    the head's calls too. `entropy_grad`: the entropy is differentiable (tiled_logprobs).
    Collective in forward and backward."""
    ids, mine, (P, R, L) = _shard(rollout, group)
    off = getattr(model, "adapters_off", None)
    runner = model.engine if off is not None else model
    lm = causal_lm(model)
    with off() if off is not None else nullcontext():
        with sharded():
            hidden = final_hidden(runner, lm, input_ids=ids[:, mine], attention_mask=None,
                                  position_ids=_positions(mine, ids.device))
        head, grad_ready = output_head(lm)
        # every local position predicts the next token (labels shifted by one; the pads' are
        # junk)
        labels = ids[:, mine.start + 1:mine.stop + 1]
        shape = logit_shape(rollout, temperature, truncate)
        index = None
        if shape.blocks_eos:  # the response tokens' index in their turn, far off elsewhere
            index = torch.full((ids.shape[1],), 2**31, dtype=torch.long, device=ids.device)
            index[P - 1:L - 1] = rollout.new_token_index()[0, :R]
            index = index[mine][None]
        lp, ent = tiled_logprobs(hidden, labels, head, tile_tokens, with_entropy, grad_ready,
                                 shape=shape, new_index=index, entropy_grad=entropy_grad,
                                 calls=head_calls(lm, labels.numel(), tile_tokens))
    T = rollout.response_ids.shape[1]
    return _response(lp, group, P, R, L, T), (_response(ent, group, P, R, L, T)
                                              if with_entropy else None)


def row_values(model, rollout: Rollout, group) -> torch.Tensor:
    """(1, T) float32 values of one row's response tokens (the per-token head's output at the
    position before each, as forward.response_values), the row split across the SP group.
    Collective in forward and backward."""
    ids, mine, (P, R, L) = _shard(rollout, group)
    with sharded():
        out = model(input_ids=ids[:, mine], attention_mask=None,
                    position_ids=_positions(mine, ids.device), use_cache=False)
    return _response(out.logits[..., 0].float(), group, P, R, L, rollout.response_ids.shape[1])


def _response(piece: torch.Tensor, group, P: int, R: int, L: int, T: int) -> torch.Tensor:
    """This rank's (1, s) outputs at its positions -> the row's (1, T) at the positions
    predicting response tokens P .. L - 1 (0 after the counted response)."""
    row = _GatherRow.apply(piece[0], group)
    return torch.nn.functional.pad(row[P - 1:L - 1], (0, T - R))[None]
