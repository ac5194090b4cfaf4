"""ppo.dynamic_sampling's refill (ds_ppo/ppo/dynamic.py) with a fake generation and reward, on
one process and on two gloo ranks: the batch is the first rollout_batch_size prompts with a
spread of scores in stream order, laid out so that every mini-batch holds the same groups at
any world size (rows that change rank travel between the ranks); the stream position after the
rounds; the fill when the rounds run out."""
from __future__ import annotations

import json
import types
from dataclasses import replace

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from ds_ppo.config import load_config
from ds_ppo.containers import Rollout, concat_rollouts
from ds_ppo.data.sampler import PromptSampler
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.dynamic import (PromptDraw, choose_groups, position, refill, refill_settings,
                               slot)
from ds_ppo.ppo.scoring import RewardScores
from support.rollouts import padded_rollout

N_PROMPTS, BATCH, N, MINI = 64, 8, 2, 8  # a mini-batch holds MINI / N = 4 prompts
PAD = 0


def _flat(i: int) -> bool:
    """Prompts whose responses all score alike (no signal)."""
    return i % 3 == 0


def _rollout(indices: list[int]) -> Rollout:
    """Each prompt's N rows; prompts and responses of lengths that vary with the prompt."""
    prompts, responses = [], []
    for i in indices:
        for k in range(N):
            prompts.append([3 + i] * (1 + i % 3))
            responses.append([4 + i, 5 + k][: 1 + (i + k) % 2])
    rollout = padded_rollout(prompts, responses, max(map(len, prompts)),
                             max(map(len, responses)), PAD)
    return replace(rollout, prompts=[f"p{i}" for i in indices for _ in range(N)],
                   responses=[f"r{i}.{k}" for i in indices for k in range(N)])


