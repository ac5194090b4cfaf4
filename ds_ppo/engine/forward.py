"""Forward passes over (prompt + response) sequences, shared by scoring and the update.

Sequences are [left-padded prompt (P) | right-padded response (T)]. Position ids count real
tokens only, so a left-padded prompt sees the same positions as an unpadded one (the same rule
HF `generate` uses). Token t of the response is predicted by the logits at position P - 1 + t.

Packed (ppo.micro_batch_tokens): the rows' real tokens concatenated into one sequence (batch 1,
ds_ppo.algo.packing), position ids restarting at 0 for each row, attention confined to the row:
with flash-attention the varlen kernels get the rows' bounds (`cu_seq_lens_*`, `max_length_*`;
no mask); with sdpa/eager a block-diagonal causal 4D mask is passed, which transformers uses as
given. The outputs are unpacked into the (B, T) response layout.

Tiled (ppo.tiled_logits): the model runs without its output head (`logits_to_keep` = no
position) and the final hidden states of the response predictors go through the head a tile of
ppo.logits_tile_tokens positions at a time (ds_ppo.algo.tiled_logprobs): no (B, T, V) logits,
in forward or backward. A micro-batch without padding (one row, or rows of equal lengths)
passes no attention mask: sdpa then runs its causal kernel (on CPU the flash kernel, O(L)
memory, instead of the L x L scores of the masked math kernel).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Literal

import torch

from ds_ppo.algo import (LogitShape, additive_mask, block_causal_mask, cumulative_lengths,
                         entropy_from_logits, logprobs_from_logits, packed_layout,
                         response_predictors, tiled_logprobs, unpack)
from ds_ppo.algo.tiled import tile_count
from ds_ppo.containers import Rollout
from ds_ppo.engine import dist

# ppo.tiled_logits = auto tiles a forward whose response logits would hold more elements than
# this (positions x vocabulary; 256 MiB in fp32: 2k positions of a 32k vocabulary, 512 of a
# 128k one). Scoring costs nothing more tiled; the update recomputes each tile's head matmul
# in backward (docs/RESULTS.md, "One long row", measures both on CPU).
AUTO_TILE_ELEMENTS = 2**26


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions of real tokens (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def tile_logits(setting: Literal["auto"] | bool, positions: int, vocab: int) -> bool:
    """Whether a forward scoring `positions` response tokens over a vocabulary of `vocab`
    computes its log-probs tile by tile (ppo.tiled_logits; auto: when its logits would hold
    more than AUTO_TILE_ELEMENTS). The engine and the planner both decide here."""
    if setting == "auto":
        return positions * vocab > AUTO_TILE_ELEMENTS
    return bool(setting)


def _unpadded_mask(rollout: Rollout, am: torch.Tensor) -> torch.Tensor | None:
    """`am`, or None when it has no padding (host lengths: every row has the longest prompt and
    response), so attention takes its causal kernel instead of a materialised mask."""
    if len(set(rollout.prompt_lens)) == 1 and len(set(rollout.response_lens)) == 1:
        return None
    return am


def _response_logits(model, ids: torch.Tensor, am: torch.Tensor, mask: torch.Tensor | None,
                     num_response: int) -> torch.Tensor:
    """(B, T, V) logits predicting the last T tokens of `ids`. Only the last T + 1 positions'
    logits are computed (`logits_to_keep`), so the prompt logits are never materialised."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(am),
                logits_to_keep=num_response + 1, use_cache=False)
    return out.logits[:, :-1]


def logit_shape(rollout: Rollout, temperature: float, truncate: bool = True) -> LogitShape:
    """The distribution whose log-probs a forward over `rollout` computes: the one its responses
    were sampled from (`Rollout.sampling`: temperature, blocked tokens, top-k, top-p; the plain
    softmax at `temperature` for rows sampled elsewhere), without top-k / top-p unless
    `truncate`.

    The policy's log-probs, entropy and the policy side of the KL use the whole shape, so they
    are of the distribution that was sampled. The reference's log-probs (truncate=False) use
    the model-independent part only: the temperature and the blocked tokens (the pad, EOS before
    min_new_tokens), which no sampled token can be, but not top-k / top-p, whose cut set depends
    on the model: a token the policy's top-k keeps may lie outside the reference's, which would
    make its log-prob -inf. The KL term is then KL(pi_sampled || pi_ref) with pi_ref the
    reference's full (tempered, blocked) softmax, finite for every sampled token."""
    shape = rollout.sampling or LogitShape(temperature=temperature)
    if shape.temperature != temperature:
        shape = replace(shape, temperature=temperature, _ids={})
    return shape if truncate else shape.untruncated()


