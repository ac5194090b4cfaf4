"""Multi-turn rollouts: each response is an episode of model turns and environment observations.

    prompt | turn 1 | observation 1 | turn 2 | observation 2 | ... | turn k

Every turn, all live episodes of the rank generate their next turn in one batch through
`generate()` (the same call as a single-turn rollout: the context so far is the prompt,
re-prefilled, so no KV cache outlives a call; docs/ENVIRONMENTS.md measures what that costs).
A turn ends at EOS, a generation.stop_tokens token, one of env.stop's strings (cut after it) or
generation.max_new_tokens. The environment steps each live episode as soon as the decoding loop
hands its turn in, together with the others found ended at the same check (`TurnSteps`,
ds_ppo.envs.runner), while the rest still decode. An episode ends when it says done, after
env.max_turns turns, or when its next turn would pass env.max_total_tokens (counted:
env/truncated_frac). Ended episodes leave the batch. Observations are appended as plain text for plain prompts, with the policy's chat
template for chat prompts.

The `Rollout` holds the whole episode as the response: `mask` True on the model's tokens only
(observations are holes), `context_mask` True on every response token (model and observation),
`turn_rewards` the environment's reward of each turn at that turn's last model token.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ds_ppo import abandon
from ds_ppo.algo.masks import counted_tokens
from ds_ppo.config import Config, GenerationConfig
from ds_ppo.containers import Rollout
from ds_ppo.data.prompts import PromptSet, left_pad
from ds_ppo.engine import dist
from ds_ppo.engine.generation import Generated, decode_on_replica, generate
from ds_ppo.envs.base import EnvFailed, Step
from ds_ppo.rewards.encode import decode_responses
from ds_ppo.thread_pools import shared_pool


@dataclass(frozen=True)
class EpisodeSettings:
    """What playing multi-turn episodes reads from the config."""

    samples_per_prompt: int  # ppo.samples_per_prompt: episodes of each prompt
    generation: GenerationConfig  # the generation section: each turn's generate() call
    stop: tuple[str, ...]  # env.stop: strings that end a model turn (cut after them)
    max_turns: int  # env.max_turns: model turns per episode at most
    max_total_tokens: int  # env.max_total_tokens: an episode's response tokens at most
    observation_role: str  # env.observation_role: a chat prompt's observation message role


def episode_settings(cfg: Config) -> EpisodeSettings:
    """`make_episodes`' settings from the config."""
    e = cfg.env
    return EpisodeSettings(cfg.ppo.samples_per_prompt, cfg.generation, tuple(e.stop),
                           e.max_turns, e.max_total_tokens, e.observation_role)


@dataclass
class EpisodeStats:
    """This rank's episode statistics of one rollout (metrics `env/*`)."""

    episodes: int = 0
    turns: int = 0  # model turns, all episodes
    observations: int = 0  # turns answered with a non-empty observation
    done: int = 0  # episodes the environment ended
    truncated: int = 0  # episodes ended by env.max_total_tokens
    out_of_turns: int = 0  # episodes ended by env.max_turns
    model_tokens: int = 0
    observation_tokens: int = 0
    calls: int = 0  # environment calls (resets and steps)
    env_s: float = 0.0  # seconds in environment calls
    generate_calls: int = 0
    retries: int | None = None  # env.url: requests retried (None: a Python environment)
    info: dict[str, list[float]] = field(default_factory=dict)  # Step.info values


def stop_patterns(stops: list[str]) -> list[re.Pattern]:
    """The env.stop strings as patterns. A string that begins or ends with a word character
    (letter, digit, _) matches only as a whole word there: "look" ends a turn at "look at" or at
    the turn's end, not inside "looks" or "outlook"; "</call>" anywhere."""
    return [re.compile((r"(?<!\w)" if re.match(r"\w", s) else "") + re.escape(s) +
                       (r"(?!\w)" if re.search(r"\w$", s) else "")) for s in stops]


def cut_at_stop(tokenizer, context: list[int], tokens: list[int], stops: list[str]) -> list[int]:
    """`tokens` up to and including the token that completes the first of the `stops` strings
    (`stop_patterns`: whole words where they begin or end with a word character) in their
    decoded text (all of them when none occurs). `context`: the tokens before, so a
    SentencePiece first word keeps its space."""
    if not stops:
        return tokens

    def text(k: int) -> str:
        return decode_responses(tokenizer, [context], [tokens[:k]])[1][0]

    whole = text(len(tokens))  # the whole turn: the character after a word decides its end
    ends = [m.end() for p in stop_patterns(stops) if (m := p.search(whole))]
    if not ends:
        return tokens
    upto = whole[:min(ends)]
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds the first match
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if text(mid).startswith(upto) else (mid + 1, hi)
    return tokens[:lo]


