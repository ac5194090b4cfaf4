"""Sequence-parallel bookkeeping without processes: the SP / data-parallel group layout, each
rank's data-parallel coordinates, and which rows a rank splits across its SP group (the
training loop with real ranks: tests/dist/test_engine.py, sp_train)."""
from __future__ import annotations

import pytest
import torch

from ds_ppo.config import load_config
from ds_ppo.data.ptx import lm_rollout
from ds_ppo.engine import dist
from ds_ppo.ppo.batching import (batching, is_split, plan_micro_batches, split_rows,
                                 varying_counts)


def test_layout_groups_consecutive_ranks_and_strides_the_data_parallel_groups():
    sp, dp = dist.sp_layout(8, 4)
    assert sp == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one node's ranks share a row
    assert dp == [[0, 4], [1, 5], [2, 6], [3, 7]]  # one rank per SP group: each row once
    assert dist.sp_layout(3, 1) == ([[0], [1], [2]], [[0, 1, 2]])  # SP 1: the world is DP
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        dist.sp_layout(6, 4)


def test_coordinates_of_a_rank():
    # (data-parallel rank, data-parallel world, place in the SP group)
    assert [dist.sp_coords(r, 8, 4) for r in (0, 3, 4, 7)] == [
        (0, 2, 0), (0, 2, 3), (1, 2, 0), (1, 2, 3)]
    assert dist.sp_coords(5, 6, 1) == (5, 6, 0)


@pytest.fixture
def sp2(monkeypatch):
    """This process as a rank of an SP group of 2 (no process group needed for the row logic)."""
    monkeypatch.setitem(dist._SP, "size", 2)


def _rollout(row_lens: list[int]):
    """Rows of 4 prompt tokens and row_len - 4 response tokens."""
    return lm_rollout([[5] * 4 for _ in row_lens], [[7] * (n - 4) for n in row_lens], 0,
                      torch.device("cpu"))


def _cfg(*extra: str):
    return batching(load_config(None, ["deepspeed.sequence_parallel_size=2",
                                       "ppo.micro_batch_size=2",
                                       "deepspeed.sequence_parallel_min_tokens=10", *extra]))


def test_rows_of_at_least_min_tokens_are_split_and_run_alone_after_the_whole_ones(sp2):
    r, cfg = _rollout([12, 6, 10, 8, 9, 30]), _cfg()
    assert split_rows(r, cfg) == ([1, 3, 4], [0, 2, 5])
    assert split_rows(r, cfg, [3, 5]) == ([3], [5])
    batches = plan_micro_batches(r, cfg, 2)
    assert batches == [[4, 3], [1], [0], [2], [5]]  # whole rows longest first, 2 per batch
    assert [is_split(r, cfg, b) for b in batches] == [False, False, True, True, True]
    packed = plan_micro_batches(r, _cfg("ppo.micro_batch_tokens=17"), 2)
    assert packed[-3:] == [[0], [2], [5]] and sorted(sum(packed[:-3], [])) == [1, 3, 4]
    assert varying_counts(cfg)  # the number of split rows differs between SP groups


def test_without_sequence_parallelism_nothing_is_split():
    r, cfg = _rollout([12, 6, 30]), _cfg()
    assert dist.sp_size() == 1
    assert split_rows(r, cfg) == ([0, 1, 2], [])
    assert plan_micro_batches(r, cfg, 2) == r.micro_batches(2)
    assert not is_split(r, cfg, [2]) and not varying_counts(cfg)


def test_data_parallel_rank_and_world_follow_the_sp_size(monkeypatch, sp2):
    monkeypatch.setattr(dist, "rank", lambda: 3)
    monkeypatch.setattr(dist, "world_size", lambda: 4)
    assert (dist.dp_rank(), dist.dp_world_size(), dist.is_sp_leader()) == (1, 2, False)
    monkeypatch.setattr(dist, "rank", lambda: 2)
    assert (dist.dp_rank(), dist.is_sp_leader()) == (1, True)


def test_only_an_sp_groups_first_rank_brings_its_rows_to_tensor_parallel_decoding(monkeypatch,
                                                                                   sp2):
    from ds_ppo.ppo.rollout import decodes_own_rows

    gen = load_config(None, []).generation
    tp4, tp3 = (gen.model_copy(update={"tp_size": n}) for n in (4, 3))
    monkeypatch.setattr(dist, "rank", lambda: 1)  # the second rank of SP group [0, 1]
    assert not decodes_own_rows(tp4, "tensor_parallel")  # TP [0..3] holds SP [0, 1], [2, 3]
    assert decodes_own_rows(tp3, "tensor_parallel")  # TP groups cut SP groups: every rank
    assert decodes_own_rows(tp4, "gathered") and decodes_own_rows(tp4, "zero3")
    monkeypatch.setattr(dist, "rank", lambda: 2)
    assert decodes_own_rows(tp4, "tensor_parallel")  # a group's first rank
    monkeypatch.setitem(dist._SP, "size", 1)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    assert decodes_own_rows(tp4, "tensor_parallel")  # no SP: every rank