def _full_width(x: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T') -> (B, T): zeros after the kept response columns (they are masked everywhere)."""
    return torch.nn.functional.pad(x, (0, T - x.shape[1]))


def _attn_implementation(model) -> str | None:
    """The attention implementation of an HF model, also inside a DeepSpeed engine (`.module`;
    the engine's own `.config` is DeepSpeed's), a PEFT model (its `.config` is the base's) or a
    role wrapper such as lora.AdaptersOff (`.engine`); None if none of them says."""
    for _ in range(4):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
        inner = getattr(model, "engine", None)
        model = getattr(model, "module", None) if inner is None else inner
        if model is None:
            break
    return None


def _packed_forward(model, rollout: Rollout, keep: Literal["predictors", "all", "none"]):
    """The model's output on the rollout's rows packed into one sequence (1, N), and (n,) the
    packed positions predicting the counted response tokens (row-major order of rollout.mask).
    keep: where the model computes its logits: at those positions only, (1, n, V)
    (`logits_to_keep` as indices), at all N, or nowhere (the caller reads the hidden states)."""
    keep_mask = torch.cat([rollout.prompt_mask, rollout.context], dim=1)  # observations too
    layout = packed_layout(keep_mask)
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], dim=1)[keep_mask][None]
    pred = response_predictors(layout.place, rollout.prompt_ids.shape[1], rollout.mask)
    kwargs = {"predictors": {"logits_to_keep": pred}, "all": {},
              "none": {"logits_to_keep": pred[:0]}}[keep]
    out = packed_call(model, ids, layout, rollout.row_lens, **kwargs)
    return out, pred


def packed_call(model, ids: torch.Tensor, layout, lengths: list[int], **kwargs):
    """The model's forward on one packed sequence `ids` (1, N) of rows with host `lengths`
    (`layout`: their `algo.packed_layout`), attention confined to each row for the model's
    attention kernel (module docstring); `kwargs` go to the model (e.g. logits_to_keep)."""
    impl = _attn_implementation(model)
    if impl is not None and impl.startswith("flash"):
        # no mask: the varlen kernels take the rows' bounds, from host lengths (given them,
        # transformers does not infer them from the position ids in every layer)
        mask = None
        cu = cumulative_lengths(lengths, ids.device)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                      max_length_k=max(lengths))
    elif len(lengths) == 1:  # one row: plain causal attention
        mask = None
    elif impl in ("sdpa", "eager"):
        mask = block_causal_mask(layout.row_of)
        if impl == "eager":  # eager adds the mask to its scores; sdpa takes bool (True = attend)
            mask = additive_mask(mask, torch.float32)
    else:  # another or an unknown one: transformers finds the rows from the position ids
        mask = None
    return model(input_ids=ids, attention_mask=mask, position_ids=layout.position_ids[None],
                 use_cache=False, **kwargs)


