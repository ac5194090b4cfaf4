"""Streaming rewards (reward.stream, ppo/reward_stream.py): the decoding loop hands each response
in as it ends, its reward call runs while the other rows decode, the scores are those of one
call in row order (rows handed in with other texts are called again), a failing call fails the
rollout's reward as one call does, and a training run with streamed rewards equals one with a
single call per rollout, metric for metric."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from ds_ppo.bench.forced_lengths import ForcedLengths, forced_prompts
from test_decode import EOS, PAD, V, tiny_llama

from ds_ppo.config import load_config
from ds_ppo.containers import Rollout
from ds_ppo.engine.generation.loop import decode
from ds_ppo.errors import RewardFunctionError
from ds_ppo.ppo.reward_stream import RewardStream, _pool
from ds_ppo.ppo.scoring import reward_call_settings


def test_decode_hands_in_rows_as_they_end():
    # forced lengths: rows 1 and 3 end after 2 tokens, the others run to 12; checked every step
    lengths = [12, 2, 12, 2, 12]
    ids, mask = forced_prompts(lengths, 4, V, PAD)
    model = ForcedLengths(tiny_llama(), EOS).eval()
    handed = []
    out = decode(model, ids, mask, max_new_tokens=12, eos_ids=[EOS], pad_id=PAD,
                 stop_check_every=1, on_done=lambda rows, toks: handed.append((rows, toks)))
    assert [rows for rows, _ in handed] == [[1, 3], [0, 2, 4]]
    for rows, toks in handed:  # each row's tokens as the loop returns them
        for r, t in zip(rows, toks):
            assert t[:out.response_ids.shape[1]] == out.response_ids[r].tolist()


def _cfg(*overrides: str):
    return load_config(None, ["reward.concurrency=2", *overrides])


def _rollout(prompts: list[str], responses: list[str]) -> Rollout:
    B = len(prompts)
    ids = torch.zeros(B, 1, dtype=torch.long)
    return Rollout(prompt_ids=ids, prompt_mask=ids.bool(), response_ids=ids, mask=ids.bool(),
                   ended=torch.ones(B, dtype=torch.bool), prompts=prompts, responses=responses,
                   prompt_lens=[1] * B, response_lens=[1] * B, extras=[{} for _ in range(B)])


def test_reward_calls_run_while_decoding_goes_on():
    # the model's forwards after the first hand-in wait until a reward call has started: with
    # the call made only after decoding, that never happens and the wait runs out
    lengths = [2, 12, 12]
    ids, mask = forced_prompts(lengths, 4, V, PAD)
    started, waited = threading.Event(), []

    class Waiting(ForcedLengths):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                    use_cache=None, logits_to_keep=0):
            if handed:
                waited.append(started.wait(30))
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache,
                                   logits_to_keep)

    def fn(prompts, responses):
        started.set()
        return [float(len(r)) for r in responses]

    stream, handed = RewardStream(fn, reward_call_settings(_cfg()), _pool(2)), []
    model = Waiting(tiny_llama(), EOS).eval()

    def on_done(rows, toks):
        handed.append(rows)
        stream.add(rows, [f"p{r}" for r in rows], [str(t) for t in toks], [{}] * len(rows))

    decode(model, ids, mask, max_new_tokens=12, eos_ids=[EOS], pad_id=PAD, stop_check_every=1,
           on_done=on_done)
    assert handed[0] == [0] and waited and all(waited)


def test_stream_scores_in_row_order_and_calls_changed_rows_again():
    calls = []

    def fn(prompts, responses):
        calls.append(list(responses))
        return [float(len(r)) for r in responses]

    stream = RewardStream(fn, reward_call_settings(_cfg()), _pool(2))
    stream.add([2, 0], ["p2", "p0"], ["ccc", "a"], [{}, {}])
    stream.add([3], ["p3"], ["old"], [{}])  # row 3 decoded again later: its text changed
    rollout = _rollout(["p0", "p1", "p2", "p3"], ["a", "bb", "ccc", "dddd"])
    called = stream.result(rollout)
    assert called.error is None and called.scores == [1.0, 2.0, 3.0, 4.0]
    # the streamed calls (one or two: rows handed in while a call runs may join the next)
    assert sorted(r for c in calls[:-1] for r in c) == ["a", "ccc", "old"]
    assert calls[-1] == ["bb", "dddd"]  # the rows missing or changed, in one call, at the end


def test_failing_streamed_call_fails_as_one_call():
    from ds_ppo.ppo.scoring import _function_scores

    def fn(prompts, responses):
        if "bad" in responses:
            raise ValueError("cannot score 'bad'")
        return [1.0] * len(responses)

    stream = RewardStream(fn, reward_call_settings(_cfg()), _pool(2))
    stream.add([1], ["p1"], ["bad"], [{}])
    stream.add([0], ["p0"], ["good"], [{}])
    rollout = _rollout(["p0", "p1"], ["good", "bad"])
    called = stream.result(rollout)
    assert called.scores == [] and isinstance(called.error, RewardFunctionError)
    with pytest.raises(RewardFunctionError, match="raised ValueError: cannot score 'bad'"):
        _function_scores(rollout, fn, reward_call_settings(_cfg()), called=called)


# the tiny default, with responses of many lengths: 64 byte pieces of its tokenizer end them
STOPS = ",".join(f"<0x{b:02X}>" for b in range(0x80, 0xC0))
SMALL = ["tracking.enabled=false", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=4", "generation.max_new_tokens=12", "iterations=2",
         "checkpoint.every=0", "checkpoint.save_at_end=false", "checkpoint.export_at_end=false",
         "generation.stop_check_every=1", "generation.batch_size=4",
         f"generation.stop_tokens=[{STOPS}]"]
VOLATILE = ("time/", "tokens_per_s/", "memory/")


def test_streamed_training_equals_one_call_per_rollout(tmp_path, monkeypatch):
    from ds_ppo.ppo import reward_stream
    from ds_ppo.trainer import train

    calls = []
    real = reward_stream.call_reward_rows

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(reward_stream, "call_reward_rows", counted)
    rows = {}
    for stream in ("true", "false"):
        out = tmp_path / stream
        train(load_config(None, [*SMALL, f"output_dir={out}", f"reward.stream={stream}"]))
        rows[stream] = [{k: v for k, v in json.loads(line).items()
                         if not k.startswith(VOLATILE)}
                        for line in Path(out / "metrics.jsonl").read_text().splitlines()]
        if stream == "true":  # 16 responses over 2 iterations, all through the stream (how
            # many calls depends on how the hand-ins coalesce while calls run)
            assert sum(calls) == 16 and len(calls) >= 2, calls
    assert len(rows["true"]) == 2 and rows["true"] == rows["false"]
