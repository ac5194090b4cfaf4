"""`ds-ppo train` as a job of the run driver (run/driver.py): its data (prompts, the evaluation
split, the reward model's tokenizer, PPO-ptx rows), its engines (policy, value, reference,
reward), and one iteration: steps 1-4 of `ppo/iteration.py` (generate, score, KL-shaped rewards
and advantages, PPO update), then the iteration's metrics, the evaluation when due, the KL
controller's update, the entropy bonus's
coefficient (ppo.entropy_target) and the report.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from ds_ppo import watchdog
from ds_ppo.algo import AdaptiveKLController, EntropyController, FixedKLController
from ds_ppo.config import Config
from ds_ppo.engine import dist, lora
from ds_ppo.engine.checkpoint import TrainerState
from ds_ppo.engine.generation import choose_loop, choose_mode
from ds_ppo.engine.roles import Engines, init_engines
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.dynamic import PromptDraw
from ds_ppo.ppo.evaluate import eval_settings, evaluate, greedy_config
from ds_ppo.ppo.in_flight import in_flight_problem
from ds_ppo.ppo.iteration import IterationInputs, metric_timer, run_iteration
from ds_ppo.ppo.resume_check import check_estimator_family
from ds_ppo.ppo.rollout import make_rollout, rollout_settings, stop_token_ids
from ds_ppo.ppo.scoring import reward_scores, reward_settings
from ds_ppo.plan.fit import zero_stages
from ds_ppo.ppo.update import entropy_floor
from ds_ppo.rewards.encode import reward_encoder
from ds_ppo.rewards.source import reward_function
from ds_ppo.role_names import TRAINED_ROLES

log = logging.getLogger("ds_ppo")

# Metrics that are never NaN or infinite while training is healthy. With bf16 or fp32, DeepSpeed
# applies a non-finite gradient, so one is enough to ruin the weights; stopping before the next
# checkpoint keeps the saved ones usable. fp16's loss scaler skips such steps and reports their
# gradient norm as inf, routinely in the first steps: there only the losses are checked.
LOSSES = ("loss/policy", "loss/value")
GRAD_NORMS = ("policy/grad_norm", "value/grad_norm")


def ppo_engines(cfg: Config, tokenizer, device: torch.device, load_universal: bool = False,
                reward_shares_tokenizer: bool = True,
                autoep: frozenset[str] = frozenset()) -> Engines:
    """The PPO job's engines: each role's ZeRO stage chosen by fit (plan/fit.py, as `ds-ppo
    plan`) and the reward callable the config names (rewards/source.py), handed to the engine
    builder (engine/roles.py's init_engines)."""
    return init_engines(cfg, tokenizer, device, zero_stages(cfg, device, load_universal),
                        reward_function(cfg, dist.world_size()), load_universal=load_universal,
                        reward_shares_tokenizer=reward_shares_tokenizer, autoep=autoep)


class PPOJob:
    """One PPO iteration per unit (run/driver.py's `Job`)."""

    name, unit, total_key = "ppo", "iteration", "iterations"
    model_class = "AutoModelForCausalLM"
    registers = True
    model_keys = ("policy.path", "value.path", "reference.path", "reward.model")
    watched = LOSSES + GRAD_NORMS
    diverged_fix = ("Resume from a checkpoint with a lower learning rate (policy.lr, value.lr), "
                    "gradient clipping (max_grad_norm) or a smaller ppo.clip_eps.")

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._saved_flight = None  # a checkpoint's in-flight work (ppo.schedule)
        p = cfg.ppo
        self.kl_ctl = (AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon)
                       if p.kl_controller == "adaptive" else FixedKLController(p.kl_coef))
        # with entropy_target_scope=token the target is a per-token floor in the update's bonus
        # (update.entropy_floor) and the coefficient stays at entropy_coef
        self.entropy_ctl = EntropyController(
            p.entropy_coef, p.entropy_target if entropy_floor(p) is None else None)

    # ------------------------------------------------------------------- start-up
    def known_total(self, cfg: Config) -> int:
        return cfg.iterations

    def load_data(self, cfg: Config, out: Path):
        from ds_ppo.data.prompts import load_prompts
        from ds_ppo.data.tokenizer import load_policy_tokenizer, load_tokenizer

        tokenizer = load_policy_tokenizer(cfg, out)
        self.prompts = load_prompts(cfg.data, tokenizer)
        self.eval_prompts = None
        if cfg.data.eval_split is not None and cfg.data.eval_every > 0:
            self.eval_prompts = load_prompts(cfg.data, tokenizer, split=cfg.data.eval_split)
        self.reward_encode = None
        if cfg.reward.model is not None:
            self.reward_encode = reward_encoder(cfg, tokenizer, load_tokenizer(
                cfg.reward.tokenizer or cfg.reward.model, out))
        self.ptx_rows = None
        if cfg.ppo.ptx_coef > 0:  # PPO-ptx rows (data.ptx_path)
            from ds_ppo.data.ptx import load_ptx

            self.ptx_rows = load_ptx(cfg.data.ptx_path, cfg.data.ptx_format, cfg.data.prompt_key,
                                     cfg.data.ptx_max_len, tokenizer)
            log.info("PPO-ptx: %d rows from %s (ppo.ptx_coef = %g)", len(self.ptx_rows),
                     cfg.data.ptx_path, cfg.ppo.ptx_coef)
        if cfg.teacher.path is not None:  # checked at --dry-run too; before any model loads
            from ds_ppo.data.tokenizer import teacher_problem
            from ds_ppo.errors import ConfigError

            problem = teacher_problem(cfg, out)
            if problem is not None:
                raise ConfigError(problem)
        self.env = _environment(cfg)  # an env that does not import fails before models load
        self.tokenizer = tokenizer
        return tokenizer, cfg.iterations

    def check_checkpoint(self, path: Path) -> None:
        check_estimator_family(path, self.cfg.ppo.advantage_estimator)

    def build(self, cfg: Config, device: torch.device, universal: bool,
              autoep: frozenset[str] = frozenset()) -> Engines:
        engines = ppo_engines(cfg, self.tokenizer, device, load_universal=universal,
                              autoep=autoep, reward_shares_tokenizer=self.reward_encode is None
                              or self.reward_encode.same)
        # the token ids a checkpoint's in-flight rollouts may hold (`in_flight_problem`)
        self.vocab = getattr(getattr(engines.policy.module, "config", None), "vocab_size", None)
        return engines

    def trained_roles(self) -> tuple[str, ...]:
        return TRAINED_ROLES if self.cfg.ppo.uses_critic else ("policy",)

    def zero_stages(self, cfg: Config, device: torch.device) -> dict[str, int]:
        return zero_stages(cfg, device).stages

    def fresh_state(self, engines: Engines) -> TrainerState:
        _seed_sampling(self.cfg.seed)
        return TrainerState(world_size=dist.world_size(), seed=self.cfg.seed,
                            sequence_parallel_size=dist.sp_size(),
                            job_state={"advantage_estimator": self.cfg.ppo.advantage_estimator},
                            lora_bases=lora.base_record(engines.lora_bases))

    def resumed(self, state: TrainerState) -> None:
        own = state.job_state
        own["advantage_estimator"] = self.cfg.ppo.advantage_estimator
        self.kl_ctl.load_state_dict(own.get("kl_controller", {}))
        self.entropy_ctl.load_state_dict(own.get("entropy_controller", {}))

    def in_flight(self) -> dict | None:
        schedule = self.inputs.schedule
        return None if schedule is None else schedule.state_dict()

    def in_flight_problem(self, saved, iteration: int) -> str | None:
        return in_flight_problem(saved, iteration, len(self.prompts.input_ids), self.vocab)

    def restore_in_flight(self, saved) -> None:
        self._saved_flight = saved

    def start(self, run) -> None:
        cfg, engines, tokenizer = run.cfg, run.engines, run.tokenizer
        if engines.dtype == torch.float16:  # the loss scaler skips non-finite steps itself
            self.watched = LOSSES
        self.eos_ids = stop_token_ids(tokenizer, cfg.generation.stop_tokens)
        self.gen_mode = choose_mode(cfg.generation, engines.policy.module, engines.dtype,
                                    run.device)
        log.info("generation: mode %s, decoding loop %s", self.gen_mode,
                 choose_loop(cfg.generation, self.gen_mode, engines.policy.module.config))
        self.sampler = prompt_sampler(cfg, len(self.prompts.input_ids))
        self.inputs = IterationInputs(cfg, engines, tokenizer, self.prompts, self.gen_mode,
                                      self.eos_ids, self.reward_encode,
                                      _ptx_stream(cfg, self.ptx_rows, tokenizer), self.env)
        if cfg.ppo.schedule != "sync":  # generation beside training (ppo/schedule.py)
            sampler = self.sampler
            self.inputs = replace(self.inputs, schedule=rollout_schedule(
                self.inputs, lambda iteration: sampler.indices(iteration - 1),
                self._saved_flight))
        from ds_ppo.ppo.iteration_report import Reporter, report_settings

        self.reporter = Reporter(report_settings(cfg), run.tracker, run.out, tokenizer)

    def serve(self, cfg: Config, device: torch.device) -> None:
        """A generation rank of ppo.placement = split: its whole run (ppo/split.py)."""
        from ds_ppo.ppo.split import serve_generation

        serve_generation(cfg, device)

    # ------------------------------------------------------------------- one iteration
    def step(self, run, iteration: int) -> dict[str, float]:
        from ds_ppo.ppo.iteration_report import iteration_metrics

        cfg, engines, kl_ctl = run.cfg, run.engines, self.kl_ctl
        acc, t_iter = Accumulator(), time.perf_counter()
        # steps 1-4. generate, score, KL-shaped rewards and advantages, PPO update
        prompts = self._prompts(run, iteration)
        entropy_coef = self.entropy_ctl.value
        exp, _ = run_iteration(self.inputs, iteration, prompts, kl_ctl.value, acc,
                               metric_timer(acc), entropy_coef=entropy_coef)
        if isinstance(prompts, PromptDraw):  # where the next iteration draws from
            run.state.job_state["prompts_drawn"] = prompts.end
        # step 5. metrics, reduced across ranks; evaluation; KL and entropy controllers
        watchdog.at("metrics", iteration)
        metrics = iteration_metrics(acc, exp, engines, kl_ctl, t_iter,
                                    cfg.ppo.samples_per_prompt, cfg.ppo.kl_estimator,
                                    cfg.ppo.kl_clip, cfg.ppo.kl_in_reward)
        eval_samples = None
        if self.eval_prompts is not None and iteration % cfg.data.eval_every == 0:
            eval_metrics, eval_samples = self._evaluate(cfg, engines, run.tokenizer)
            metrics.update(eval_metrics)
        kl_ctl.update(metrics["kl/sequence_mean"], len(exp) * dist.dp_world_size())
        run.state.job_state["kl_controller"] = kl_ctl.state_dict()
        if cfg.ppo.entropy_target is not None:  # the coefficient this iteration trained with
            metrics["policy/entropy_coef"] = entropy_coef
            if "policy/entropy" in metrics:  # not measured in a critic warm-up iteration
                self.entropy_ctl.update(metrics["policy/entropy"])
            run.state.job_state["entropy_controller"] = self.entropy_ctl.state_dict()
        self._exp, self._eval_samples = exp, eval_samples  # for the report
        return metrics

    def report(self, run, iteration: int, metrics: dict[str, float]) -> None:
        self.reporter.report(metrics, iteration, self._exp, self._eval_samples)
        self._exp = self._eval_samples = None

    def _prompts(self, run, iteration: int) -> list[int] | PromptDraw:
        """This rank's prompts of `iteration`; with ppo.dynamic_sampling, the draw its rounds
        take them from (the stream position saved in the trainer state)."""
        if not run.cfg.ppo.dynamic_sampling:
            return self.sampler.indices(iteration - 1)
        start = run.state.job_state.get("prompts_drawn")
        if start is None:  # a fresh run, or one that ran without dynamic sampling so far
            start = (iteration - 1) * run.cfg.ppo.rollout_batch_size
        return PromptDraw(self.sampler, start)

    def _evaluate(self, cfg: Config, engines: Engines, tokenizer) -> tuple[dict, list]:
        """The eval/* metrics and samples of the policy; with policy.ema_decay also eval_ema/*
        of its EMA (swapped into the policy's weights for the evaluation, then swapped back)."""
        prompts, greedy = self.eval_prompts, rollout_settings(greedy_config(cfg))
        rewards = reward_settings(cfg)

        def generate(indices):
            return make_rollout(prompts, indices, engines, greedy, tokenizer, self.gen_mode,
                                self.eos_ids)[0]

        def reward(rollout):
            return reward_scores(rollout, engines, rewards, self.reward_encode)[0]

        args = (len(prompts.input_ids), eval_settings(cfg), generate, reward, tokenizer)
        metrics, samples = evaluate(*args)
        if engines.policy.ema is not None:
            with engines.policy.ema.swapped_in():
                ema, _ = evaluate(*args)
            metrics.update({k.replace("eval/", "eval_ema/", 1): v for k, v in ema.items()})
        return metrics, samples