def observation_tokens(tokenizer, step: Step, chat: bool, role: str, turn_ended: bool
                       ) -> list[int]:
    """The observation of `step` as tokens: plain text as it is (no special tokens); for a
    chat prompt, the observation as a message (`role`, unless it is one already) in the chat
    template, closing the model's turn and opening the next (add_generation_prompt). A turn
    that did not end with EOS (a stop string, max_new_tokens) gets EOS first."""
    if not chat:
        return tokenizer(step.text, add_special_tokens=False).input_ids if step.text else []
    message = step.observation if isinstance(step.observation, dict) else {
        "role": role, "content": step.text}
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + [message], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise EnvFailed(f"the chat template renders an observation message {message['role']!r} "
                        "by changing the turns before it; set env.observation_role to a role "
                        "the template appends (user, tool)")
    ids = tokenizer(after[len(before):], add_special_tokens=False).input_ids
    return ids if turn_ended else [tokenizer.eos_token_id] + ids


def _any_rank(flag: int, device) -> int:
    """The largest `flag` over the ranks (one all-reduce)."""
    return int(dist.all_reduce_max(torch.tensor([float(flag)], dtype=torch.float64,
                                                device=device)))


def _code(error: EnvFailed | abandon.Abandoned) -> int:
    """A rank's outcome in the episodes' agreement (`_any_rank`): 3 its environment calls were
    given up on SIGTERM, 2 one failed (1: episodes live, 0: all ended)."""
    return 3 if isinstance(error, abandon.Abandoned) else 2


def _failure(error: EnvFailed | None) -> EnvFailed:
    """Collective, once the ranks agreed that one failed: this rank's error, or on a rank that
    did not fail the failing rank's message, naming it (the same stop on every rank)."""
    rank, message, fix = dist.first_failure(error)
    if error is not None:
        return error
    out = EnvFailed(f"on rank {rank}: {message}")
    if fix is not None:
        out.fix = fix
    return out


def _action(tokenizer, s: EpisodeSettings, context: list[int], used: int, toks: list[int]
            ) -> tuple[list[int], bool, str]:
    """A model turn's tokens as the episode keeps them (cut after the first env.stop string,
    and to the env.max_total_tokens left after the `used` response tokens), whether that budget
    cut it, and its text (the action the environment gets)."""
    toks = cut_at_stop(tokenizer, context, toks, list(s.stop))
    room = s.max_total_tokens - used
    cut = len(toks) > room  # the turn would pass the episode's budget: it ends here
    if cut:
        toks = toks[:room]
    return toks, cut, decode_responses(tokenizer, [context], [toks])[1][0]


class TurnSteps:
    """The environment steps of one turn: the episodes whose turns the decoding loop finds
    ended at one check are stepped together as soon as it hands them in (`on_done`, each action
    computed as the turn's end computes it), while the other episodes still decode; `steps`
    takes the Steps in episode order and steps the episodes not started yet. At most
    env.concurrency such calls run at once (each runs its episodes as `EnvRunner.step` does).
    Each episode's step reads only its own episode, so the steps are those of one call over all
    of them."""

    def __init__(self, env, episodes, turn: int, live: list[int], eos_ids: list[int],
                 action_of) -> None:
        self.env, self.episodes, self.turn, self.live = env, episodes, turn, live
        self.eos, self.action_of = set(eos_ids), action_of
        # episode -> (action, the call stepping it, its place in that call)
        self.started: dict[int, tuple[str, Future, int]] = {}
        self.pool = shared_pool("env-step", env.cfg.concurrency)

    def on_done(self, rows: list[int], tokens: list[list[int]]) -> None:
        """The decoding loop's hand-in: rows (indices into `live`) whose turn has ended."""
        ids, actions = [], []
        for k, toks in zip(rows, tokens):
            i = self.live[k]
            ids.append(i)
            actions.append(self.action_of(i, counted_tokens(toks, self.eos)))
        call = self.pool.submit(self.env.step, self.episodes, ids, actions, self.turn)
        self.started.update((i, (a, call, n)) for n, (i, a) in enumerate(zip(ids, actions)))

    def steps(self, actions: list[str]) -> list[Step]:
        """The Step of every live episode for its `actions` (in `live` order); an EnvFailed of
        the first failing episode, in that order, as one call over them all raises."""
        for i, a in zip(self.live, actions):
            if i in self.started and self.started[i][0] != a:
                raise EnvFailed(f"episode {i}, turn {self.turn + 1} was decoded again after "
                                "its environment step started (out of device memory mid-"
                                "turn): lower generation.batch_size")
        rest = [(i, a) for i, a in zip(self.live, actions) if i not in self.started]
        got: dict[int, Step] = {}
        errors: dict[int, EnvFailed] = {}
        if rest:
            ids = [i for i, _ in rest]
            try:
                got.update(zip(ids, self.env.step(self.episodes, ids, [a for _, a in rest],
                                                  self.turn)))
            except EnvFailed as e:
                errors[min(ids)] = e
        for i, (_, call, n) in self.started.items():
            try:
                got[i] = call.result()[n]
            except EnvFailed as e:
                errors[i] = e
        if errors:
            raise errors[min(errors)]
        return [got[i] for i in self.live]


