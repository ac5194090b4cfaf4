"""Rollout: this rank's prompts -> responses from the current policy (a `Rollout`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds_ppo.config import Config, GenerationConfig
from ds_ppo.containers import Rollout
from ds_ppo.data.prompts import PromptSet, left_pad
from ds_ppo.rewards.encode import decode_responses
from ds_ppo.engine import dist
from ds_ppo.engine.generation import Generated, decode_on_replica, generate


@dataclass(frozen=True)
class RolloutSettings:
    """What generating a rollout reads from the config."""

    samples_per_prompt: int  # ppo.samples_per_prompt: responses to each prompt
    generation: GenerationConfig  # the generation section (sampling, decoding loop, limits)


def rollout_settings(cfg: Config) -> RolloutSettings:
    """`make_rollout`'s settings from the config (the evaluation's: from `greedy_config`)."""
    return RolloutSettings(cfg.ppo.samples_per_prompt, cfg.generation)


def stop_token_ids(tokenizer, stop_tokens: Sequence[str]) -> list[int]:
    """EOS plus every stop token of generation.stop_tokens (each must be one vocabulary
    entry)."""
    from ds_ppo.errors import ConfigError

    ids = [tokenizer.eos_token_id]
    vocab = tokenizer.get_vocab()
    for tok in stop_tokens:
        if tok not in vocab:
            raise ConfigError(f"generation.stop_tokens: {tok!r} is not a single token of the "
                              "policy tokenizer's vocabulary")
        ids.append(vocab[tok])
    return sorted(set(ids))


def generation_metrics(rollout: Rollout, gen: Generated, acc) -> None:
    """generation/slot_utilisation (loop=own): counted response tokens per token position the
    decoding slots were given (`DecodeStats.slot_steps`; 1 = no slot idled), over all ranks; a
    tensor-parallel rank counts its share of its group's decoding."""
    if not gen.decode_stats:
        return
    decoded = sum(st.rows for st in gen.decode_stats)
    slot_steps = sum(st.slot_steps for st in gen.decode_stats) * len(rollout) / max(decoded, 1)
    acc.add_mean("generation/slot_utilisation", sum(rollout.response_lens), slot_steps)


def stamp_versions(rollout: Rollout, version: int) -> Rollout:
    """`rollout` with `token_versions` recorded: every counted token sampled by the weights of
    policy `version` (a rollout is decoded with one version's weights from start to end)."""
    mask = rollout.mask
    rollout.token_versions = torch.full(mask.shape, version, dtype=torch.int32,
                                        device=mask.device).masked_fill_(~mask, -1)
    return rollout


def decodes_own_rows(gen_cfg, mode: str) -> bool:
    """Whether this rank brings its rows to generation. With sequence parallelism in
    tensor_parallel mode, when each tensor-parallel group is made of whole SP groups (both are
    consecutive ranks), only an SP group's first rank does: the TP group's decoding batch then
    holds each row once, not N times (the group's other ranks get the rows from the rollout's
    broadcast). Every rank otherwise (the other modes decode each rank's rows on that rank)."""
    size = dist.sp_size()
    if size == 1 or mode != "tensor_parallel":
        return True
    tp = gen_cfg.tp_size or dist.local_world_size()
    return tp % size != 0 or dist.is_sp_leader()


