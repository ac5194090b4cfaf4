"""PPO-ptx data (InstructGPT, Ouyang et al. 2022, eq. 2): rows of pretraining or SFT text whose
language-modelling loss joins the policy loss in every PPO mini-batch (ppo.ptx_coef,
data.ptx_path).

A row is either `text` (the loss on every token after the first) or `prompt` + `completion`
(the loss on the completion tokens and the EOS after them, as SFT trains; `prompt` is
data.prompt_key). Each is held as a prompt / response pair, so the policy's own forward
(`PolicyRole.logprobs`, log-probs of the response tokens) computes the LM loss's terms.

Which rows a mini-batch gets: `PromptSampler` over the ptx rows, one global group of
ppo.mini_batch_size rows per PPO mini-batch (all epochs of an iteration one after another), each
rank its slice of every group: every optimizer step sees the same ptx rows at any world size,
and a resumed run continues the stream from the iteration number alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_ppo.containers import Rollout
from ds_ppo.data.sampler import PromptSampler
from ds_ppo.data.validate import read_ptx
from ds_ppo.errors import DataError


@dataclass(frozen=True)
class PtxRows:
    """The tokenised ptx rows (every rank holds all of them)."""

    prompt_ids: list[list[int]]  # N rows' context tokens (>= 1 each: no loss on them)
    target_ids: list[list[int]]  # N rows' tokens that carry the LM loss (>= 1 each)

    def __len__(self) -> int:
        return len(self.prompt_ids)


def load_ptx(path: str, fmt: str, prompt_key: str, max_len: int, tokenizer) -> PtxRows:
    """Read and tokenise data.ptx_path: rows of `text`, or of prompt_key + `completion`. A row is
    at most max_len tokens (a text keeps its start; a prompt keeps its end, the completion its
    start). Raises DataError naming the file, row and column of a bad row."""
    table, text_mode, columns = read_ptx(path, fmt, prompt_key)  # every row checked
    eos = tokenizer.eos_token_id
    prompts, targets = [], []
    if text_mode:
        for ids in tokenizer(columns[0])["input_ids"]:
            ids = list(ids)[:max_len]
            prompts.append(ids[:1])
            targets.append(ids[1:])
    else:
        enc_p = tokenizer(columns[0])["input_ids"]
        enc_c = tokenizer(columns[1], add_special_tokens=False)["input_ids"]
        for p, c in zip(enc_p, enc_c):
            c = (list(c) + [eos])[:max_len - 1]
            prompts.append(list(p)[-(max_len - len(c)):])
            targets.append(c)
    empty = [table.where[i] for i, t in enumerate(targets) if not t]
    if empty:
        raise DataError(f"data.ptx_path {table.source}: {empty[0]}"
                        f"{f' and {len(empty) - 1} more rows' if len(empty) > 1 else ''}: a "
                        "text of one token has nothing to predict")
    return PtxRows(prompts, targets)


class PtxStream:
    """This rank's ptx rows for each PPO mini-batch of an iteration (module docstring)."""

    def __init__(self, rows: PtxRows, mini_batch_size: int, steps_per_iteration: int,
                 rank: int, world_size: int, seed: int, pad_id: int) -> None:
        self.rows, self.pad_id = rows, pad_id
        self.per_rank = mini_batch_size // world_size
        self.sampler = PromptSampler(len(rows), mini_batch_size * steps_per_iteration, rank,
                                     world_size, seed, shuffle=True, group_size=mini_batch_size)

    def minibatch(self, iteration: int, step: int) -> list[int]:
        """Row indices for optimizer step `step` (0-based, epochs one after another) of
        iteration `iteration` (1-based), this rank's share."""
        mine = self.sampler.indices(iteration - 1)
        return mine[step * self.per_rank:(step + 1) * self.per_rank]

    def tokens(self, indices: list[int]) -> int:
        """Target (loss-carrying) tokens of these rows."""
        return sum(len(self.rows.target_ids[i]) for i in indices)

    def batch(self, indices: list[int], device: torch.device) -> Rollout:
        """The rows as a Rollout (prompt left-padded, target right-padded as the response)."""
        return lm_rollout([self.rows.prompt_ids[i] for i in indices],
                          [self.rows.target_ids[i] for i in indices], self.pad_id, device)


def lm_rollout(prompts: list[list[int]], targets: list[list[int]], pad_id: int,
               device: torch.device) -> Rollout:
    """B (context, target) id lists as a Rollout: prompt (B, P) left-padded, targets as the
    response (B, T) right-padded with `mask` True on every target token."""
    B, P, T = len(prompts), max(map(len, prompts)), max(map(len, targets))
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, t) in enumerate(zip(prompts, targets)):
        prompt_ids[b, P - len(p):] = torch.tensor(p)
        prompt_mask[b, P - len(p):] = True
        response_ids[b, :len(t)] = torch.tensor(t)
        mask[b, :len(t)] = True
    return Rollout(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                   response_ids=response_ids.to(device), mask=mask.to(device),
                   ended=torch.ones(B, dtype=torch.bool, device=device), prompts=[""] * B,
                   responses=[""] * B, prompt_lens=[len(p) for p in prompts],
                   response_lens=[len(t) for t in targets], extras=[{}] * B)