def causal_lm(model):
    """The Hugging Face causal LM inside a DeepSpeed engine (`.module`), a role wrapper such as
    lora.AdaptersOff (`.engine`) or a test's FakeEngine; a PEFT model forwards to its base."""
    for _ in range(4):
        inner = getattr(model, "engine", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if inner is None:
            break
        model = inner
    return model


def output_head(lm):
    """(head, grad_ready): head maps (n, H) final hidden states to (n, V) logits as the model's
    own forward computes them (its output layer, Gemma-2's final logit soft-capping);
    grad_ready is tiled_logprobs' before_backward_tile for ZeRO."""
    out = lm.get_output_embeddings()
    cap = getattr(lm.config.get_text_config(), "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = out(hidden)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    params = [p for p in out.parameters() if p.requires_grad]

    def grad_ready(last: bool) -> None:
        # ZeRO reduces a parameter's gradient when autograd accumulates it: only after the
        # last tile's backward (DeepSpeed's flag for tiled compute, as its TiledMLP sets it)
        for p in params:
            p.ds_grad_is_ready = last

    return head, grad_ready


def head_calls(lm, positions: int, tile_tokens: int) -> int:
    """How many times `tiled_logprobs` calls the output head for `positions` positions: its
    tile count, or under ZeRO-3 on several ranks the largest of any rank (ZeRO-3 gathers the
    head's weight for each call, a collective; packed micro-batches and ranks' own response
    lengths give ranks different counts). One all-reduce then, matched on every rank: each
    makes the same tiled forwards."""
    tiles = tile_count(positions, tile_tokens)
    partitioned = any(hasattr(p, "ds_id") for p in lm.get_output_embeddings().parameters())
    if not partitioned or dist.world_size() == 1:
        return tiles
    return int(dist.all_reduce_max(torch.tensor([float(tiles)], dtype=torch.float64)))


@contextmanager
def _decoder_output(lm):
    """A list that receives the (B, L, H) final hidden states (after the last norm) of each
    forward of `lm`'s decoder inside the block (a forward hook)."""
    seen: list[torch.Tensor] = []
    hook = lm.get_decoder().register_forward_hook(
        lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else
                                        out.last_hidden_state))
    try:
        yield seen
    finally:
        hook.remove()


def final_hidden(runner, lm, **inputs) -> torch.Tensor:
    """(B, L, H) final hidden states of a forward of `runner` (the engine's own forward:
    ZeRO-3's root hooks) in which the model computes no logits (`logits_to_keep` = no
    position); `lm` is the HF model inside it (`causal_lm`)."""
    empty = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
    with _decoder_output(lm) as seen:
        runner(**inputs, use_cache=False, logits_to_keep=empty)
    return seen[-1]


def _tiled_response_logprobs(model, rollout: Rollout, shape: LogitShape, with_entropy: bool,
                             packed: bool, tile_tokens: int, entropy_grad: bool = False):
    """`response_logprobs`, the output head applied tile by tile to the final hidden states
    (module docstring). A LoRA reference (lora.AdaptersOff) keeps its adapters off for the
    head's calls too."""
    off = getattr(model, "adapters_off", None)
    runner = model.engine if off is not None else model
    lm = causal_lm(model)
    with off() if off is not None else nullcontext():
        hidden, labels, index = _response_hidden(runner, lm, rollout, shape, packed)
        head, grad_ready = output_head(lm)
        calls = head_calls(lm, labels.numel(), tile_tokens)
        logprobs, entropy = tiled_logprobs(hidden, labels, head, tile_tokens, with_entropy,
                                           grad_ready, shape=shape, new_index=index,
                                           entropy_grad=entropy_grad, calls=calls)
    if packed:
        return unpack(logprobs[0], rollout.mask), (
            unpack(entropy[0], rollout.mask) if with_entropy else None)
    T = rollout.response_ids.shape[1]
    return _full_width(logprobs, T), (_full_width(entropy, T) if with_entropy else None)


def _response_hidden(runner, lm, rollout: Rollout, shape: LogitShape, packed: bool):
    """(final hidden states before each response token, the tokens, `_new_index`): packed
    (1, n, H), (1, n) over the counted tokens; else (B, T', H), (B, T') over the kept columns."""
    if packed:
        with _decoder_output(lm) as seen:
            _, pred = _packed_forward(runner, rollout, keep="none")
        return (seen[-1][:, pred], rollout.response_ids[rollout.mask][None],
                _new_index(rollout, shape, packed=True))
    ids, am, keep = rollout.model_inputs()
    L = ids.shape[1]
    hidden = final_hidden(runner, lm, input_ids=ids, position_ids=position_ids(am),
                          attention_mask=_unpadded_mask(rollout, am))[:, L - keep - 1:L - 1]
    return hidden, ids[:, L - keep:], _new_index(rollout, shape, keep=keep)


def _tiled_teacher(model, rollout: Rollout, shape: LogitShape, packed: bool, tile_tokens: int):
    """`teacher_logprobs` with the output head applied to about `tile_tokens` positions at a
    time (no gradient: a plain loop over column slices), top-1 matches included."""
    lm = causal_lm(model)
    hidden, labels, index = _response_hidden(model, lm, rollout, shape, packed)
    head, _ = output_head(lm)
    B, W = labels.shape
    logprobs = torch.zeros(B, W, dtype=torch.float32, device=labels.device)
    top1 = torch.zeros_like(logprobs)
    step = max(1, tile_tokens // max(B, 1))
    for a in range(0, W, step):
        cols = slice(a, min(a + step, W))
        logits = head(hidden[:, cols])  # (B, cols, V)
        logprobs[:, cols] = logprobs_from_logits(
            logits, labels[:, cols], shape=shape,
            new_index=index[:, cols] if index is not None else None)
        top1[:, cols] = (logits.argmax(-1) == labels[:, cols]).float()
        del logits
    if packed:
        return unpack(logprobs[0], rollout.mask), unpack(top1[0], rollout.mask)
    T = rollout.response_ids.shape[1]
    return _full_width(logprobs, T), _full_width(top1, T)


def _vocab(model) -> int:
    return int(causal_lm(model).get_output_embeddings().out_features)


def _new_index(rollout: Rollout, shape: LogitShape, packed: bool = False,
               keep: int | None = None) -> torch.Tensor | None:
    """The response tokens' `Rollout.new_token_index` in the layout of a forward's labels:
    packed (1, n) over the counted tokens, else (B, keep); None when the shape blocks no EOS."""
    if not shape.blocks_eos:
        return None
    index = rollout.new_token_index()
    return index[rollout.mask][None] if packed else index[:, :keep]


def _for_entropy(logits: torch.Tensor, grad: bool) -> torch.Tensor:
    """The logits the entropy is computed from: detached unless it carries a gradient."""
    return logits if grad else logits.detach()


def replay_routes(rollout: Rollout, packed: bool) -> torch.Tensor:
    """(N, layers, k) long: the rollout's recorded expert choices for the N tokens of its
    forward, in the order the routers see them (`model_inputs`' columns, or packed: the kept
    tokens of `_packed_forward`); -1 where none was recorded."""
    from ds_ppo.engine.moe import forward_routes

    if packed:
        return forward_routes(rollout.prompt_routes, rollout.response_routes,
                              keep=torch.cat([rollout.prompt_mask, rollout.context], dim=1))
    lead = rollout.prompt_ids.shape[1] - max(rollout.prompt_lens, default=0)
    return forward_routes(rollout.prompt_routes, rollout.response_routes, lead=lead,
                          width=max(rollout.response_lens, default=0))


def response_logprobs(model, rollout: Rollout, temperature: float, with_entropy: bool = False,
                      packed: bool = False, tiled: Literal["auto"] | bool = False,
                      tile_tokens: int = 1024, truncate: bool = True,
                      entropy_grad: bool = False, routers=None, replay: bool | None = None):
    """(B, T) float32 log-probs of the response tokens (and (B, T) entropy if asked) under the
    distribution they were sampled from (`logit_shape`; truncate=False: without top-k / top-p,
    the reference's). The forward runs on `rollout.model_inputs()` (unused padding dropped);
    the columns after the longest counted response are 0, and like every masked position they
    mean nothing.
    packed: the rows packed into one sequence (module docstring); only the counted response
    tokens' logits are computed, and every position outside rollout.mask is 0.
    tiled (ppo.tiled_logits; `tile_logits` decides auto): the output head runs `tile_tokens`
    positions at a time on the final hidden states; the same numbers, no (B, T, V) logits.
    entropy_grad: the entropy is differentiable (ppo.entropy_coef's bonus), else a metric.
    routers: a mixture-of-experts model's `moe.RouterTap`; with `replay` True every token is
    routed to the experts the rollout recorded (ppo.router_replay), False: routed by the
    routers and compared with the recorded choice (`RouterTap.take_flips`), None: routed by the
    routers (the reference)."""
    if routers is not None:  # set for every forward: the routes stay until the next one's
        known = replay is not None and rollout.response_routes is not None
        routers.routes = replay_routes(rollout, packed) if known else None
        routers.replay = bool(replay) and known
    shape = logit_shape(rollout, temperature, truncate)
    positions = sum(rollout.response_lens) if packed else \
        len(rollout) * max(rollout.response_lens, default=0)
    if tiled is not False and tile_logits(tiled, positions, _vocab(model)):
        return _tiled_response_logprobs(model, rollout, shape, with_entropy, packed,
                                        tile_tokens, entropy_grad)
    if packed:
        out, _ = _packed_forward(model, rollout, keep="predictors")
        logits = out.logits  # (1, n, V)
        labels = rollout.response_ids[rollout.mask][None]  # (1, n)
        index = _new_index(rollout, shape, packed=True)
        logprobs = unpack(logprobs_from_logits(logits, labels, shape=shape,
                                               new_index=index)[0], rollout.mask)
        entropy = unpack(entropy_from_logits(_for_entropy(logits, entropy_grad), shape=shape,
                                             new_index=index, labels=labels)[0],
                         rollout.mask) if with_entropy else None
        return logprobs, entropy
    ids, am, keep = rollout.model_inputs()
    T = rollout.response_ids.shape[1]
    logits = _response_logits(model, ids, am, _unpadded_mask(rollout, am), keep)
    labels = ids[:, ids.shape[1] - keep:]
    index = _new_index(rollout, shape, keep=keep)
    logprobs = logprobs_from_logits(logits, labels, shape=shape, new_index=index)
    entropy = _full_width(entropy_from_logits(_for_entropy(logits, entropy_grad), shape=shape,
                                              new_index=index, labels=labels), T) \
        if with_entropy else None
    return _full_width(logprobs, T), entropy


def teacher_logprobs(model, rollout: Rollout, temperature: float, packed: bool = False,
                     tiled: Literal["auto"] | bool = False, tile_tokens: int = 1024):
    """A distillation teacher's (B, T) float32 log-probs of the sampled response tokens (its
    tempered softmax with the blocked tokens, without top-k / top-p: `logit_shape`'s
    truncate=False, as the reference's, finite for every sampled token) and (B, T) float32, 1
    where the sample is the teacher's top-1 token (argmax of its logits). Tiled (ppo.tiled_logits)
    the head runs on slices of about `tile_tokens` positions. Masked positions as in
    `response_logprobs`."""
    shape = logit_shape(rollout, temperature, truncate=False)
    positions = sum(rollout.response_lens) if packed else \
        len(rollout) * max(rollout.response_lens, default=0)
    if tiled is not False and tile_logits(tiled, positions, _vocab(model)):
        return _tiled_teacher(model, rollout, shape, packed, tile_tokens)
    if packed:
        out, _ = _packed_forward(model, rollout, keep="predictors")
        labels = rollout.response_ids[rollout.mask][None]  # (1, n)
        index = _new_index(rollout, shape, packed=True)
        logprobs = logprobs_from_logits(out.logits, labels, shape=shape, new_index=index)[0]
        top1 = (out.logits.argmax(-1) == labels)[0].float()
        return unpack(logprobs, rollout.mask), unpack(top1, rollout.mask)
    ids, am, keep = rollout.model_inputs()
    T = rollout.response_ids.shape[1]
    logits = _response_logits(model, ids, am, _unpadded_mask(rollout, am), keep)
    labels = ids[:, ids.shape[1] - keep:]
    index = _new_index(rollout, shape, keep=keep)
    logprobs = logprobs_from_logits(logits, labels, shape=shape, new_index=index)
    return _full_width(logprobs, T), _full_width((logits.argmax(-1) == labels).float(), T)


def response_values(value_model, rollout: Rollout, packed: bool = False) -> torch.Tensor:
    """(B, T) float32 value of the state before each response token (the per-token head's output
    at position P - 1 + t); masked positions as in `response_logprobs` (also `packed`). Values
    are never tiled: the head's output is (B, L, 1)."""
    if packed:
        out, pred = _packed_forward(value_model, rollout, keep="all")
        return unpack(out.logits[0, pred, 0].float(), rollout.mask)
    ids, am, keep = rollout.model_inputs()
    out = value_model(input_ids=ids, attention_mask=_unpadded_mask(rollout, am),
                      position_ids=position_ids(am), use_cache=False)
    values = out.logits.squeeze(-1)[:, ids.shape[1] - keep - 1:ids.shape[1] - 1]  # (B, T')
    return _full_width(values.float(), rollout.response_ids.shape[1])


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last real token (works for left and right padding)."""
    L = attention_mask.shape[1]
    return L - 1 - attention_mask.long().flip(-1).argmax(-1)


class LastTokenScorer(torch.nn.Module):
    """The reward role's root module: an HF sequence-classification model whose score head is
    read at each row's last real token.

    The backbone and score head are called directly (rather than the pooled HF forward, which
    finds the last token by comparing ids to pad_token_id and so misreads rows ending in EOS when
    pad == eos). They are called inside this module's forward, so the DeepSpeed engine wraps it
    and the reward model runs through `engine.forward`: ZeRO-3 resets its parameter-fetch trace
    in the root module's forward hooks; called through the engine's attribute forwarding instead,
    its coordinator never completed a trace (no prefetch; measured in tests/e2e/test_reward_model.py).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) ids and mask (any padding side) -> (B,) float32 scores. A LoRA reward model
        (`ds-ppo rm` with policy.lora) runs through its peft wrapper's base model, whose layers
        hold the adapters."""
        from ds_ppo.engine.lora import plain_model

        model = plain_model(self.model)
        backbone = getattr(model, model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids(attention_mask),
                          use_cache=False).last_hidden_state
        last = last_token_index(attention_mask)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return model.score(picked).squeeze(-1).float()


def sequence_scores(reward_engine, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) float32 reward-model score read at each row's last real token, by the reward engine's
    own forward (its module is a `LastTokenScorer`)."""
    return reward_engine(input_ids=input_ids, attention_mask=attention_mask)
