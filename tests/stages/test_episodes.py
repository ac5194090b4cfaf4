"""Multi-turn episodes (ds_ppo/ppo/episodes.py, ds_ppo/envs/): the tokens and masks of an
episode checked token by token against a scripted policy and environment; observations, stop
strings and the token budget; environments that raise, hang or answer badly; the HTTP
environment against a real local server; forwards over a response with holes."""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from ds_ppo import abandon
from ds_ppo.config import load_config
from ds_ppo.containers import Rollout
from ds_ppo.data.prompts import PromptSet
from ds_ppo.engine.forward import response_logprobs, response_values
from ds_ppo.engine.generation import Generated
from ds_ppo.envs.base import EnvFailed, Step
from ds_ppo.envs.calculator import Calculator, evaluate
from ds_ppo.envs.runner import EnvRunner
from ds_ppo.errors import ConfigError, RewardTimeout
from ds_ppo.ppo import episodes as episodes_module
from ds_ppo.ppo.episodes import cut_at_stop, episode_settings, make_episodes
from ds_ppo.bench.stand_ins import small_llama

# env.function=episode_envs:... finds this module
sys.modules.setdefault("episode_envs", sys.modules[__name__])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from ds_ppo.data.tokenizer import load_tokenizer

    return load_tokenizer("builtin:tiny", tmp_path_factory.mktemp("tok"))


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def _cfg(*overrides):
    return load_config(None, ["reward.function=null", "data.reward_keys=[answer]",
                              "generation.max_new_tokens=8", *overrides])


class ScriptedPolicy:
    """Stands in for generate(): each call answers each row with the next scripted turn of
    the episode whose prompt the row starts with, and records the contexts it was given."""

    def __init__(self, script: dict[tuple, list[list[int]]], eos: int, pad: int):
        self.script, self.eos, self.pad = script, eos, pad
        self.turn = {k: 0 for k in script}
        self.contexts: list[list[list[int]]] = []

    def __call__(self, policy, ids, am, gen_cfg, mode, eos_ids, pad_id, dtype, kept_replica=None,
                 on_done=None):
        rows, seen = [], []
        for row, keep in zip(ids.tolist(), am.tolist()):
            ctx = [t for t, k in zip(row, keep) if k]
            seen.append(ctx)
            key = next(k for k in self.script if tuple(ctx[:len(k)]) == k)
            rows.append(self.script[key][self.turn[key]])
            self.turn[key] += 1
        self.contexts.append(seen)
        width = max(len(r) for r in rows)
        out = torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
        ended = torch.tensor([r[-1] == self.eos for r in rows])
        if on_done is not None:  # as our loop: the shortest turns first, each row once
            for n in sorted({len(r) for r in rows}):
                done = [k for k, r in enumerate(rows) if len(r) == n]
                on_done(done, [out[k].tolist() for k in done])
        return Generated(response_ids=out, mask=mask, ended=ended, loop="own")


def _episodes(tok, monkeypatch, cfg, prompts_text, answers, script):
    prompt_ids = [_ids(tok, p) for p in prompts_text]
    prompts = PromptSet(input_ids=prompt_ids, texts=prompts_text,
                        extras=[{"answer": a} for a in answers])
    policy = ScriptedPolicy({tuple(p): s for p, s in zip(prompt_ids, script)},
                            tok.eos_token_id, tok.pad_token_id)
    monkeypatch.setattr(episodes_module, "generate", policy)
    engines = SimpleNamespace(policy=None, device=torch.device("cpu"), dtype=torch.float32,
                              replica=None)
    env = EnvRunner(cfg.env, cfg.data.reward_keys)
    out = make_episodes(prompts, list(range(len(prompts_text))), engines, episode_settings(cfg),
                        tok, "gathered", [tok.eos_token_id], env)
    return (*out, prompt_ids, policy)


