"""Partial rollouts (ppo.partial_rollouts, docs/ASYNC.md): a rollout decoded in segments across
weight updates. Between segments its sequences are a `Partial`: the tokens so far, the sampler's
log-prob and the policy version of each, and which rows still decode. The next segment continues
the live rows on the replica with whatever weights it holds then: their KV cache is rebuilt by a
prefill of prompt and tokens so far (with the new weights), and the decoding loop samples on from
the random stream it is handed. With the same weights, two segments give the tokens and
log-probs of one decoding call (bit for bit with batch-invariant kernels, tested on CPU). No
collective: the background worker runs it (ppo/rollout_worker.py); which segments run beside which iteration is fixed by
the schedule (`ds_ppo.algo.choices.partial_plan`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_ppo.algo.choices import segment_end
from ds_ppo.algo.masks import response_mask
from ds_ppo.containers import Rollout
from ds_ppo.data.prompts import PromptSet, left_pad
from ds_ppo.engine.generation import Generated, decode_on_replica, sampling_shape
from ds_ppo.engine.generation.loop import DecodeStats
from ds_ppo.ppo.rollout import assemble_rollout


@dataclass
class Partial:
    """A rollout between two of its segments, this rank's rows (B = prompts x
    ppo.samples_per_prompt, T = generation.max_new_tokens)."""

    iteration: int  # the iteration (1-based) that trains on it
    indices: list[int]  # each row's prompt index (a prompt's samples next to each other)
    response_ids: torch.Tensor  # (B, T) long: tokens so far, pad after EOS and beyond
    logprobs: torch.Tensor  # (B, T) float32: each token's sampler log-prob, 0 where none
    versions: torch.Tensor  # (B, T) int32: the policy version that sampled each token, -1: none
    live: torch.Tensor  # (B,) bool: rows still decoding (no stop token yet, fewer than T tokens)
    tokens: int = 0  # tokens decoded so far by every live row (`segment_end` of `segments`)
    segments: int = 0  # segments decoded so far
    first_version: int = -1  # the version of its first segment (-1: none decoded yet)
    seconds: float = 0.0  # worker time spent decoding it
    stats: list[DecodeStats] = field(default_factory=list)  # the decoding calls' statistics

    @property
    def finished(self) -> bool:
        return not bool(self.live.any())


def start_partial(iteration: int, indices: list[int], samples_per_prompt: int, T: int,
                  pad_id: int, device) -> Partial:
    """A rollout of the prompts `indices` with nothing decoded yet."""
    rows = [i for i in indices for _ in range(samples_per_prompt)]
    B = len(rows)
    return Partial(iteration, rows, torch.full((B, T), pad_id, dtype=torch.long, device=device),
                   torch.zeros(B, T, dtype=torch.float32, device=device),
                   torch.full((B, T), -1, dtype=torch.int32, device=device),
                   torch.ones(B, dtype=torch.bool, device=device))


def continue_partial(part: Partial, segments: int, segments_of: int, replica, prompts: PromptSet,
                     gen_cfg, eos_ids: list[int], pad_id: int, version: int,
                     generator: torch.Generator, on_done=None) -> Partial:
    """Decode `part`'s live rows on `replica` (weights of `version`) from `generator` until
    `segments` of its `segments_of` are done (`segment_end` tokens; several segments at once
    with the same weights are one decoding call). Each live row's prompt for the call is its
    prompt followed by its tokens so far (left-padded), so the prefill rebuilds its KV cache
    with these weights; EOS stays blocked until generation.min_new_tokens tokens in all.
    `on_done(rows, tokens)`: the rows of `part` whose responses are final, as the decoding loop
    finds them ended (a stop token; in the last segment every row), each with all its tokens so
    far: what streams a partial rollout's reward calls (reward.stream). In place; returns
    `part`."""
    T = part.response_ids.shape[1]
    end = min(T, segment_end(T, segments_of, segments))
    span = end - part.tokens
    rows = part.live.nonzero().flatten().tolist()
    if span > 0 and rows:
        before = [part.response_ids[r, :part.tokens].tolist() for r in rows]
        prompt_ids = [prompts.input_ids[part.indices[r]] + b for r, b in zip(rows, before)]
        ids, am = left_pad(prompt_ids, pad_id)
        device = part.response_ids.device
        cfg = gen_cfg.model_copy(update={
            "max_new_tokens": span,
            "min_new_tokens": max(0, gen_cfg.min_new_tokens - part.tokens)})
        gen = decode_on_replica(replica, ids.to(device), am.to(device).bool(), cfg, eos_ids,
                                pad_id, generator,
                                _final_rows(on_done, rows, before, end >= T, set(eos_ids)))
        at = torch.tensor(rows, device=device)
        width = gen.response_ids.shape[1]
        cols = slice(part.tokens, part.tokens + width)
        part.response_ids[at, cols] = gen.response_ids
        part.logprobs[at, cols] = gen.logprobs.masked_fill(~gen.mask, 0.0)
        part.versions[at, cols] = torch.full_like(gen.response_ids, version, dtype=torch.int32
                                                  ).masked_fill_(~gen.mask, -1)
        # a row not ended decoded every token of the span: all live rows stay aligned
        part.live[at] = ~gen.ended & (end < T)
        part.stats.extend(gen.decode_stats)
        if part.first_version < 0:
            part.first_version = version
    part.tokens, part.segments = end, segments
    if end >= T:
        part.live.zero_()
    return part


def _final_rows(on_done, rows: list[int], before: list[list[int]], last: bool, eos: set[int]):
    """The decoding call's `on_done` (rows of the call, the segment's tokens) as `on_done` of
    the partial's rows that are final (a stop token among their tokens: EOS is blocked until
    min_new_tokens, so one never comes early; in the `last` segment every row), each with its
    tokens `before` the segment and the segment's. None: no `on_done`."""
    if on_done is None:
        return None

    def done(local: list[int], tokens: list[list[int]]) -> None:
        final = [(rows[i], before[i] + t) for i, t in zip(local, tokens)
                 if last or not eos.isdisjoint(t)]
        if final:
            on_done(*(list(x) for x in zip(*final)))
    return done