def rollout_schedule(inputs: IterationInputs, prompts_of, saved=None):
    """ppo.schedule's RolloutSchedule over the iterations' prompts (`prompts_of(iteration)`:
    this rank's prompt indices of that 1-based iteration), continuing a
    checkpoint's in-flight work `saved`. It generates on a whole replica with our loop: a
    generation.mode / loop that resolved otherwise is refused here (--dry-run refuses the
    explicit settings)."""
    from ds_ppo.errors import ConfigError
    from ds_ppo.ppo.schedule import RolloutSchedule

    cfg = inputs.cfg
    loop = choose_loop(cfg.generation, inputs.gen_mode, inputs.engines.policy.module.config)
    if inputs.gen_mode != "gathered" or loop != "own":
        raise ConfigError(f"ppo.schedule = {cfg.ppo.schedule!r} generates on a whole replica "
                          f"with our decoding loop, but generation resolved to mode "
                          f"{inputs.gen_mode!r}, loop {loop!r}: set generation.mode=gathered "
                          "and generation.loop=own, or ppo.schedule=sync")
    schedule = RolloutSchedule(inputs, prompts_of)
    schedule.load_state_dict(saved)
    return schedule


def _environment(cfg: Config):
    """The env section's EnvRunner (multi-turn episodes), or None."""
    if not cfg.env.enabled:
        return None
    from ds_ppo.envs.runner import EnvRunner
    from ds_ppo.http_deadline import call_deadline

    return EnvRunner(cfg.env, cfg.data.reward_keys,
                     call_deadline(cfg.dist_timeout_minutes, dist.world_size()))