def _generate_turn(contexts: list[list[int]], engines, gen_cfg: GenerationConfig, mode: str,
                   eos_ids: list[int], pad_id: int, on_replica=None, on_done=None
                   ) -> tuple[list[list[int]], list[list[float]] | None, Generated]:
    """One generate() call over the contexts (left-padded): each row's counted tokens and
    their sampler log-probs (None with HF generate). `on_replica`: (replica, random stream) to
    decode on instead (`decode_on_replica`: no collective). `on_done`: the decoding loop's
    hand-in of finished rows (`TurnSteps.on_done`)."""
    ids, am = left_pad(contexts, pad_id)
    ids, am = ids.to(engines.device), am.to(engines.device).bool()
    if on_replica is not None:
        replica, generator = on_replica
        gen = decode_on_replica(replica, ids, am, gen_cfg, eos_ids, pad_id, generator, on_done)
    else:
        gen = generate(engines.policy, ids, am, gen_cfg, mode, eos_ids, pad_id,
                       engines.dtype, kept_replica=engines.replica, on_done=on_done)
        engines.replica = gen.replica
    counted = [[t for t, m in zip(row, keep) if m]
               for row, keep in zip(gen.response_ids.tolist(), gen.mask.tolist())]
    logprobs = None
    if gen.logprobs is not None:  # the counted tokens are each row's first ones
        logprobs = [row[:len(toks)] for row, toks in zip(gen.logprobs.tolist(), counted)]
    return counted, logprobs, gen