def make_rollout(prompts: PromptSet, indices: list[int], engines, s: RolloutSettings,
                 tokenizer, mode: str, eos_ids: list[int], stream=None
                 ) -> tuple[Rollout, Generated]:
    """Generate responses for the prompts at `indices` (this rank's shard of the batch):
    ppo.samples_per_prompt of each, next to each other (rows g*n .. g*n + n - 1 answer prompt
    indices[g]), sampled in one batch from this rank's stream, so independently. With
    sequence parallelism, the SP group's ranks hold the same `indices` and the same stream; the
    group's first rank's rollout is returned on all of them (broadcast: a kernel's
    non-determinism can never give them different rows, and a split row must be one row).
    `stream`: a `RewardStream` the responses go to as they finish (ppo/reward_stream.py)."""
    n = s.samples_per_prompt
    indices = [i for i in indices for _ in range(n)]
    prompt_ids = [prompts.input_ids[i] for i in indices]
    ids, am = left_pad(prompt_ids, tokenizer.pad_token_id)
    ids, am = ids.to(engines.device), am.to(engines.device).bool()
    # no rows: this rank joins its tensor-parallel group's decoding of the others' rows
    rows = len(indices) if decodes_own_rows(s.generation, mode) else 0
    gen = generate(engines.policy, ids[:rows], am[:rows], s.generation, mode, eos_ids,
                   tokenizer.pad_token_id, engines.dtype, kept_replica=engines.replica,
                   on_done=watch_responses(stream, prompts, indices, prompt_ids, tokenizer,
                                           eos_ids))
    engines.replica = gen.replica
    rollout = (assemble_rollout(prompts, indices, prompt_ids, ids, am, gen, tokenizer)
               if rows else None)
    return dist.broadcast_in_sp_group(rollout, engines.device), gen


def replica_rollout(prompts: PromptSet, indices: list[int], replica, s: RolloutSettings,
                    tokenizer, eos_ids: list[int], device, generator, stream=None
                    ) -> tuple[Rollout, Generated]:
    """`make_rollout` on a replica built already (`decode_on_replica`), sampling from the random
    stream `generator`: no collective, for the background worker of ppo.schedule."""
    n = s.samples_per_prompt
    indices = [i for i in indices for _ in range(n)]
    prompt_ids = [prompts.input_ids[i] for i in indices]
    ids, am = left_pad(prompt_ids, tokenizer.pad_token_id)
    ids, am = ids.to(device), am.to(device).bool()
    on_done = watch_responses(stream, prompts, indices, prompt_ids, tokenizer, eos_ids)
    gen = decode_on_replica(replica, ids, am, s.generation, eos_ids, tokenizer.pad_token_id,
                            generator, on_done)
    return assemble_rollout(prompts, indices, prompt_ids, ids, am, gen, tokenizer), gen


def watch_responses(stream, prompts: PromptSet, indices: list[int],
                    prompt_ids: list[list[int]], tokenizer, eos_ids: list[int]):
    """The decoding loop's `on_done` that hands finished responses to `stream` (None: none),
    rows of the prompts `indices` (token ids `prompt_ids`); also a partial rollout's."""
    if stream is None:
        return None
    return stream.watch(tokenizer, prompt_ids, [prompts.extra(i) for i in indices], eos_ids,
                        [prompts.chat(i) for i in indices] if prompts.messages is not None
                        else None)


def assemble_rollout(prompts: PromptSet, indices: list[int], prompt_ids: list[list[int]],
                     ids, am, gen: Generated, tokenizer) -> Rollout:
    """The Rollout of the generated rows (`make_rollout`; a partial rollout's, ppo/partial.py)."""
    # decoded together with their prompts, so a response keeps the space of its first word
    # the counted tokens of each row, on the host (two device reads for the whole batch)
    counted = [[t for t, m in zip(row, keep) if m]
               for row, keep in zip(gen.response_ids.tolist(), gen.mask.tolist())]
    texts, responses = decode_responses(tokenizer, prompt_ids, counted)
    rollout = Rollout(prompt_ids=ids, prompt_mask=am, response_ids=gen.response_ids,
                      mask=gen.mask, ended=gen.ended, prompts=texts, responses=responses,
                      prompt_lens=[len(p) for p in prompt_ids],
                      response_lens=[len(r) for r in counted],
                      extras=[prompts.extra(i) for i in indices],
                      messages=([prompts.chat(i) for i in indices]
                                if prompts.messages is not None else None),
                      rollout_logprobs=gen.logprobs, sampling=gen.sampling,
                      prompt_routes=gen.prompt_routes, response_routes=gen.response_routes)
    return rollout

