"""Forward passes over (prompt + response) sequences, shared by scoring and the update.

Sequences are [left-padded prompt (P) | right-padded response (T)]. Position ids count real
tokens only, so a left-padded prompt sees the same positions as an unpadded one (the same rule
HF `generate` uses). Token t of the response is predicted by the logits at position P - 1 + t.

Packed (ppo.micro_batch_tokens): the rows' real tokens concatenated into one sequence (batch 1,
ds_ppo.algo.packing), position ids restarting at 0 for each row, attention confined to the row:
with flash-attention the varlen kernels get the rows' bounds (`cu_seq_lens_*`, `max_length_*`;
no mask); with sdpa/eager a block-diagonal causal 4D mask is passed, which transformers uses as
given. The outputs are unpacked into the (B, T) response layout.
"""
from __future__ import annotations

import torch

from ds_ppo.algo import (additive_mask, block_causal_mask, cumulative_lengths,
                         entropy_from_logits, logprobs_from_logits, packed_layout,
                         response_predictors, unpack)
from ds_ppo.containers import Rollout


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions of real tokens (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _response_logits(model, ids: torch.Tensor, am: torch.Tensor, num_response: int,
                     temperature: float) -> torch.Tensor:
    """(B, T, V) logits predicting the last T tokens of `ids`, divided by the sampling
    temperature. Only the last T + 1 positions' logits are computed (`logits_to_keep`), so the
    prompt logits are never materialised."""
    out = model(input_ids=ids, attention_mask=am, position_ids=position_ids(am),
                logits_to_keep=num_response + 1, use_cache=False)
    return _tempered(out.logits[:, :-1], temperature)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits divided by the sampling temperature (as sampling divides them; 0 = greedy)."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


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


def _packed_forward(model, rollout: Rollout, predictors_only: bool):
    """The model's output on the rollout's rows packed into one sequence (1, N), and (n,) the
    packed positions predicting the counted response tokens (row-major order of rollout.mask).
    predictors_only: the model computes its logits at those positions only, (1, n, V)
    (`logits_to_keep` as indices), else at all N."""
    keep = torch.cat([rollout.prompt_mask, rollout.context], dim=1)  # observations too
    layout = packed_layout(keep)
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], dim=1)[keep][None]
    pred = response_predictors(layout.place, rollout.prompt_ids.shape[1], rollout.mask)
    kwargs = {"logits_to_keep": pred} if predictors_only else {}
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
    elif impl in ("sdpa", "eager"):
        mask = block_causal_mask(layout.row_of)
        if impl == "eager":  # eager adds the mask to its scores; sdpa takes bool (True = attend)
            mask = additive_mask(mask, torch.float32)
    else:  # another or an unknown one: transformers finds the rows from the position ids
        mask = None
    return model(input_ids=ids, attention_mask=mask, position_ids=layout.position_ids[None],
                 use_cache=False, **kwargs)


def response_logprobs(model, rollout: Rollout, temperature: float, with_entropy: bool = False,
                      packed: bool = False):
    """(B, T) float32 log-probs of the response tokens (and (B, T) entropy if asked). The
    forward runs on `rollout.model_inputs()` (unused padding dropped); the columns after the
    longest counted response are 0, and like every masked position they mean nothing.
    packed: the rows packed into one sequence (module docstring); only the counted response
    tokens' logits are computed, and every position outside rollout.mask is 0."""
    if packed:
        out, _ = _packed_forward(model, rollout, predictors_only=True)
        logits = _tempered(out.logits, temperature)  # (1, n, V)
        labels = rollout.response_ids[rollout.mask][None]  # (1, n)
        logprobs = unpack(logprobs_from_logits(logits, labels)[0], rollout.mask)
        entropy = unpack(entropy_from_logits(logits.detach())[0],
                         rollout.mask) if with_entropy else None
        return logprobs, entropy
    ids, am, keep = rollout.model_inputs()
    T = rollout.response_ids.shape[1]
    logits = _response_logits(model, ids, am, keep, temperature)
    logprobs = logprobs_from_logits(logits, ids[:, ids.shape[1] - keep:])
    entropy = _full_width(entropy_from_logits(logits.detach()), T) if with_entropy else None
    return _full_width(logprobs, T), entropy


def response_values(value_model, rollout: Rollout, packed: bool = False) -> torch.Tensor:
    """(B, T) float32 value of the state before each response token (the per-token head's output
    at position P - 1 + t); masked positions as in `response_logprobs` (also `packed`)."""
    if packed:
        out, pred = _packed_forward(value_model, rollout, predictors_only=False)
        return unpack(out.logits[0, pred, 0].float(), rollout.mask)
    ids, am, keep = rollout.model_inputs()
    out = value_model(input_ids=ids, attention_mask=am, position_ids=position_ids(am),
                      use_cache=False)
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
        """(B, L) ids and mask (any padding side) -> (B,) float32 scores."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids(attention_mask),
                          use_cache=False).last_hidden_state
        last = last_token_index(attention_mask)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.model.score(picked).squeeze(-1).float()


def sequence_scores(reward_engine, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) float32 reward-model score read at each row's last real token, by the reward engine's
    own forward (its module is a `LastTokenScorer`)."""
    return reward_engine(input_ids=input_ids, attention_mask=attention_mask)
