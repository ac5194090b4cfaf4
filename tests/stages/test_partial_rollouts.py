"""ppo.partial_rollouts (ppo/partial.py, docs/ASYNC.md): a rollout decoded in segments gives the
tokens and log-probs of one decoding call when the weights do not change; the schedule says which
version samples each token; a run killed with sequences in flight resumes exactly; the config
refuses what it cannot run, naming the keys."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_decode import EOS, PAD, V, tiny_llama
from test_reward_stream import STOPS
from test_schedule import SMALL, _column, _rows, _same_weights, _train, _weights

from ds_ppo.algo import response_mask
from ds_ppo.algo.choices import partial_plan, segment_end
from ds_ppo.config import load_config
from ds_ppo.config.checks import validate
from ds_ppo.config.sections import GenerationConfig
from ds_ppo.engine.batch_invariant import batch_invariant
from ds_ppo.engine.generation import decode_on_replica
from ds_ppo.errors import ConfigError
from ds_ppo.ppo.partial import continue_partial, start_partial

PARTIAL = ["ppo.schedule=async", "ppo.max_staleness=2", "ppo.rollout_correction=tis",
           "ppo.partial_rollouts=true"]



@pytest.fixture
def invariant_kernels():
    """Batch-invariant kernels (generation.batch_invariant): a prefill of prompt + tokens so far
    and the decoding steps it replaces then round alike on any CPU, so one decoding call and its
    segments can be compared bit for bit (with a CPU's own kernels they may differ in the last
    bits, depending on the shapes and the instruction set)."""
    with batch_invariant():
        yield

def test_partial_plan_by_hand():
    # N = 2: beside iteration j, the last segment of j + 1's rollout and the first of j + 2's;
    # at iteration 1 the whole of rollout 2 (no iteration 0 to start it)
    assert [partial_plan(2, j) for j in (1, 2, 3)] == [[(2, 2), (3, 1)], [(3, 2), (4, 1)],
                                                       [(4, 2), (5, 1)]]
    assert partial_plan(3, 1) == [(2, 3), (3, 2), (4, 1)]
    # segments of max_new_tokens / N tokens, one longer where it does not divide
    assert [segment_end(6, 4, s) for s in range(5)] == [0, 2, 3, 5, 6]
    # every rollout t >= 2 reaches N segments beside t - 1, each segment s beside a later
    # iteration than the one before it, so its tokens are 1 to N updates old when t trains
    for n in (2, 3, 5):
        done: dict[int, list[int]] = {}  # rollout -> the iteration that decoded each segment
        for j in range(1, 20):
            for t, s in partial_plan(n, j):
                done.setdefault(t, [])
                done[t] += [j] * (s - len(done[t]))
        for t in range(2, 18):
            assert len(done[t]) == n and done[t] == sorted(done[t])
            assert done[t][-1] == t - 1 and all(1 <= t - j <= n for j in done[t])


def _prompts(N: int, P: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (N, P), generator=g)
    mask = torch.ones(N, P, dtype=torch.bool)
    for b in range(0, N, 2):  # left padding on every other row
        mask[b, :b % P] = False
        ids[b, :b % P] = PAD
    return ids, mask


def test_two_segments_equal_one_decoding_call(invariant_kernels):
    """Same weights, same random stream: a rollout decoded in two segments (the second
    prefilled from prompt + the first's tokens) has the tokens and log-probs of one call, bit
    for bit; each token carries the version it was decoded with, EOS stays blocked across the
    boundary until min_new_tokens in all, and rows that ended are not decoded again."""
    model = tiny_llama()
    N, P, T, K = 6, 5, 12, 6
    ids, mask = _prompts(N, P)
    stops = list(range(1, 40))  # many stop tokens: rows end at several steps after K
    cfg = GenerationConfig(max_new_tokens=T, min_new_tokens=K, temperature=1.0)
    one = decode_on_replica(model, ids, mask, cfg, stops, PAD,
                            torch.Generator().manual_seed(7))
    lengths = one.mask.sum(-1)
    assert (lengths < T).any() and (lengths == T).any() and (lengths >= K).all()
    prompts = SimpleNamespace(input_ids=[ids[b][mask[b]].tolist() for b in range(N)])
    part = start_partial(5, list(range(N)), 1, T, PAD, ids.device)
    g = torch.Generator().manual_seed(7)
    continue_partial(part, 1, 2, model, prompts, cfg, stops, PAD, 3, g)
    assert part.tokens == K and part.live.all() and (part.versions[:, :K] == 3).all()
    continue_partial(part, 2, 2, model, prompts, cfg, stops, PAD, 4, g)
    assert part.finished and part.first_version == 3
    W = one.response_ids.shape[1]
    got = part.response_ids.masked_fill(~response_mask(part.response_ids, stops), PAD)
    assert torch.equal(got[:, :W], one.response_ids) and (got[:, W:] == PAD).all()
    assert torch.equal(part.logprobs[:, :W], one.logprobs)
    expected = torch.where(torch.arange(T) < K, 3, 4).expand(N, T)
    counted = response_mask(part.response_ids, stops)
    assert torch.equal(part.versions[counted], expected[counted].int())
    assert (part.versions[~counted] == -1).all()
    # without min_new_tokens some rows end in the first segment: they keep their tokens and
    # are left out of the second
    free = GenerationConfig(max_new_tokens=T, temperature=1.0)
    part = start_partial(5, list(range(N)), 1, T, PAD, ids.device)
    g = torch.Generator().manual_seed(7)
    continue_partial(part, 1, 2, model, prompts, free, stops, PAD, 0, g)
    first = part.response_ids.clone()
    ended = ~part.live
    assert ended.any() and part.live.any()
    continue_partial(part, 2, 2, model, prompts, free, stops, PAD, 1, g)
    assert torch.equal(part.response_ids[ended], first[ended])
    assert (part.versions[ended] <= 0).all() and (part.versions[~ended][:, K] == 1).all()


class _Tokens:
    """A tokenizer's decode for the tiny model's ids (pad and EOS skipped as special)."""

    pad_token_id = PAD

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(t) for t in ids if t not in (PAD, EOS))


def test_a_partial_rollout_is_the_rollout_of_one_decoding_call(invariant_kernels):
    """Same weights and stream: the `Rollout` assembled from three segments equals the one
    `replica_rollout` decodes in one go (ids, masks, log-probs, texts, lengths), two samples
    per prompt; its `token_versions` say which segment sampled each token."""
    from ds_ppo.data.prompts import PromptSet
    from ds_ppo.ppo.partial import partial_rollout
    from ds_ppo.ppo.rollout import RolloutSettings, replica_rollout

    model = tiny_llama()
    ids, mask = _prompts(3, 5)
    prompts = PromptSet([ids[b][mask[b]].tolist() for b in range(3)], ["", "", ""])
    stops = list(range(1, 30))
    cfg = GenerationConfig(max_new_tokens=9, temperature=1.0, min_new_tokens=6)
    one, _ = replica_rollout(prompts, [2, 0, 1], model, RolloutSettings(2, cfg), _Tokens(),
                             stops, ids.device, torch.Generator().manual_seed(5))
    part = start_partial(4, [2, 0, 1], 2, 9, PAD, ids.device)
    g = torch.Generator().manual_seed(5)
    for s in (1, 2, 3):
        continue_partial(part, s, 3, model, prompts, cfg, stops, PAD, s, g)
    got, _ = partial_rollout(part, prompts, cfg, _Tokens(), stops)
    for key in ("prompt_ids", "prompt_mask", "response_ids", "mask", "ended",
                "rollout_logprobs"):
        assert torch.equal(getattr(got, key), getattr(one, key)), key
    assert (got.responses, got.response_lens, got.prompts) == (one.responses, one.response_lens,
                                                               one.prompts)
    assert got.sampling == one.sampling and len(set(got.response_lens)) > 1
    by_segment = (torch.arange(got.mask.shape[1]) // 3 + 1).expand_as(got.mask)
    assert torch.equal(got.token_versions[got.mask], by_segment[got.mask].int())
    assert (got.token_versions[~got.mask] == -1).all()


def _reward_worker(fn):
    """A `RolloutWorker` on the tiny model with reward function `fn`, two samples per prompt,
    responses of 9 tokens at most in two segments, many stop tokens (rows end in either)."""
    from ds_ppo.data.prompts import PromptSet
    from ds_ppo.ppo.rollout_worker import RolloutWorker

    ids, mask = _prompts(3, 5)
    prompts = PromptSet([ids[b][mask[b]].tolist() for b in range(3)], ["", "", ""])
    cfg = load_config(None, ["generation.max_new_tokens=9", "ppo.samples_per_prompt=2"])
    worker = RolloutWorker(cfg, prompts, _Tokens(), list(range(1, 60)), ids.device, fn, 2)
    worker.replica = tiny_llama()
    return worker


def _scored(prompts, responses):
    return [len(r) + 0.1 * len(p) for p, r in zip(prompts, responses)]


def test_partial_rows_stream_their_rewards_in_the_segment_they_end(monkeypatch):
    """reward.stream: a partial rollout's rows go to the reward stream in the segment they end
    (their calls overlap the later segments), each called once, the scores in row order those
    of one call on the whole rollout; a `Partial` from a checkpoint (no calls in flight saved)
    hands its ended rows in again on resume and gives the same scores."""
    import io

    from ds_ppo.ppo.reward_stream import RewardStream
    from ds_ppo.ppo.scoring import call_reward

    handed: list[tuple[str, int]] = []  # (segment, row) as the stream took them
    at, add = ["1"], RewardStream.add
    monkeypatch.setattr(RewardStream, "add", lambda self, rows, *a: (
        handed.extend((at[0], r) for r in rows), add(self, rows, *a))[1])
    called: list[str] = []
    worker = _reward_worker(lambda p, r: (called.extend(r), _scored(p, r))[1])
    g = torch.Generator().manual_seed(5)
    (part,) = worker.advance([(4, [2, 0, 1], None, 1)], 1, 2, g).partial
    ended = (~part.live).nonzero().flatten().tolist()
    assert ended and part.live.any()
    assert [r for s, r in handed if s == "1"] == ended  # handed in beside the first segment
    buf = io.BytesIO()
    torch.save((part, g.get_state()), buf)
    at[0] = "2"
    (got,) = worker.advance([(4, [2, 0, 1], part, 2)], 2, 2, g).rollouts
    live = [r for r in range(6) if r not in ended]
    assert sorted(r for s, r in handed if s == "2") == live
    assert sorted(called) == sorted(got.rollout.responses)  # each row called once
    whole = call_reward(got.rollout, _scored, worker.rewards)
    assert got.called.error is None and got.called.scores == whole.scores
    # resumed: a new worker (no streams) continues the saved Partial
    buf.seek(0)
    saved, state = torch.load(buf, weights_only=False)
    resumed = _reward_worker(lambda p, r: (called.extend(r), _scored(p, r))[1])
    at[0], handed[:], called[:] = "resumed", [], []
    (again,) = resumed.advance([(4, [2, 0, 1], saved, 2)], 2, 2,
                               torch.Generator().set_state(state)).rollouts
    assert sorted(r for _, r in handed) == list(range(6))
    assert again.rollout.responses == got.rollout.responses
    assert again.called.scores == got.called.scores


def test_a_rollout_ended_early_stays_in_flight_until_its_last_segment():
    """A rollout whose rows all end in its first segment comes back as a `Partial` (its
    reward calls run on beside the next iteration, which does not wait for them), buffered
    at its last segment with no more decoding: the same tokens, versions and scores."""
    from ds_ppo.ppo.scoring import call_reward

    worker = _reward_worker(_scored)
    worker.eos_ids = list(range(1, 90))  # every row ends within 4 tokens
    g = torch.Generator().manual_seed(5)
    first = worker.advance([(4, [2, 0, 1], None, 1)], 1, 2, g)
    (part,) = first.partial
    assert part.finished and not first.rollouts and part.segments == 1
    state = g.get_state()
    (got,) = worker.advance([(4, [2, 0, 1], part, 2)], 2, 2, g).rollouts
    assert torch.equal(g.get_state(), state)  # nothing decoded at the last segment
    assert got.version == 1 and (got.rollout.token_versions[got.rollout.mask] == 1).all()
    assert got.called.scores == call_reward(got.rollout, _scored, worker.rewards).scores


def test_failing_partial_reward_fails_as_one_call():
    """A reward call failing beside an early segment fails the rollout's reward as the call on
    the whole rollout does (scoring then raises the agreed error on the training thread)."""
    from ds_ppo.ppo.scoring import call_reward

    def fn(prompts, responses):
        raise ValueError("cannot score")

    worker = _reward_worker(fn)
    g = torch.Generator().manual_seed(5)
    (part,) = worker.advance([(4, [2, 0, 1], None, 1)], 1, 2, g).partial
    (got,) = worker.advance([(4, [2, 0, 1], part, 2)], 2, 2, g).rollouts
    whole = call_reward(got.rollout, fn, worker.rewards)
    assert got.called.scores == [] and type(got.called.error) is type(whole.error)
    assert str(got.called.error) == str(whole.error)


def test_partial_resume_continues_exactly(tmp_path):
    """async 2 with partial rollouts: the checkpoint after iteration 3 holds iteration 4's
    rollout (first half from version 1, second from version 2) and iteration 5's first half
    (version 2) in flight, some of its rows ended (their streamed reward calls are not saved:
    the resumed run calls them again); the resumed run equals the uninterrupted one, and so
    does a run with reward.stream off."""
    full, split = tmp_path / "full", tmp_path / "split"
    stops = f"generation.stop_tokens=[{STOPS}]"  # rows end in either segment
    _train(full, *PARTIAL, stops, "iterations=5", "checkpoint.every=3")
    _train(split, *PARTIAL, stops, "iterations=3", "checkpoint.every=3")
    held = torch.load(split / "checkpoints" / "iter_000003" / "in_flight" / "rank_00000.pt",
                      weights_only=False)
    T = 6  # SMALL's generation.max_new_tokens; segments of 3 tokens
    (b,) = held["buffer"]
    assert b.iteration == 4 and b.version == 1
    versions, mask = b.rollout.token_versions, b.rollout.mask
    by_column = torch.where(torch.arange(versions.shape[1]) < 3, 1, 2).expand_as(versions)
    assert torch.equal(versions[mask], by_column[mask].int()) and (versions[~mask] == -1).all()
    (p,) = held["partial"]
    assert (p.iteration, p.segments, p.tokens, p.first_version) == (5, 1, 3, 2)
    assert (p.versions[p.live][:, :3] == 2).all() and (p.versions[:, 3:] == -1).all()
    assert p.response_ids.shape[1] == T and p.logprobs[p.live][:, :3].lt(0).all()
    assert p.live.any() and not p.live.all()
    _train(split, *PARTIAL, stops, "iterations=5", "checkpoint.every=3")
    a, b = _rows(full), _rows(split)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4, 5] and a == b
    # the streamed calls give the scores of one call per rollout, metric for metric
    _train(tmp_path / "whole", *PARTIAL, stops, "reward.stream=false", "iterations=5",
           "checkpoint.every=0", "checkpoint.save_at_end=false")
    assert _rows(tmp_path / "whole") == a
    assert _same_weights(_weights(full, 5), _weights(split, 5))
    for key in ("async/token_staleness_mean", "async/continued_token_share",
                "async/token_staleness_max", "async/staleness_max"):
        assert _column(full, key) == _column(split, key), key
    # iteration 2's rollout is whole (version 0); from 3 on, tokens 1 and 2 updates old
    assert _column(split, "async/token_staleness_max") == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert _column(split, "async/continued_token_share")[:2] == [0.0, 0.0]
    assert all(0 < x <= 0.5 for x in _column(split, "async/continued_token_share")[2:])
    assert all(1 < x < 2 for x in _column(split, "async/token_staleness_mean")[2:])
    assert _column(split, "async/regenerated") == [0.0] * 5
    # a rollout's segments count as one decoding of its rows
    assert all(0 < x <= 1 for x in _column(split, "generation/slot_utilisation"))


def test_every_iteration_syncs_on_every_rank():
    """The weight sync is collective: every rank takes part in it beside every iteration,
    whatever it has left to decode (here nothing: the rollouts of the plan are buffered
    already, held by a checkpoint)."""
    from ds_ppo.ppo.schedule import RolloutSchedule

    s = RolloutSchedule.__new__(RolloutSchedule)
    s.max_staleness = s.lag = 2
    s.replica_version, s.pending, s.partial, s.remote = 0, None, {}, None
    s.buffer = {3: SimpleNamespace(version=0), 4: SimpleNamespace(version=1)}
    s.prompts_of = lambda j: [j]
    synced: list[int] = []
    s._sync = synced.append
    s._start_segments(2)
    assert synced == [1] and s.pending is None


@pytest.mark.parametrize("overrides,names", [
    (["ppo.partial_rollouts=true"], ["ppo.schedule = 'sync'", "ppo.schedule=async",
                                     "ppo.max_staleness >= 2", "ppo.partial_rollouts=false"]),
    ([*PARTIAL, "ppo.max_staleness=1"], ["ppo.max_staleness = 1", "ppo.max_staleness >= 2"]),
    ([*PARTIAL, "ppo.max_staleness=0"], ["ppo.max_staleness = 0", "ppo.max_staleness >= 2"]),
    ([*PARTIAL, "ppo.router_replay=true"], ["ppo.router_replay = true",
                                            "ppo.partial_rollouts=false"]),
    ([*PARTIAL, "env.function=ds_ppo.envs.calculator:Calculator"],
     ["with an env section", "ppo.partial_rollouts=false"]),
    ([*PARTIAL, "ppo.max_staleness=8"], ["generation.max_new_tokens = 6",
                                         "generation.max_new_tokens >= 8"]),
])
def test_partial_refusals_name_the_keys(overrides, names):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*SMALL, *overrides]), 2)
    line = next(x for x in str(e.value).splitlines() if "ppo.partial_rollouts" in x)
    assert all(n in line for n in names), line


def test_partial_settings_pass():
    validate(load_config(None, [*SMALL, *PARTIAL]), 1)
    validate(load_config(None, [*SMALL, *PARTIAL, "ppo.placement=split"]), 2)
    validate(load_config(None, [*SMALL, *PARTIAL, "ppo.max_staleness=6",
                                "ppo.rollout_correction=mis"]), 1)


@pytest.mark.parametrize("partial_rollouts,max_staleness,says", [
    (True, 3, "with ppo.max_staleness = 3, not the checkpoint's 2 (their segments end elsewhere)"),
    (False, 2, "with ppo.partial_rollouts off"),
])
def test_a_resume_that_restarts_the_partial_rollouts_says_why(caplog, partial_rollouts,
                                                              max_staleness, says):
    """A checkpoint of async 2 with iteration 5's rollout decoded in part, resumed with another
    max_staleness or without partial rollouts: the log line names the setting that changed."""
    import logging

    from ds_ppo.ppo.schedule import RolloutSchedule

    s = RolloutSchedule.__new__(RolloutSchedule)
    s.partial_rollouts, s.max_staleness = partial_rollouts, max_staleness
    s.partial, s.generator = {}, torch.Generator()
    s.run = SimpleNamespace(engines=SimpleNamespace(device=torch.device("cpu")),
                            cfg=SimpleNamespace(ppo=SimpleNamespace(placement="colocated")))
    saved = {"schedule": "async", "max_staleness": 2, "placement": "colocated", "completed": 3,
             "buffer": [], "partial": [SimpleNamespace(iteration=5)],
             "generator": torch.Generator().get_state()}
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        s.load_state_dict(saved)
    assert s.partial == {}
    (line,) = [r.getMessage() for r in caplog.records if "partial rollouts in flight" in
               r.getMessage()]
    assert f"(iterations [5]) {says}: they are decoded again from the start" in line, line
