"""Critic-free estimators in the pipeline, without DeepSpeed: the rollout layout of n samples per
prompt, add_advantages for every estimator, the resume guard between estimator families, and the
verifiable reward of the grpo example."""
from __future__ import annotations

import json
import types

import pytest
import torch

from ds_ppo.algo import discounted_returns, group_advantages, kl_estimate, masked_whiten
from ds_ppo.config import load_config
from ds_ppo.containers import Experience, Rollout
from ds_ppo.data.prompts import PromptSampler
from ds_ppo.errors import UserError
from ds_ppo.ppo.advantages import add_advantages, advantage_settings
from ds_ppo.ppo.update import minibatch_rows
from conftest import mask_from_lengths


@pytest.mark.parametrize("epoch", [0, 1])
def test_groups_stay_on_one_rank_and_minibatches_match_at_any_world_size(epoch):
    """rollout_batch_size prompts x n responses (make_rollout repeats each of the sampler's
    prompts n times, next to each other); mini_batch_size counts responses."""
    prompts, n, mini = 16, 4, 16  # 64 responses, 4 mini-batches of 4 prompts

    def layout(world):
        minibatches, where = [[] for _ in range(prompts * n // mini)], {}
        for r in range(world):
            s = PromptSampler(100, prompts, r, world, seed=7, group_size=mini // n)
            rows = [i for i in s.indices(3) for _ in range(n)]  # as make_rollout lays them out
            for g in range(0, len(rows), n):  # a group: n copies of one prompt, on this rank
                assert len(set(rows[g:g + n])) == 1
                where[rows[g]] = r
            for j, mb in enumerate(minibatch_rows(len(rows), mini // world, r, epoch, 7, 3)):
                minibatches[j].extend(rows[i] for i in mb)
        return [sorted(mb) for mb in minibatches], where

    one, _ = layout(1)
    assert all(len(mb) == mini for mb in one)
    for world in (2, 4):
        got, where = layout(world)
        assert got == one
        assert len(set(where.values())) == world  # every rank holds whole groups
    if epoch == 0:  # as sampled: every prompt's n responses in one mini-batch
        assert all(mb.count(p) == n for mb in one for p in set(mb))


def _experience(scores, lengths, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(scores)
    mask = mask_from_lengths(torch.tensor(lengths), T)
    ids = torch.ones(B, T, dtype=torch.long)
    rollout = Rollout(prompt_ids=ids[:, :2], prompt_mask=torch.ones(B, 2, dtype=torch.bool),
                      response_ids=ids, mask=mask, ended=torch.ones(B, dtype=torch.bool),
                      prompts=["p"] * B, responses=["r"] * B, prompt_lens=[2] * B,
                      response_lens=list(lengths), extras=[{}] * B)
    logp = -torch.rand(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    return Experience(rollout=rollout, old_logprobs=logp, ref_logprobs=ref, old_values=None,
                      scores=torch.tensor(scores), entropy=torch.zeros(B, T)), mask


SCORES = [0.1, 0.5, 0.5, 0.9, 0.3, 0.3, 0.3, 0.3]  # group 2 is constant
LENGTHS = [5, 3, 4, 1, 2, 5, 5, 3]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_give_each_response_its_group_advantage(estimator):
    cfg = load_config(None, [f"ppo.advantage_estimator={estimator}", "ppo.samples_per_prompt=4"])
    exp, mask = _experience(SCORES, LENGTHS)
    out = add_advantages(exp, advantage_settings(cfg, kl_coef=0.1))
    kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, "k1")
    seq = torch.tensor(SCORES)
    if estimator == "rloo":  # kl_in_reward defaults to true for rloo, false for (dr_)grpo
        seq = seq - 0.1 * (kl * mask).sum(-1)
    want = group_advantages(seq, 4, estimator)
    torch.testing.assert_close(out.advantages, torch.where(mask, want[:, None], 0.0))
    assert out.returns is None and out.train_rows is None
    if estimator != "rloo":  # a constant group carries no signal
        assert torch.equal(out.advantages[4:], torch.zeros(4, 5))


def test_reinforce_pp_whitens_discounted_kl_shaped_returns():
    cfg = load_config(None, ["ppo.advantage_estimator=reinforce_pp", "ppo.gamma=0.9"])
    exp, mask = _experience(SCORES, LENGTHS)
    out = add_advantages(exp, advantage_settings(cfg, kl_coef=0.1))
    assert cfg.ppo.kl_in_reward
    kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, "k1")
    rewards = torch.where(mask, -0.1 * kl, 0.0)
    last = torch.tensor(LENGTHS) - 1
    rewards[torch.arange(8), last] += torch.tensor(SCORES)
    torch.testing.assert_close(out.rewards, rewards)
    want = masked_whiten(discounted_returns(rewards, mask, 0.9), mask)
    torch.testing.assert_close(out.advantages, want)
    assert abs(float(out.advantages[mask].mean())) < 1e-5 and out.returns is None


def test_filter_zero_std_groups_marks_the_rows_of_constant_groups():
    cfg = load_config(None, ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4",
                             "ppo.filter_zero_std_groups=true"])
    exp, _ = _experience(SCORES, LENGTHS)
    out = add_advantages(exp, advantage_settings(cfg, kl_coef=0.1))
    assert out.train_rows == [True] * 4 + [False] * 4
    assert out.slice([0, 5]).train_rows == [True, False]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_zero_std_advantage_gives_constant_groups_the_batch_baseline(estimator):
    # two groups of 4 with a spread, one all wrong, one all right: with the key on, a constant
    # group's rows get the weight x their score whitened over the batch, the others keep theirs
    scores = [1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1, 1.1, 1.1, 1.1, 1.1, 0.0, 1.0, 1.0, 1.0]
    lengths = LENGTHS + LENGTHS
    overrides = [f"ppo.advantage_estimator={estimator}", "ppo.samples_per_prompt=4",
                 "ppo.kl_in_reward=false"]
    exp, mask = _experience(scores, lengths)
    off = add_advantages(exp, advantage_settings(load_config(None, overrides), kl_coef=0.1))
    on = add_advantages(exp, advantage_settings(
        load_config(None, overrides + ["ppo.zero_std_advantage=0.5"]), kl_coef=0.1))
    seq = torch.tensor(scores)
    batch = 0.5 * (seq - seq.mean()) / torch.sqrt(seq.var() + 1e-8)
    want = torch.cat([off.advantages[:4, 0], batch[4:12], off.advantages[12:, 0]])
    torch.testing.assert_close(on.advantages, torch.where(mask, want[:, None], 0.0))
    assert torch.equal(off.advantages[4:12], torch.zeros(8, 5))
    assert (on.advantages[4:8][mask[4:8]] < 0).all() and (on.advantages[8:12][mask[8:12]] > 0).all()


@pytest.mark.parametrize("overrides, words", [
    (["ppo.advantage_estimator=reinforce_pp"], "has no groups"),
    (["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4",
      "ppo.filter_zero_std_groups=true"], "leaves out")])
def test_zero_std_advantage_is_refused_where_it_cannot_act(overrides, words):
    from ds_ppo.config import validate
    cfg = load_config(None, overrides + ["ppo.zero_std_advantage=0.2", "ppo.rollout_batch_size=4",
                                         "ppo.mini_batch_size=16", "ppo.micro_batch_size=4"])
    with pytest.raises(UserError, match=words):
        validate(cfg, 1)


def _checkpoint(tmp_path, estimator, with_value):
    """A PPO checkpoint's trainer_state.json as a run writes it today."""
    ckpt = tmp_path / "iter_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps(
        {"iteration": 2, "world_size": 1, "seed": 1,
         "roles": ["policy", "value"] if with_value else ["policy"],
         "job_state": {"advantage_estimator": estimator}}))
    return ckpt


def test_resume_into_another_estimator_family_is_refused_naming_both(tmp_path):
    from ds_ppo.ppo.resume_check import check_estimator_family

    ckpt = _checkpoint(tmp_path, "gae", with_value=True)
    with pytest.raises(UserError) as info:
        check_estimator_family(ckpt, "grpo")
    msg = str(info.value)
    assert "'gae' (with a value model)" in msg and "'grpo' (without a value model)" in msg
    assert "ppo.advantage_estimator=gae" in msg
    check_estimator_family(ckpt, "gae")
    free = _checkpoint(tmp_path / "b", "rloo", with_value=False)
    check_estimator_family(free, "grpo")  # the same family: allowed
    with pytest.raises(UserError, match="'rloo' \\(without a value model\\).*'gae'"):
        check_estimator_family(free, "gae")


@pytest.mark.parametrize("estimator,roles", [(None, ["policy", "value"]),
                                             ("gae", ["policy", "value"]),
                                             ("grpo", ["policy"])])
def test_a_trainer_state_written_before_job_state_reads_in_todays_layout(tmp_path, estimator,
                                                                          roles):
    """A PPO checkpoint of the layout before `job_state`: its KL and entropy controllers, its
    estimator (none written before that key: gae) and its prompt position read into the job's
    state, its roles from the estimator; a supervised job's PPO defaults are dropped."""
    from ds_ppo.engine.checkpoint import read_state
    from ds_ppo.ppo.resume_check import check_estimator_family

    old = {"iteration": 3, "world_size": 1, "seed": 1, "kl_controller": {"value": 0.07},
           "entropy_controller": {"value": 0.01}, "prompts_drawn": 24}
    if estimator is not None:
        old["advantage_estimator"] = estimator
    ckpt = tmp_path / "iter_000003"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps(old))
    state = read_state(ckpt)
    assert state.roles == roles and state.iteration == 3
    assert state.job_state == {"kl_controller": {"value": 0.07},
                               "entropy_controller": {"value": 0.01}, "prompts_drawn": 24,
                               "advantage_estimator": estimator or "gae"}
    check_estimator_family(ckpt, estimator or "gae")  # the same run continues
    (ckpt / "trainer_state.json").write_text(json.dumps({**old, "job": "sft"}))
    state = read_state(ckpt)
    assert state.job_state == {} and state.roles == ["policy"]


def test_final_answer_match():
    from ds_ppo.rewards.functions import final_answer_match

    responses = ["so 1,000 apples", "The answer is \\boxed{42}.", "x = 3.0", "no idea",
                 "first 7 then 8", "\\boxed{Paris}", "\\boxed{12} or 13"]
    answers = ["1000", 42, "3", "1", "7", " paris", "12"]
    assert final_answer_match([""] * 7, responses, answer=answers) == \
        [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_evaluation_takes_one_greedy_response_per_prompt(monkeypatch):
    """n greedy samples of a prompt would be n copies: evaluation generates one, and the PPO
    job's evaluation generates with that config."""
    from ds_ppo.ppo import evaluate as ev, train_job as job

    cfg = load_config(None, ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4"])
    greedy = ev.greedy_config(cfg)
    assert (greedy.ppo.samples_per_prompt, greedy.generation.temperature) == (1, 0.0)
    assert cfg.ppo.samples_per_prompt == 4 and cfg.generation.temperature == 1.0
    seen = {}

    def make_rollout(prompts, indices, engines, s, *args):
        seen.update(n=s.samples_per_prompt, temperature=s.generation.temperature,
                    indices=indices)
        raise StopIteration

    monkeypatch.setattr(job, "make_rollout", make_rollout)
    ppo = job.PPOJob(cfg)
    ppo.eval_prompts = types.SimpleNamespace(input_ids=[[1]] * 8)
    ppo.gen_mode, ppo.eos_ids, ppo.reward_encode = "gathered", [2], None
    with pytest.raises(StopIteration):
        ppo._evaluate(cfg, types.SimpleNamespace(policy=None), None)
    assert seen == {"n": 1, "temperature": 0.0, "indices": list(range(8))}