def test_episode_tokens_masks_and_rewards_token_by_token(tok, monkeypatch):
    """Episode 0 calls the calculator (turn 1 is cut after `=`), reads " 7" and answers 7;
    episode 1 answers at once, wrongly. Every token, mask bit and reward is checked."""
    cfg = _cfg("env.function=ds_ppo.envs.calculator:Calculator", "env.max_turns=3",
               "env.stop=[\"=\"]")
    eos, good, happy, love = tok.eos_token_id, *_ids(tok, "good happy love")
    eq, seven = _ids(tok, "=")[-1], _ids(tok, "7")[-1]
    script = [[[good, happy, eq, love, love], [seven, eos]],  # love, love: after the stop
              [[love, eos]]]
    rollout, generated, stats, prompt_ids, policy = _episodes(
        tok, monkeypatch, cfg, ["what is 3 + 4 ?", "what is 2 + 2 ?"], ["7", "4"], script)
    obs = _ids(tok, " 7")
    want0 = [good, happy, eq] + obs + [seven, eos]
    model0 = [True] * 3 + [False] * len(obs) + [True] * 2
    T = len(want0)
    assert rollout.response_ids.shape == (2, T)
    assert rollout.response_ids[0].tolist() == want0
    assert rollout.response_ids[1].tolist() == [love, eos] + [tok.pad_token_id] * (T - 2)
    assert rollout.mask[0].tolist() == model0
    assert rollout.mask[1].tolist() == [True, True] + [False] * (T - 2)
    assert rollout.context[0].tolist() == [True] * T
    assert rollout.context[1].tolist() == [True, True] + [False] * (T - 2)
    rewards = torch.zeros(2, T)
    rewards[0, 2], rewards[0, T - 1] = 0.2, 1.1  # the call turn's end, the answer's end
    torch.testing.assert_close(rollout.turn_rewards, rewards)
    assert rollout.model_lens == [5, 2] and rollout.response_lens == [T, 2]
    assert rollout.ended.tolist() == [True, True]
    # the second turn's batch: episode 1 left it; its context is the prompt, turn 1, observation
    assert policy.contexts[1] == [prompt_ids[0] + [good, happy, eq] + obs]
    assert [t["reward"] for t in rollout.transcripts[0]] == [0.2, 1.1]
    assert rollout.transcripts[0][0]["observation"] == " 7"
    assert rollout.responses[0] == " good happy= 77"  # the whole episode as text
    assert (stats.turns, stats.observations, stats.generate_calls, stats.done) == (3, 1, 2, 2)
    assert stats.info == {"tool_call": [0.0, 1.0], "correct": [0.0, 1.0]}  # turn 1, turn 2
    assert stats.model_tokens == 7 and stats.observation_tokens == len(obs)
    assert generated.mask.tolist() == rollout.mask.tolist()


def test_observation_past_the_token_budget_ends_the_episode(tok, monkeypatch):
    cfg = _cfg("env.function=ds_ppo.envs.calculator:Calculator", "env.max_total_tokens=8",
               "env.stop=[\"=\"]")
    eos, good = tok.eos_token_id, _ids(tok, "good")[-1]
    eq = _ids(tok, "=")[-1]
    # 6 model tokens + the 2-token observation leave no room: the episode ends, truncated
    script = [[[good] * 5 + [eq]]]
    rollout, _, stats, _, policy = _episodes(tok, monkeypatch, cfg, ["what is 3 + 4 ?"], ["7"],
                                             script)
    assert rollout.mask[0].tolist() == [True] * 6 and stats.truncated == 1
    assert rollout.ended.tolist() == [False] and len(policy.contexts) == 1
    assert rollout.turn_rewards[0, 5] == 0.2  # the call's reward still counts


STEPPED = threading.Event()


def stepped(prompt, actions, answer):
    STEPPED.set()
    return Step(reward=float(len(actions)), done=True)


def test_an_episodes_step_starts_while_the_others_decode(tok, monkeypatch):
    """Episode 0's turn ends first: its environment step starts while the turn of episode 1 is
    still decoding (the scripted policy waits for it before handing episode 1's turn in; an
    environment stepped only after the whole turn would leave that wait to run out)."""
    cfg = _cfg("env.function=episode_envs:stepped", "env.max_turns=1")
    eos, good = tok.eos_token_id, _ids(tok, "good")[-1]
    waited = []
    real = ScriptedPolicy.__call__

    def waiting(self, *args, on_done=None, **kwargs):
        def hand_in(rows, tokens):
            if len(rows) == 1 and rows[0] == 1:  # the longer turn: after the first's step
                waited.append(STEPPED.wait(30))
            on_done(rows, tokens)
        return real(self, *args, on_done=hand_in, **kwargs)

    STEPPED.clear()
    monkeypatch.setattr(ScriptedPolicy, "__call__", waiting)
    rollout, _, stats, _, _ = _episodes(tok, monkeypatch, cfg, ["a", "b"], ["1", "2"],
                                        [[[good, eos]], [[good, good, good, eos]]])
    assert waited == [True] and stats.calls == 2
    assert rollout.turn_rewards.sum(1).tolist() == [1.0, 1.0]


