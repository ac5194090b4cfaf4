"""A checkpoint's in-flight rollouts (in_flight/rank_N.pt) are range-checked before a resumed run
uses them, also where no manifest verified the file (checkpoint.verify = false): a flipped byte
in a version, a length or a count refuses the checkpoint in one line (exit code 2) instead of
training on it."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from ds_ppo.engine.checkpoint import read_in_flight
from ds_ppo.errors import CheckpointError
from ds_ppo.ppo.in_flight import in_flight_problem
from ds_ppo.ppo.partial import Partial
from ds_ppo.ppo.rollout import stamp_versions
from ds_ppo.ppo.rollout_worker import Buffered
from ds_ppo.ppo.scoring import RewardCall
from support.rollouts import padded_rollout

COMPLETED, PROMPTS, VOCAB = 3, 4, 16


def _buffered(iteration: int, version: int) -> Buffered:
    rollout = stamp_versions(padded_rollout([[1, 2], [3]], [[4, 5, 6], [7]], P=3, T=4), version)
    rollout.rollout_logprobs = torch.where(rollout.mask, -0.5, 0.0)
    return Buffered(iteration, version, rollout, None, RewardCall([1.0, 0.0], None, 0.1), 0.2)


def _partial(iteration: int) -> Partial:
    versions = torch.tensor([[3, -1, -1], [3, -1, -1]], dtype=torch.int32)
    return Partial(iteration, [0, 0], torch.tensor([[5, 0, 0], [6, 0, 0]]), torch.zeros(2, 3),
                   versions, torch.ones(2, dtype=torch.bool), tokens=1, segments=1,
                   first_version=3)


def _saved(**changes) -> dict:
    """What an async run with max_staleness 2 holds after iteration 3: the rollouts of 4 and 5
    (version 2) and one decoded in part."""
    saved = {"schedule": "async", "max_staleness": 2, "placement": "colocated",
             "completed": COMPLETED, "buffer": [_buffered(4, 2), _buffered(5, 2)],
             "partial": [_partial(5)], "generator": torch.Generator().get_state()}
    return {**saved, **changes}


def _problem(saved) -> str | None:
    return in_flight_problem(saved, COMPLETED, PROMPTS, VOCAB)


def _with_rollout(**fields) -> dict:
    b = _buffered(4, 2)
    return _saved(buffer=[replace(b, rollout=replace(b.rollout, **fields))])


def test_what_a_run_saves_is_in_range():
    assert _problem(_saved()) is None and _problem(None) is None
    assert _problem(_saved(buffer=_buffered(4, 3), partial=[])) is None  # one rollout, older


@pytest.mark.parametrize("saved, words", [
    (_saved(completed=4), "saved after iteration 4, but the checkpoint is of iteration 3"),
    (_saved(max_staleness=2**20), "ppo.max_staleness = 1048576"),
    (_saved(schedule="sync"), "ppo.schedule = 'sync'"),
    (_saved(buffer=[_buffered(4, 2), _buffered(1028, 2)]), "rollout for iteration 1028"),
    (_saved(buffer=[_buffered(4, 1026)]), "from policy version 1026 (0 to 3)"),
    (_saved(buffer=[_buffered(4, 2)] * 3), "3 buffered rollouts (at most 2"),
    (_with_rollout(token_versions=torch.tensor([[2, 1026, 2, -1], [2, -1, -1, -1]],
                                               dtype=torch.int32)),
     "token versions 2 to 1026 (0 to the checkpoint's iteration 3)"),
    (_with_rollout(response_lens=[3, 1, 1]), "3 response_lens for 2 rows"),
    (_with_rollout(prompt_lens=[2, 259]), "prompt_lens [2, 259] (0 to 3)"),
    (_with_rollout(mask=torch.ones(2, 5, dtype=torch.bool)), "mask of shape (2, 5)"),
    (_with_rollout(response_ids=torch.tensor([[4, 5, 6 + 2**16, 0], [7, 0, 0, 0]])),
     "response_ids 0 to 65542 (token ids: 0 to 15)"),
    (_with_rollout(rollout_logprobs=torch.full((2, 4), float("nan"))), "sampler log-probs"),
    (_saved(partial=[replace(_partial(5), segments=257)]), "after 257 segments"),
    (_saved(partial=[replace(_partial(5), indices=[0, 2**24])]), "prompt indices outside 0 to 3"),
    (_saved(partial=[replace(_partial(5), versions=torch.full((2, 3), 259, dtype=torch.int32))]),
     "token versions 259 to 259"),
    (_saved(generator=[1, 2]), "random stream state"),
])
def test_a_number_out_of_range_is_named(saved, words):
    problem = _problem(saved)
    assert problem is not None and words in problem, problem
    assert "\n" not in problem


def _checkpoint(tmp_path, saved: dict):
    path = tmp_path / "checkpoints" / f"iter_{COMPLETED:06d}"
    (path / "in_flight").mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"iteration": COMPLETED}))
    torch.save(saved, path / "in_flight" / "rank_00000.pt")
    return path, path / "in_flight" / "rank_00000.pt"


def _check(saved, iteration):
    return in_flight_problem(saved, iteration, PROMPTS, VOCAB)


def test_a_flipped_byte_in_a_token_version_refuses_the_checkpoint(tmp_path):
    b = _buffered(4, 2)
    mark = b.rollout.token_versions.numpy().tobytes()  # [[2, 2, 2, -1], [2, -1, -1, -1]]
    path, file = _checkpoint(tmp_path, _saved(buffer=[b], partial=[]))
    assert read_in_flight(path, _check) is not None  # as saved: in range
    data = bytearray(file.read_bytes())
    at = data.index(mark)
    data[at + 1] ^= 0x04  # the first version, 2, becomes 2 + 1024: an unverified file loads it
    file.write_bytes(bytes(data))
    held = read_in_flight(path)  # no check: what a resumed run used to train on
    assert int(held["buffer"][0].rollout.token_versions[0, 0]) == 1026
    with pytest.raises(CheckpointError) as info:
        read_in_flight(path, _check)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    assert f"{file} holds the buffered rollout of iteration 4 with token versions 2 to 1026" \
        in message and "the file is damaged" in message
