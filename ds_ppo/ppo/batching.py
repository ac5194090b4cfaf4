"""How a rank cuts its rows into model forwards (scoring and the update alike): micro-batches
of ppo.micro_batch_size / ppo.score_micro_batch_size rows, or packed by a token budget
(ppo.micro_batch_tokens); rows long enough for sequence parallelism each alone; and, where ranks
may run different numbers of forwards, idle repeats so that every rank runs as many (ZeRO-3
forwards are collective)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_ppo.config import Config
from ds_ppo.containers import Rollout
from ds_ppo.engine import dist


@dataclass(frozen=True)
class Batching:
    """Everything the planner reads from the config."""

    micro_batch_size: int  # ppo.micro_batch_size: rows per update forward
    score_micro_batch_size: int  # ppo.score_micro_batch_size, else micro_batch_size
    micro_batch_tokens: int | None  # ppo.micro_batch_tokens: packed by this token budget
    split_min_tokens: int  # deepspeed.sequence_parallel_min_tokens: rows split across SP


def batching(cfg: Config) -> Batching:
    p = cfg.ppo
    return Batching(p.micro_batch_size, p.score_micro_batch_size or p.micro_batch_size,
                    p.micro_batch_tokens, cfg.deepspeed.sequence_parallel_min_tokens)


def split_rows(rollout: Rollout, b: Batching, rows: list[int] | None = None
               ) -> tuple[list[int], list[int]]:
    """`rows` (default: all) as (rows every rank runs whole, rows split across the
    sequence-parallel group: at least deepspeed.sequence_parallel_min_tokens real tokens;
    none without sequence parallelism)."""
    rows = list(range(len(rollout))) if rows is None else rows
    if dist.sp_size() == 1:
        return rows, []
    least, lens = b.split_min_tokens, rollout.row_lens
    return [i for i in rows if lens[i] < least], [i for i in rows if lens[i] >= least]


def is_split(rollout: Rollout, b: Batching, rows: list[int]) -> bool:
    """Whether the micro-batch `rows` is one row split across the sequence-parallel group
    (`plan_micro_batches` puts each such row alone; an idle repeat of one is split too)."""
    return len(rows) == 1 and bool(split_rows(rollout, b, rows)[1])


def plan_micro_batches(rollout: Rollout, b: Batching, size: int,
                       rows: list[int] | None = None) -> list[list[int]]:
    """This rank's model forwards over `rows` (default: all): the micro-batches of the rows run
    whole (packed by ppo.micro_batch_tokens, else `size` rows, longest first), then each split
    row alone (`split_rows`)."""
    whole, split = split_rows(rollout, b, rows)
    budget = b.micro_batch_tokens
    batches = [] if not whole else (rollout.token_micro_batches(budget, whole) if budget
                                    else rollout.micro_batches(size, whole))
    return batches + [[i] for i in split]


def varying_counts(b: Batching) -> bool:
    """Whether ranks may run different numbers of forwards per batch (packed micro-batches, or
    split rows whose number differs between sequence-parallel groups)."""
    return b.micro_batch_tokens is not None or dist.sp_size() > 1


def model_micro_batches(rollout: Rollout, b: Batching
                        ) -> tuple[list[list[int]], list[int], int]:
    """The micro-batches of the policy, reference and value forwards (`plan_micro_batches`),
    their rows one after another (for `in_row_order`) and how many of them hold this rank's
    rows. Packed or with split rows, their number differs between ranks; ZeRO-3 forwards are
    collective, so every rank runs as many as the rank with the most (one all-reduce): the
    extra, idle ones repeat this rank's shortest row, their outputs dropped."""
    batches = plan_micro_batches(rollout, b, b.score_micro_batch_size)
    order = [i for rows in batches for i in rows]
    if not varying_counts(b):
        return batches, order, len(batches)
    most = int(dist.all_reduce_max(torch.tensor([float(len(batches))], dtype=torch.float64)))
    return rollout.with_idle(batches, most), order, len(batches)