def make_episodes(prompts: PromptSet, indices: list[int], engines, s: EpisodeSettings,
                  tokenizer, mode: str, eos_ids: list[int], env, on_replica=None
                  ) -> tuple[Rollout, Generated, EpisodeStats]:
    """Episodes for the prompts at `indices` (this rank's shard; ppo.samples_per_prompt each,
    next to each other, as `make_rollout`), with `env` (an EnvRunner). Collective: every rank
    makes the same number of generate calls (a rank whose episodes have all ended generates
    for one idle row, dropped), and an environment failure on any rank stops all ranks.

    `on_replica`: (replica, random stream) of ppo.schedule's background worker. The turns then
    decode on that replica and nothing is collective: a rank stops when its own episodes have
    ended, and a failure is raised here as this rank's EnvFailed, which the training thread
    agrees on across ranks when the rollout is taken (`agree_on_episodes`)."""
    local = on_replica is not None
    n = s.samples_per_prompt
    indices = [i for i in indices for _ in range(n)]
    prompt_ids = [list(prompts.input_ids[i]) for i in indices]
    chat = prompts.messages is not None
    texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids]
    extras = [prompts.extra(i) for i in indices]
    stats = EpisodeStats(episodes=len(indices))
    B, pad = len(indices), tokenizer.pad_token_id
    response: list[list[int]] = [[] for _ in range(B)]
    model: list[list[bool]] = [[] for _ in range(B)]
    sampled: list[list[float]] | None = [[] for _ in range(B)]  # the sampler's log-probs
    starts: list[list[int]] = [[] for _ in range(B)]  # each model turn's first position
    rewards: list[list[tuple[int, float]]] = [[] for _ in range(B)]  # (position, reward)
    transcripts: list[list[dict]] = [[] for _ in range(B)]
    done, truncated = [False] * B, [False] * B
    error, episodes = None, None
    retries_before = env.retries
    try:
        t0 = time.perf_counter()
        episodes = env.start(texts, extras)
        stats.env_s += time.perf_counter() - t0
    except (EnvFailed, abandon.Abandoned) as err:  # agreed on below, like a failure
        error = err
    live = list(range(B)) if error is None else []
    device = engines.device
    gens = []
    for turn in range(s.max_turns):
        code = _code(error) if error is not None else 1 if live else 0
        worst = code if local else _any_rank(code, device)
        if worst == 3:  # a rank gave its environment calls up on SIGTERM: every rank stops
            raise error if isinstance(error, abandon.Abandoned) else abandon.elsewhere(
                "environment step")
        if worst == 2:
            raise error if local else _failure(error)
        if worst == 0:
            break
        rows = live or [0]  # a rank with no live episode still takes part in the call
        # each episode's environment step starts as the decoding loop finishes its turn
        stepping = TurnSteps(env, episodes, turn, live, eos_ids, lambda i, toks: _action(
            tokenizer, s, prompt_ids[i] + response[i], len(response[i]), toks)[2])
        counted, turn_lp, gen = _generate_turn([prompt_ids[i] + response[i] for i in rows],
                                               engines, s.generation, mode, eos_ids, pad,
                                               on_replica, stepping.on_done if live else None)
        if turn_lp is None:
            sampled = None
        gens.append(gen)
        stats.generate_calls += 1
        if not live:
            continue
        actions = []
        for k, (toks, i) in enumerate(zip(counted, live)):
            toks, cut, action = _action(tokenizer, s, prompt_ids[i] + response[i],
                                        len(response[i]), toks)
            truncated[i] = truncated[i] or cut
            actions.append(action)
            if toks:
                starts[i].append(len(response[i]))
            if sampled is not None:  # a cut turn keeps its first tokens' log-probs
                sampled[i] += turn_lp[k][:len(toks)]
            response[i] += toks
            model[i] += [True] * len(toks)
            stats.turns += 1
        try:
            t0 = time.perf_counter()
            steps = stepping.steps(actions)
            stats.env_s += time.perf_counter() - t0
            stats.calls += len(live)
        except (EnvFailed, abandon.Abandoned) as err:
            error, live = err, []
            continue
        live = _append_observations(live, steps, actions, turn, response, model, rewards,
                                    transcripts, done, truncated, tokenizer, chat, eos_ids,
                                    s, stats)
        if sampled is not None:  # observations: 0, as every position outside the mask
            for i in range(B):
                sampled[i] += [0.0] * (len(response[i]) - len(sampled[i]))
    if local and error is not None:
        raise error
    worst = 0 if local else _any_rank(_code(error) if error is not None else 0, device)
    if worst == 3:  # every rank calls it
        raise error if isinstance(error, abandon.Abandoned) else abandon.elsewhere(
            "environment step")
    if worst == 2:
        raise _failure(error)
    if retries_before is not None:
        stats.retries = env.retries - retries_before
    stats.out_of_turns = sum(1 for i in range(B) if not done[i] and not truncated[i])
    rollout = _episode_rollout(prompt_ids, texts, extras, response, model, rewards,
                               transcripts, done, tokenizer, device, prompts, indices)
    rollout.turn_starts = _turn_starts(starts, rollout.mask.shape, device)
    rollout.sampling = gens[-1].sampling if gens else None
    if sampled is not None and gens:
        rollout.rollout_logprobs = _pad_rows(sampled, rollout.mask.shape[1], device)
    stats.model_tokens = sum(rollout.model_lens)
    stats.observation_tokens = sum(rollout.response_lens) - stats.model_tokens
    last = gens[-1]
    generated = Generated(response_ids=rollout.response_ids, mask=rollout.mask,
                          ended=rollout.ended, replica=None if local else engines.replica,
                          loop=last.loop,
                          decode_stats=[st for g in gens for st in g.decode_stats],
                          logprobs=rollout.rollout_logprobs, sampling=rollout.sampling)
    return rollout, generated, stats


def agree_on_episodes(error: EnvFailed | None, device) -> None:
    """Collective: the ranks agree on the outcome of episodes played without collectives
    (`make_episodes` with `on_replica`); a failure on any rank stops every rank alike."""
    if _any_rank(2 if error is not None else 0, device) == 2:
        raise _failure(error)


def _turn_starts(starts: list[list[int]], shape, device) -> torch.Tensor:
    """(B, T) bool, True at each model turn's first position (`Rollout.turn_starts`)."""
    out = torch.zeros(shape, dtype=torch.bool)
    for i, row in enumerate(starts):
        out[i, row] = True
    return out.to(device)