def _scores(rollout) -> RewardScores:
    s = [1.0 if _flat(int(p[1:])) else float(k)
         for p, k in zip(rollout.prompts, [k for _ in range(len(rollout) // N)
                                           for k in range(N)])]
    return RewardScores(torch.tensor(s), None, 0.0, None)


def _refill(rank: int, world: int, max_rounds: int = 4, start: int = 0) -> dict:
    cfg = load_config(None, ["ppo.samples_per_prompt=2", f"ppo.rollout_batch_size={BATCH}",
                             f"ppo.mini_batch_size={MINI}", "ppo.micro_batch_size=2",
                             "ppo.dynamic_sampling=true",
                             f"ppo.dynamic_sampling_max_rounds={max_rounds}"])
    sampler = PromptSampler(N_PROMPTS, BATCH, rank, world, seed=5, group_size=MINI // N)
    draw = PromptDraw(sampler, start)
    acc = Accumulator()
    gen = types.SimpleNamespace(decode_stats=[])
    rollout, _, rewards = refill(refill_settings(cfg), draw, lambda idx: (_rollout(idx), gen),
                                 _scores, PAD, acc)
    # each row must still be its prompt's: ids, lengths and strings travel together
    for b in range(len(rollout)):
        i = int(rollout.prompts[b][1:])
        P = rollout.prompt_lens[b]
        assert rollout.prompt_ids[b, rollout.prompt_ids.shape[1] - P:].tolist() == [3 + i] * P
        assert rollout.response_ids[b, 0] == 4 + i and rollout.mask[b].sum() == \
            rollout.response_lens[b]
    return {"prompts": rollout.prompts, "scores": rewards.scores.tolist(), "end": draw.end,
            "metrics": {k: v for k, v in acc.reduce().items() if k.startswith("sampling/")},
            "stream": [sampler.global_indices(r) for r in range(draw.end // BATCH + 1)]}


def test_layout_positions_and_slots_are_inverse():
    share, chunk, world = 2, 4, 2
    seen = sorted(position(r, i, share, chunk) for r in range(world) for i in range(4))
    assert seen == list(range(8))
    for r in range(world):
        for i in range(4):
            assert slot(position(r, i, share, chunk), share, chunk) == (r, i)


def test_choose_groups_signal_first_in_draw_order_then_the_earliest_without():
    signal = [[True, False, False, True], [False, True, True, True]]
    assert choose_groups(signal, 4) == [(0, 0), (0, 3), (1, 1), (1, 2)]
    assert choose_groups([[False, True, False, False]], 3) == [(0, 1), (0, 0), (0, 2)]


def test_indices_at_continues_the_iterations_layout():
    for rank in range(2):
        s = PromptSampler(50, 8, rank, 2, seed=1, group_size=4)
        assert [s.indices_at(it * 8) for it in range(9)] == [s.indices(it) for it in range(9)]


def test_concat_rollouts_pads_each_part_to_the_widest():
    a, b = _rollout([1]), _rollout([2, 5])  # prompts 2 and 3 tokens wide
    both = concat_rollouts([a, b], PAD)
    assert both.prompts == a.prompts + b.prompts and len(both) == 6
    assert both.prompt_ids.shape[1] == 3 and both.prompt_ids[0].tolist() == [PAD, 4, 4]
    assert both.prompt_mask[0].tolist() == [False, True, True]
    assert both.mask.sum(1).tolist() == both.response_lens


def test_concat_rollouts_keeps_the_sampled_distribution():
    """The rounds of one iteration were sampled alike: their `sampling` (the distribution the
    trainer's log-probs use) passes through; parts sampled otherwise are refused."""
    from ds_ppo.algo.distribution import LogitShape

    shape = LogitShape(temperature=0.7, top_k=5)
    a, b = replace(_rollout([1]), sampling=shape), replace(_rollout([2, 5]), sampling=shape)
    assert concat_rollouts([a, b], PAD).sampling == shape
    with pytest.raises(ValueError, match="sampling differ"):
        concat_rollouts([a, replace(b, sampling=LogitShape(temperature=1.0))], PAD)


def test_one_rank_takes_the_first_prompts_with_signal():
    res = _refill(0, 1)
    stream = [i for batch in res["stream"] for i in batch]
    want = [i for i in stream[:res["end"]] if not _flat(i)][:BATCH]
    assert res["prompts"][::N] == [f"p{i}" for i in want]
    assert res["end"] == res["metrics"]["sampling/rounds"] * BATCH
    assert res["metrics"]["sampling/filled_frac"] == 0
    # the signal-free prompts are those the refill skipped
    assert all(s in (0.0, 1.0) for s in res["scores"]) and len(res["scores"]) == BATCH * N


def test_rounds_running_out_fill_with_the_earliest_without_signal():
    res = _refill(0, 1, max_rounds=1)
    stream = res["stream"][0]
    kept = [i for i in stream if not _flat(i)]
    want = kept + [i for i in stream if _flat(i)][:BATCH - len(kept)]
    assert res["prompts"][::N] == [f"p{i}" for i in want]  # one rank: the batch's order
    assert res["metrics"]["sampling/filled_frac"] == pytest.approx(1 - len(kept) / BATCH)
    assert res["end"] == BATCH


def _worker(rank: int, init_file: str, out: str) -> None:
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        res = _refill(rank, 2, start=BATCH * 3)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        tdist.destroy_process_group()


def test_two_ranks_train_the_batch_of_one_rank(tmp_path):
    """The batch of two gloo ranks, read mini-batch by mini-batch (each rank holds its half of
    every mini-batch), is the one-rank batch: the same groups in the same mini-batches, from a
    saved stream position."""
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    one = _refill(0, 1, start=BATCH * 3)
    share = MINI // N // 2  # prompts of a mini-batch on each rank
    rows = share * N
    merged_prompts, merged_scores = [], []
    for c in range(BATCH // (MINI // N)):
        for r in ranks:
            merged_prompts += r["prompts"][c * rows:(c + 1) * rows]
            merged_scores += r["scores"][c * rows:(c + 1) * rows]
    assert merged_prompts == one["prompts"] and merged_scores == one["scores"]
    assert ranks[0]["end"] == ranks[1]["end"] == one["end"]
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == one["metrics"]
    # some groups were generated on one rank and trained on the other
    drawn_on = {}
    for r in range(2):
        s = PromptSampler(N_PROMPTS, BATCH, r, 2, seed=5, group_size=MINI // N)
        for k in range(one["end"] // BATCH - 3):
            for i in s.indices_at(BATCH * (3 + k)):
                drawn_on[f"p{i}"] = r
    assert any(drawn_on[p] != r for r in range(2) for p in ranks[r]["prompts"])