def test_cut_at_stop_keeps_the_token_completing_the_string(tok):
    ctx = _ids(tok, "what is")
    toks = _ids(tok, " good </call> happy")
    cut = cut_at_stop(tok, ctx, toks, ["</call>"])
    assert tok.decode(cut).endswith("</call>") and len(cut) < len(toks)
    assert cut_at_stop(tok, ctx, toks, ["nothing"]) == toks
    assert evaluate("what is 3 + 4 ? 2 * 5") == 10 and evaluate("no numbers") is None


@pytest.mark.parametrize("turn, stop, kept", [
    (" i look at it", "look", " i look"),  # a whole word: cut after it
    (" she looks away", "look", " she looks away"),  # inside a longer word: no stop
    (" the outlook is good", "look", " the outlook is good"),  # the word's end, not its start
    (" we look", "look", " we look"),  # at the turn's end
    (" look=7", "look", " look"),  # followed by a non-word character
    (" look=7", "=", " look="),  # no word character at either end: matches anywhere
    (" looks at look=7", "look", " looks at look"),  # the first whole-word match
])
def test_a_stop_string_ending_in_a_word_character_stops_at_a_word_boundary(tok, turn, stop,
                                                                            kept):
    ctx = _ids(tok, "what is")
    cut = cut_at_stop(tok, ctx, _ids(tok, turn), [stop])
    assert tok.decode(cut) == kept.lstrip() and cut == _ids(tok, turn)[:len(cut)]


# ----------------------------------------------------------------- failing environments
def raises(prompt, actions, answer):
    raise ValueError("the tool crashed")


def hangs(prompt, actions, answer):
    time.sleep(30)


def bad_reward(prompt, actions, answer):
    return {"observation": "x", "reward": "1.0", "done": False}


class NoStep:
    def reset(self, prompt, answer):
        pass


@pytest.mark.parametrize("fn, expected", [
    ("raises", "env.function = 'episode_envs:raises' raised ValueError: the tool crashed at "),
    ("hangs", "env.function = 'episode_envs:hangs' did not return within env.timeout_s = 0.3 s "
              "(episode 0, turn 1)"),
    ("bad_reward", "env.function = 'episode_envs:bad_reward' returned the reward '1.0'"),
])
def test_a_failing_environment_stops_with_its_name(tok, monkeypatch, fn, expected):
    cfg = _cfg(f"env.function=episode_envs:{fn}", "env.timeout_s=0.3")
    eos = tok.eos_token_id
    t0 = time.perf_counter()
    with pytest.raises(EnvFailed) as err:
        _episodes(tok, monkeypatch, cfg, ["what is 3 + 4 ?"], ["7"], [[[eos]]])
    assert expected in str(err.value)
    assert isinstance(err.value, RewardTimeout)  # the trainer checkpoints and stops
    assert time.perf_counter() - t0 < 5


def test_sigterm_gives_a_hung_environment_step_up(tok, monkeypatch):
    """env.timeout_s = 600: the step is given up within a second of the request."""
    cfg = _cfg("env.function=episode_envs:hangs", "env.timeout_s=600")
    threading.Timer(0.3, abandon.request, args=(signal.SIGTERM,)).start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(abandon.Abandoned) as err:
            _episodes(tok, monkeypatch, cfg, ["what is 3 + 4 ?"], ["7"], [[[tok.eos_token_id]]])
    finally:
        abandon.clear()
    assert err.value.phase == "environment step" and time.perf_counter() - t0 < 5


def test_a_rank_stops_when_another_gave_its_environment_steps_up(tok, monkeypatch):
    """The turns' agreement (simulated: the all-reduce says a rank gave up): this rank, which
    got no signal, stops too instead of waiting in the next turn's collective."""
    cfg = _cfg("env.function=ds_ppo.envs.calculator:Calculator")
    monkeypatch.setattr(episodes_module, "_any_rank", lambda flag, device: 3)
    with pytest.raises(abandon.Abandoned) as err:
        _episodes(tok, monkeypatch, cfg, ["what is 3 + 4 ?"], ["7"], [[[tok.eos_token_id]]])
    assert (err.value.signum, err.value.phase) == (signal.SIGTERM, "environment step")


def test_environment_signatures_are_checked_up_front():
    with pytest.raises(ConfigError, match="has no method step"):
        EnvRunner(_cfg("env.function=episode_envs:NoStep").env, ["answer"])
    with pytest.raises(ConfigError, match="define it as def raises"):
        EnvRunner(_cfg("env.function=episode_envs:raises").env, ["answer", "other"])
    with pytest.raises(ConfigError, match="cannot import module"):
        EnvRunner(_cfg("env.function=no_such_module:Env").env, [])