def partial_rollout(part: Partial, prompts: PromptSet, gen_cfg, tokenizer, eos_ids: list[int]
                    ) -> tuple[Rollout, Generated]:
    """The finished `part` as the `Rollout` (with `token_versions`) and `Generated` that a
    rollout decoded in one go gives: as wide as its longest response, pad after each EOS."""
    pad_id = tokenizer.pad_token_id
    mask = response_mask(part.response_ids, eos_ids)
    width = max(int(mask.sum(dim=-1).max()), 1)
    mask = mask[:, :width]
    response = part.response_ids[:, :width].masked_fill(~mask, pad_id)
    eos = torch.tensor(eos_ids, device=response.device)
    gen = Generated(response_ids=response, mask=mask,
                    ended=(mask & torch.isin(response, eos)).any(dim=1), loop="own",
                    decode_stats=[_joined(part.stats, len(part.indices))],
                    logprobs=part.logprobs[:, :width].masked_fill(~mask, 0.0),
                    sampling=sampling_shape(gen_cfg, eos_ids, pad_id))
    prompt_ids = [prompts.input_ids[i] for i in part.indices]
    ids, am = left_pad(prompt_ids, pad_id)
    device = response.device
    rollout = assemble_rollout(prompts, part.indices, prompt_ids, ids.to(device),
                               am.to(device).bool(), gen, tokenizer)
    rollout.token_versions = part.versions[:, :width].masked_fill(~mask, -1)
    return rollout, gen


def _joined(stats: list[DecodeStats], rows: int) -> DecodeStats:
    """The decoding calls of a rollout's segments as one call over its `rows` (each row counted
    once, its token positions in every segment: generation/slot_utilisation)."""
    return DecodeStats(steps=sum(st.steps for st in stats),
                       graph=bool(stats) and all(st.graph for st in stats),
                       graph_error=next((st.graph_error for st in stats if st.graph_error), None),
                       slots=max((st.slots for st in stats), default=0), rows=rows,
                       slot_steps=sum(st.slot_steps for st in stats),
                       refills=sum(st.refills for st in stats))