def _pad_rows(rows: list[list[float]], T: int, device) -> torch.Tensor:
    """(B, T) float32 of the rows' values, 0 after each row's end."""
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def _append_observations(live, steps, actions, turn, response, model, rewards, transcripts,
                         done, truncated, tokenizer, chat, eos_ids, s: EpisodeSettings,
                         stats) -> list[int]:
    """Record each live episode's turn (reward at its last model token, transcript), append
    the observations of those that go on; the episodes still live."""
    still = []
    for i, step, action in zip(live, steps, actions):
        if model[i]:
            rewards[i].append((len(response[i]) - 1, step.reward))
        transcripts[i].append({"turn": turn + 1, "model": action, "reward": step.reward,
                               "observation": step.text})
        for k, v in step.info.items():
            stats.info.setdefault(k, []).append(float(v))
        if step.text:
            stats.observations += 1
        if step.done:
            done[i] = True
        if step.done or truncated[i] or turn == s.max_turns - 1:
            continue
        ended = bool(model[i]) and response[i][-1] in eos_ids
        obs = observation_tokens(tokenizer, step, chat, s.observation_role, ended)
        if len(response[i]) + len(obs) >= s.max_total_tokens:  # no room for another turn
            truncated[i] = True
            continue
        response[i] += obs
        model[i] += [False] * len(obs)
        still.append(i)
    stats.truncated = sum(truncated)
    stats.done = sum(done)
    return still


def _episode_rollout(prompt_ids, texts, extras, response, model, rewards, transcripts, done,
                     tokenizer, device, prompts: PromptSet, indices) -> Rollout:
    """The episodes as a Rollout (T = the longest episode's response tokens)."""
    B, pad = len(response), tokenizer.pad_token_id
    T = max([len(r) for r in response] + [1])
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    context = torch.zeros(B, T, dtype=torch.bool)
    turn_rewards = torch.zeros(B, T, dtype=torch.float32)
    for i, (r, m) in enumerate(zip(response, model)):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
        context[i, :len(r)] = True
        for pos, reward in rewards[i]:
            turn_rewards[i, pos] += reward
    p_ids, p_mask = left_pad(prompt_ids, pad)
    _, whole = decode_responses(tokenizer, prompt_ids, response)
    return Rollout(prompt_ids=p_ids.to(device), prompt_mask=p_mask.to(device).bool(),
                   response_ids=ids.to(device), mask=mask.to(device),
                   ended=torch.tensor(done, dtype=torch.bool, device=device),
                   prompts=texts, responses=whole, prompt_lens=[len(p) for p in prompt_ids],
                   response_lens=[len(r) for r in response],
                   extras=extras,
                   messages=([prompts.chat(i) for i in indices]
                             if prompts.messages is not None else None),
                   context_mask=context.to(device), model_lens=[sum(m) for m in model],
                   turn_rewards=turn_rewards.to(device), transcripts=transcripts)


def add_episode_metrics(acc, stats: EpisodeStats) -> None:
    """This rank's episode statistics into `acc` (means over every rank's episodes; the
    environment's own Step.info numbers as env/<key>, the mean over the steps giving them)."""
    n = float(stats.episodes)
    acc.add_mean("env/turns_mean", stats.turns, n)
    acc.add_mean("env/observations_mean", stats.observations, n)
    acc.add_mean("env/done_frac", stats.done, n)
    acc.add_mean("env/truncated_frac", stats.truncated, n)
    acc.add_mean("env/out_of_turns_frac", stats.out_of_turns, n)
    acc.add_mean("env/model_tokens_mean", stats.model_tokens, n)
    acc.add_mean("env/observation_tokens_mean", stats.observation_tokens, n)
    acc.add_sum("env/calls", stats.calls)
    acc.add_max("time/env_s", stats.env_s)
    acc.add_max("env/generate_calls", stats.generate_calls)
    if stats.retries is not None:  # env.url (on every rank alike: the config is one)
        acc.add_sum("env/retries", stats.retries)
    # every rank reports the same keys (a collective reduce): the union of the ranks' keys
    keys = sorted(set().union(*dist.gather_objects(sorted(stats.info))))
    for k in keys:
        values = stats.info.get(k, [])
        acc.add_mean(f"env/{k}", sum(values), len(values))


def format_transcript(turns: list[dict]) -> str:
    """An episode's turns as text for the samples table: each model turn with its reward,
    then the observation."""
    lines = []
    for t in turns:
        lines.append(f"[turn {t['turn']}, reward {t['reward']:+g}] {t['model']}")
        if t["observation"]:
            lines.append(f"[observation] {t['observation']}")
    return "\n".join(lines)