# ------------------------------------------------------------------------ HTTP environment
class _CalculatorService(BaseHTTPRequestHandler):
    """A stateless calculator over HTTP: replays each episode's actions."""

    requests: list = []
    seen: dict = {}  # requests per first prompt

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _CalculatorService.requests.append((req, self.headers.get("Authorization")))
        first = req["prompts"][0]
        n = self.seen[first] = self.seen.get(first, 0) + 1
        if first == "boom":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"bad request: no such tool")
            return
        # "down": always a 500; "flaky ...": a 500 for the first two requests of the prompt
        if first == "down" or (first.startswith("flaky") and n <= 2):
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"the sandbox pool is empty")
            return
        if first == "slow":
            time.sleep(1.0)
        if first == "nan":
            body = json.dumps({"steps": [{"observation": None, "reward": float("nan"),
                                          "done": True}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        steps = []
        for prompt, actions, answer in zip(req["prompts"], req["actions"], req["answer"]):
            env = Calculator()
            env.reset(prompt, answer)
            for a in actions:
                s = env.step(a)
            steps.append({"observation": s.observation, "reward": s.reward, "done": s.done,
                          "info": s.info})
        body = json.dumps({"steps": steps}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CalculatorService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://alice:s3cret@127.0.0.1:{server.server_port}/step"
    server.shutdown()


def test_http_environment_on_a_local_server(service):
    cfg = _cfg(f"env.url={service}", "env.batch_size=2")
    runner = EnvRunner(cfg.env, ["answer"])
    eps = runner.start(["what is 3 + 4 ?", "what is 1 + 1 ?", "what is 2 - 2 ?"],
                       [{"answer": "7"}, {"answer": "2"}, {"answer": "0"}])
    steps = runner.step(eps, [0, 1, 2], [" =", " 2", " 5"], 0)
    assert steps[0] == Step(" 7", 0.2, False, {})
    assert steps[1] == Step(None, 1.1, True, {"tool_call": 0.0, "correct": 1.0})
    assert steps[2].reward == 0.1 and steps[2].done  # a number, the wrong one
    steps = runner.step(eps, [0], [" 7"], 1)  # the episode's history goes along
    assert steps[0].reward == 1.1
    sent = [r for r, _ in _CalculatorService.requests[-3:]]
    assert sorted(len(r["prompts"]) for r in sent[:2]) == [1, 2]  # env.batch_size, concurrent
    assert sent[-1]["actions"] == [[" =", " 7"]] and sent[-1]["responses"] == [" 7"]
    assert all(auth.startswith("Basic ") for _, auth in _CalculatorService.requests)
    with pytest.raises(EnvFailed) as err:
        runner.step(runner.start(["boom"], [{"answer": "1"}]), [0], ["x"], 0)
    text = str(err.value)
    assert "env.url = http://***@127.0.0.1" in text and "s3cret" not in text
    assert "HTTP 400" in text and "no such tool" in text


# ------------------------------------------------------------------ forwards with holes
def _holey_rollout():
    """Two episodes: [turn | observation | turn] and a one-turn one, left-padded prompts."""
    prompts, responses = [[5, 6, 7], [9, 3]], [[8, 9, 30, 31, 32, 10, 11], [12, 13]]
    model = [[1, 1, 0, 0, 0, 1, 1], [1, 1]]
    P, T = 3, 7
    ids = torch.zeros(2, P + T, dtype=torch.long)
    pm, mask, ctx = (torch.zeros(2, n, dtype=torch.bool) for n in (P, T, T))
    for b, (p, r, m) in enumerate(zip(prompts, responses, model)):
        ids[b, P - len(p):P] = torch.tensor(p)
        pm[b, P - len(p):] = True
        ids[b, P:P + len(r)] = torch.tensor(r)
        mask[b, :len(m)] = torch.tensor(m, dtype=torch.bool)
        ctx[b, :len(r)] = True
    return Rollout(prompt_ids=ids[:, :P], prompt_mask=pm, response_ids=ids[:, P:], mask=mask,
                   ended=torch.ones(2, dtype=torch.bool), prompts=["", ""], responses=["", ""],
                   prompt_lens=[3, 2], response_lens=[7, 2], extras=[{}, {}],
                   context_mask=ctx, model_lens=[4, 2]), prompts, responses


@pytest.mark.parametrize("packed", [False, True])
def test_forwards_read_the_observations_and_count_model_tokens_only(packed):
    model = small_llama()
    rollout, prompts, responses = _holey_rollout()
    with torch.no_grad():
        lp, _ = response_logprobs(model, rollout, 1.0, packed=packed)
        for b, (pr, rs) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([pr + rs])).logits[0, len(pr) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rs)[:, None])[:, 0]
            keep = rollout.mask[b, :len(rs)]
            torch.testing.assert_close(lp[b, :len(rs)][keep], ref[keep], atol=1e-5, rtol=1e-5)
        if packed:  # only the model tokens' log-probs are computed
            assert (lp[~rollout.mask] == 0).all()
        model.lm_head = torch.nn.Linear(16, 1)
        values = response_values(model, rollout, packed=packed)
        full = model(torch.tensor([prompts[0] + responses[0]])).logits[0, 2:-1, 0]
        keep = rollout.mask[0]
        torch.testing.assert_close(values[0][keep], full[keep], atol=1e-5, rtol=1e-5)


def test_chat_observations_use_the_chat_template_and_transcripts_show_each_turn(tok):
    """A chat prompt's observation is a message in the policy's chat template, closing the
    model's turn (EOS first if it ended otherwise) and opening the next one."""
    from ds_ppo.ppo.episodes import format_transcript, observation_tokens

    ids = observation_tokens(tok, Step("the result is 7"), True, "tool", turn_ended=True)
    assert tok.decode(ids) == "tool: the result is 7\nassistant:"  # the tiny template's form
    as_message = observation_tokens(tok, Step({"role": "user", "content": "7"}), True, "tool",
                                    turn_ended=False)
    assert as_message[0] == tok.eos_token_id and tok.decode(as_message[1:]).startswith("user: 7")
    assert observation_tokens(tok, Step(" 7"), False, "tool", True) == _ids(tok, " 7")
    text = format_transcript([{"turn": 1, "model": " good =", "reward": 0.2, "observation": " 7"},
                              {"turn": 2, "model": "7", "reward": 1.1, "observation": ""}])
    assert text == "[turn 1, reward +0.2]  good =\n[observation]  7\n[turn 2, reward +1.1] 7"


def test_a_rank_whose_episodes_ended_keeps_generating_for_an_idle_row(tok, monkeypatch):
    """While another rank has live episodes (simulated: the all-reduce says so), a rank whose
    episodes have all ended still makes each generate call, for one idle row whose output is
    dropped: ZeRO-3 and tensor-parallel generation are collective."""
    cfg = _cfg("env.function=ds_ppo.envs.calculator:Calculator", "env.max_turns=3")
    eos, love = tok.eos_token_id, _ids(tok, "love")[-1]
    script = [[[love, eos], [love, love], [love, love]]]
    alone = _episodes(tok, monkeypatch, cfg, ["what is 2 + 2 ?"], ["4"], script)
    monkeypatch.setattr(episodes_module, "_any_rank",
                        lambda flag, device: 2 if flag == 2 else 1)
    idle = _episodes(tok, monkeypatch, cfg, ["what is 2 + 2 ?"], ["4"], script)
    assert alone[2].generate_calls == 1 and idle[2].generate_calls == 3
    assert len(idle[4].contexts) == 3 and all(len(c) == 1 for c in idle[4].contexts)
    for a, b in zip(alone[0].__dict__.items(), idle[0].__dict__.items()):
        assert a[0] == b[0]
        assert torch.equal(a[1], b[1]) if isinstance(a[1], torch.Tensor) else a[1] == b[1], a[0]


# ----------------------------------------------- failure messages and retries of env.url
def key_error(prompt, actions, answer):
    return {"x": 1}["observation"]


def _failure(service: str, *overrides: str, prompt: str = "what is 3 + 4 ?") -> EnvFailed:
    """The EnvFailed of one step of `prompt` against env.url = `service` (or an env.function
    when an override sets one), retries 1 s apart shortened to 0.05 s."""
    over = overrides if any(o.startswith("env.function") for o in overrides) else (
        f"env.url={service}", *overrides)
    runner = EnvRunner(_cfg(*over).env, ["answer"])
    if runner.kind == "url":
        runner.impl.backoff_s = 0.05
    t0 = time.perf_counter()
    with pytest.raises(EnvFailed) as err:
        runner.step(runner.start([prompt], [{"answer": "7"}]), [0], [" ="], 0)
    assert time.perf_counter() - t0 < 5
    return err.value


@pytest.mark.parametrize("case, says, hung", [
    ("down", "HTTP 500: 'the sandbox pool is empty'; check the service's log, or raise "
             "env.retries", False),
    ("nan", "returned the reward nan; it must be a finite number", False),
    ("key_error", "raised KeyError: 'observation'", False),
    ("hangs", "did not return within env.timeout_s = 0.3 s", True),
    ("slow", "last: no answer within env.timeout_s = 0.3 s; check that the service answers "
             "within env.timeout_s, or raise env.timeout_s / env.retries", False),
])
def test_an_environments_failure_message_fits_its_cause(service, case, says, hung):
    """Each stop says what failed, the advice for that cause (env.timeout_s only after a
    timeout) and, once, how to go on: resume from the checkpoint, or start over when none was
    saved."""
    from ds_ppo.run.saves import stop_message

    python = {"key_error": "env.function=episode_envs:key_error",
              "hangs": "env.function=episode_envs:hangs"}
    overrides = [python[case]] if case in python else []
    err = _failure(service, *overrides, "env.timeout_s=0.3", "env.retries=1", prompt=case)
    assert says in str(err)
    resumed = stop_message(err, "out/checkpoints/iter_000002")
    fresh = stop_message(err, None)
    assert resumed.startswith(str(err))
    hint = "Find what makes the environment hang, or raise env.timeout_s" if hung else \
        "Fix the environment"
    assert resumed.endswith(f"stopped (the last completed iteration's checkpoint is "
                            f"out/checkpoints/iter_000002). {hint}, then run the same command "
                            "again to resume from it.")
    assert fresh.endswith(f"stopped (no checkpoint was saved). {hint}, then run the same "
                          "command: the run starts over.")
    for text in (resumed, fresh):
        assert text.count("run the same command") == 1
        assert ("timeout_s" in text) == (case in ("hangs", "slow"))
    assert "resume" not in fresh


def test_a_failure_before_any_checkpoint_says_the_run_starts_over(service, tmp_path):
    """Iteration 1 fails: nothing is saved (no engines are touched) and the message says so."""
    from ds_ppo.engine.checkpoint import TrainerState
    from ds_ppo.run.saves import stop_on_reward_error

    err = _failure(service, "env.retries=0", prompt="down")
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    stop = stop_on_reward_error(err, cfg, tmp_path, None, TrainerState(iteration=0), None, None)
    assert isinstance(stop, EnvFailed) and not (tmp_path / "checkpoints").exists()
    assert str(stop).endswith("stopped (no checkpoint was saved). Fix the environment, then run "
                              "the same command: the run starts over.")


def test_env_url_retries_are_logged_as_they_happen_and_counted(service, tok, monkeypatch,
                                                               caplog):
    """A service that fails twice then answers: two warning lines (what failed, attempt k of
    n, the wait), the episode goes on, and the rollout counts 2 retries (metric env/retries)."""
    from ds_ppo.metrics import Accumulator
    from ds_ppo.ppo.episodes import add_episode_metrics
    from ds_ppo.rewards import service as service_module

    monkeypatch.setattr(service_module, "backoff_pause", lambda attempt, backoff_s: 0.1 * attempt)
    cfg = _cfg(f"env.url={service}", "env.retries=3")
    eos, seven = tok.eos_token_id, _ids(tok, "7")[-1]
    with caplog.at_level("WARNING", logger="ds_ppo"):
        rollout, _, stats, _, _ = _episodes(tok, monkeypatch, cfg, ["flaky: what is 3 + 4 ?"],
                                            ["7"], [[[seven, eos]]])
    lines = [r.getMessage() for r in caplog.records if "env.url" in r.getMessage()]
    host = service.split("@")[1]
    assert lines == [f"env.url = http://***@{host}: HTTP 500: 'the sandbox pool is empty' "
                     f"(attempt {k} of 4); next attempt in {0.1 * k:.1f} s" for k in (1, 2)]
    assert rollout.turn_rewards.sum().item() > 0 and stats.retries == 2
    acc = Accumulator()
    add_episode_metrics(acc, stats)
    assert acc.reduce()["env/retries"] == 2.0
    python = _episodes(tok, monkeypatch, _cfg("env.function=ds_ppo.envs.calculator:Calculator"),
                       ["what is 3 + 4 ?"], ["7"], [[[seven, eos]]])[2]
    assert python.retries is None  # no env/retries for a Python environment
