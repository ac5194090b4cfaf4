"""A reward function's outcome on two gloo ranks (CPU): a function that fails or hangs on one
rank, or a call given up on SIGTERM, stops every rank alike, so no rank is left waiting in a
collective. Imports no
transformers, so the two spawned ranks start quickly."""
from __future__ import annotations

import re
import signal
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_ppo import abandon
from ds_ppo.config import load_config
from ds_ppo.containers import Rollout
from ds_ppo.errors import RewardFunctionError, RewardTimeout, UserError
from ds_ppo.ppo.scoring import reward_scores, reward_settings


def _rollout() -> Rollout:
    one = torch.ones(1, 2, dtype=torch.long)
    return Rollout(prompt_ids=one, prompt_mask=one.bool(), response_ids=one, mask=one.bool(),
                   ended=torch.ones(1, dtype=torch.bool), prompts=["p"], responses=["r"],
                   prompt_lens=[2], response_lens=[2], extras=[{}])


def fine(prompts, responses):
    return [1.0] * len(prompts)


def raises(prompts, responses):
    raise KeyError("answer")


def hangs(prompts, responses):
    threading.Event().wait()


def stops(prompts, responses):  # e.g. a reward service's own clear stop (a UserError)
    raise UserError("the service said no")


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        settings = reward_settings(load_config(None, ["reward.timeout_s=1"]))
        # (rank 0's function, rank 1's function) -> what every rank raises; the rank that did
        # not fail names the one that did and says why (not "see another rank's log")
        for fns, expected, on_rank0 in [
                ((fine, raises), RewardFunctionError, "on rank 1: .*KeyError"),
                ((fine, hangs), RewardTimeout, "on rank 1: .*did not return within"),
                ((raises, hangs), RewardTimeout, "on rank 1: .*did not return within"),
                ((fine, stops), UserError, "on rank 1: the service said no")]:
            with pytest.raises(expected) as e:
                reward_scores(_rollout(), types.SimpleNamespace(reward_fn=fns[rank]), settings,
                              None)
            if rank == 0:
                assert re.search(on_rank0, str(e.value)), str(e.value)
        # rank 1's call hangs (reward.timeout_s = 600) and only rank 1 gets SIGTERM: rank 0,
        # waiting for the agreement, gives the call up with it
        if rank == 1:
            threading.Timer(0.3, abandon.request, args=(signal.SIGTERM,)).start()
        patient = reward_settings(load_config(None, ["reward.timeout_s=600"]))
        t0 = time.monotonic()
        with pytest.raises(abandon.Abandoned) as e:
            reward_scores(_rollout(), types.SimpleNamespace(reward_fn=(fine, hangs)[rank]),
                          patient, None)
        assert (e.value.signum, e.value.phase) == (signal.SIGTERM, "reward call")
        assert time.monotonic() - t0 < 10
        abandon.clear()
        scores, _ = reward_scores(_rollout(), types.SimpleNamespace(reward_fn=fine), settings,
                                  None)
        assert scores.tolist() == [1.0]  # the ranks are still in step
        # an environment that failed on rank 1 only: rank 0 stops with its message and advice
        from ds_ppo.envs.base import EnvFailed
        from ds_ppo.ppo.episodes import _failure

        mine = EnvFailed("calc failed at episode 3, turn 1: ValueError: bad") if rank else None
        if mine is not None:
            mine.fix = "Fix the environment"
        got = _failure(mine)
        assert got is mine if rank else (
            str(got) == "on rank 1: calc failed at episode 3, turn 1: ValueError: bad"
            and got.fix == "Fix the environment")
    finally:
        dist.destroy_process_group()


def test_reward_function_outcome_is_agreed_by_all_ranks(tmp_path):
    """A timeout anywhere is a RewardTimeout everywhere (the trainer then checkpoints, a
    collective); an error anywhere is a RewardFunctionError everywhere."""
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