def _ptx_stream(cfg: Config, rows, tokenizer):
    """This rank's PPO-ptx rows per mini-batch (None without ppo.ptx_coef)."""
    if rows is None:
        return None
    from ds_ppo.config import steps_per_iteration
    from ds_ppo.data.ptx import PtxStream

    # per data-parallel rank: the ranks of a sequence-parallel group take the same rows
    return PtxStream(rows, cfg.ppo.mini_batch_size, steps_per_iteration(cfg), dist.dp_rank(),
                     dist.dp_world_size(), cfg.seed, tokenizer.pad_token_id)


def _seed_sampling(seed: int) -> None:
    # Each data-parallel rank samples its own responses: give each its own stream (the ranks
    # of a sequence-parallel group share one: they generate the same rows)
    torch.manual_seed(seed * 1000 + dist.dp_rank())
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed * 1000 + dist.dp_rank())


def prompt_sampler(cfg: Config, num_prompts: int):
    """The prompts of each iteration for this rank: grouped by PPO mini-batch, so each optimizer
    step sees the same prompts at any world size (mini_batch_size counts responses:
    samples_per_prompt of each prompt); indexed by the data-parallel rank: a sequence-parallel
    group's ranks take the same prompts."""
    from ds_ppo.data.prompts import PromptSampler

    return PromptSampler(num_prompts, cfg.ppo.rollout_batch_size, dist.dp_rank(),
                         dist.dp_world_size(),
                         cfg.seed, shuffle=cfg.data.shuffle,
                         group_size=cfg.ppo.mini_batch_size // cfg.ppo.samples_per_prompt)
