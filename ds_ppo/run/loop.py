"""The PPO training loop. `train()` reads as a table of contents; each stage is a function of its
own module (rollout, scoring, update, metrics, checkpoint)."""
from __future__ import annotations

import logging
import math
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ds_ppo import watchdog
from ds_ppo.algo import AdaptiveKLController, FixedKLController
from ds_ppo.config import Config
from ds_ppo.engine import dist, lora
from ds_ppo.engine.checkpoint import (TrainerState, check_estimator_family, ensure_universal,
                                      find_resume, load_checkpoint, mark_best, read_state,
                                      rng_state)
from ds_ppo.engine.dist import init_distributed
from ds_ppo.engine.generation import choose_loop, choose_mode
from ds_ppo.engine.roles import Engines, init_engines
from ds_ppo.errors import AlarmStop, Diverged, RegistrationError, RewardError
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.dynamic import PromptDraw
from ds_ppo.ppo.evaluate import evaluate
from ds_ppo.ppo.iteration import IterationInputs, metric_timer, run_iteration
from ds_ppo.ppo.rollout import sampling_mismatch, stop_token_ids
from ds_ppo.rewards.encode import reward_encoder
from ds_ppo.run.alarms import Alarm, AlarmState, check_alarms, is_better, save_score
from ds_ppo.role_names import TRAINED_ROLES
from ds_ppo.run.log_setup import quiet_libraries, setup_logging
from ds_ppo.run.preemption import Preempted, StopRequests
from ds_ppo.run.registry import last_eval_score, register_at_checkpoint, register_policy
from ds_ppo.run.report import Reporter, iteration_metrics
from ds_ppo.run.rundir import lock_output_dir, start_metrics_log
from ds_ppo.run.saves import checkpoint_now, finish, stop_on_reward_error

log = logging.getLogger("ds_ppo")


@dataclass
class TrainResult:
    """What a finished `train()` returns (identical on every rank)."""

    history: list[dict[str, float]] = field(default_factory=list)  # metrics of this process's iterations
    output_dir: str = ""
    last_checkpoint: str | None = None
    export_dir: str | None = None
    mlflow_run_id: str | None = None


def train(cfg: Config) -> TrainResult:
    """Run PPO as configured; resumes from output_dir's latest checkpoint when resume=auto."""
    finished = _already_finished(cfg)
    if finished is not None:  # nothing to load, train or export
        return finished
    device, out = _start_process(cfg)
    # step 0. data and models (data first: a bad dataset fails before any model loads)
    run = _set_up(cfg, out, device)
    dog = _start_watchdog(cfg, out)  # from here a hang names its phase and the missing ranks
    status, unregistered = "FAILED", None
    # a SIGTERM/SIGUSR1 from here on ends the run at the next iteration boundary (step 7)
    with StopRequests(cfg.checkpoint.save_on_signal) as stop:
        try:
            for iteration in range(run.state.iteration + 1, cfg.iterations + 1):
                acc, t_iter = Accumulator(), time.perf_counter()
                rng_at_start = rng_state()  # what a save of the previous iteration would hold
                # steps 1-4. generate, score, KL-shaped rewards and advantages, PPO update
                prompts = _prompts(run, iteration)
                exp, _ = run_iteration(run.inputs, iteration, prompts, run.kl_ctl.value, acc,
                                       metric_timer(acc))
                if isinstance(prompts, PromptDraw):  # where the next iteration draws from
                    run.state.prompts_drawn = prompts.end
                # step 5. metrics, reduced across ranks; KL controller; alarms; logging
                alarms = _report(run, iteration, acc, exp, t_iter)
                # step 6. checkpoint (and which one is the best)
                saved = _checkpoint_if_due(run, iteration)
                # step 7. a scheduler asked to stop (SIGTERM/SIGUSR1, any rank), or an alarm
                # fired with tracking.alarms.stop: checkpoint, leave
                _stop_if_asked(run, stop, iteration, saved)
                _stop_on_alarm(run, alarms, iteration, saved)
            # step 8. final save and export; the export into the MLflow model registry
            unregistered = _end(run)
            status = "FINISHED"
        except RewardError as e:  # reward function or service failed: keep the last iteration
            raise stop_on_reward_error(e, cfg, out, run.engines, run.state, run.tokenizer,
                                        run.result.last_checkpoint, rng_at_start) from None
        except (KeyboardInterrupt, Preempted):
            status = "KILLED"
            raise
        except Exception as e:
            if dist.is_collective_failure(e):  # a peer stopped or went away: the watchdog's line
                dog.fire(f"a collective failed: {(str(e).strip().splitlines() or [''])[0][:300]}")
            raise
        finally:
            dog.stop()
            run.tracker.close(status)
    if unregistered is not None:
        raise unregistered
    return run.result


@dataclass
class _Run:
    """What the iterations of one `train()` share, built once by `_set_up`."""

    cfg: Config
    out: Path
    device: torch.device
    tokenizer: object
    eval_prompts: object  # None without data.eval_split
    reward_encode: object  # None unless reward.model
    engines: Engines
    tracker: object
    state: TrainerState
    kl_ctl: object
    eos_ids: list[int]
    gen_mode: str
    sampler: object
    inputs: IterationInputs
    result: TrainResult
    reporter: Reporter
    alarms: AlarmState  # tracking.alarms' memory (saved in the trainer state)
    saved_at: int  # the iteration of the last checkpoint (checkpoint.keep_best's window)


def _start_process(cfg: Config) -> tuple[torch.device, Path]:
    """This process's distributed group, logging, seeds and the output_dir's lock."""
    quiet_libraries(cfg.log_level)
    device = init_distributed(cfg.dist_timeout_minutes)
    setup_logging(cfg.log_level)
    _seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    lock_output_dir(out)  # one run per output_dir: a second one stops here (exit 2)
    return device, out


def _set_up(cfg: Config, out: Path, device: torch.device) -> _Run:
    """Data, environment, tracking, engines and the trainer state, fresh or resumed; each part
    that can fail without a model fails before any model loads."""
    tokenizer, prompts, eval_prompts, reward_encode, ptx_rows = _load_data(cfg, out)
    env = _environment(cfg)  # an env that does not import fails before models load
    resume_from, universal = _find_resume(cfg)
    tracker = _open_tracker(cfg, resume_from)  # an unreachable server fails before models load
    engines = init_engines(cfg, tokenizer, device, load_universal=universal,
                           reward_shares_tokenizer=reward_encode is None or reward_encode.same)
    _log_ds_configs(tracker, engines, resumed=resume_from is not None)
    tracker.log_params(lora.trainable_counts(engines))
    state, kl_ctl = _start_or_resume(cfg, engines, resume_from, universal)
    state.mlflow_run_id = tracker.run_id
    eos_ids = stop_token_ids(tokenizer, cfg)
    gen_mode = choose_mode(cfg.generation, engines.policy.module, engines.dtype, device)
    log.info("generation: mode %s, decoding loop %s", gen_mode,
             choose_loop(cfg.generation, gen_mode, engines.policy.module.config))
    _warn(sampling_mismatch(cfg.generation))
    sampler = _sampler(cfg, len(prompts.input_ids))
    inputs = IterationInputs(cfg, engines, tokenizer, prompts, gen_mode, eos_ids, reward_encode,
                             _ptx_stream(cfg, ptx_rows, tokenizer), env)
    result = TrainResult(output_dir=str(out), mlflow_run_id=tracker.run_id,
                         last_checkpoint=str(resume_from) if resume_from is not None else None)
    return _Run(cfg, out, device, tokenizer, eval_prompts, reward_encode, engines, tracker, state,
                kl_ctl, eos_ids, gen_mode, sampler, inputs, result, Reporter(cfg, tracker, out),
                AlarmState(**state.alarms), state.iteration)


def _prompts(run: _Run, iteration: int) -> list[int] | PromptDraw:
    """This rank's prompts of `iteration`; with ppo.dynamic_sampling, the draw its rounds take
    them from (the stream position saved in the trainer state)."""
    if not run.cfg.ppo.dynamic_sampling:
        return run.sampler.indices(iteration - 1)
    start = run.state.prompts_drawn
    if start is None:  # a fresh run, or one that ran without dynamic sampling so far
        start = (iteration - 1) * run.cfg.ppo.rollout_batch_size
    return PromptDraw(run.sampler, start)


def _report(run: _Run, iteration: int, acc: Accumulator, exp, t_iter: float) -> list[Alarm]:
    """Step 5: the iteration's metrics (reduced across ranks) and evaluation, the KL
    controller's update, the alarms (tracking.alarms), the progress line, metrics.jsonl and
    MLflow; stops a diverged run. Returns the alarms that fired (alike on every rank)."""
    cfg, engines, kl_ctl = run.cfg, run.engines, run.kl_ctl
    watchdog.at("metrics", iteration)
    metrics = iteration_metrics(acc, exp, engines, kl_ctl, t_iter,
                                cfg.ppo.samples_per_prompt, cfg.ppo.kl_estimator,
                                cfg.ppo.kl_clip)
    eval_samples = None
    if run.eval_prompts is not None and iteration % cfg.data.eval_every == 0:
        eval_metrics, eval_samples = _evaluate(run.eval_prompts, engines, cfg, run.tokenizer,
                                               run.gen_mode, run.eos_ids, run.reward_encode)
        metrics.update(eval_metrics)
    kl_ctl.update(metrics["kl/sequence_mean"], len(exp) * dist.dp_world_size())
    alarms = check_alarms(cfg.tracking.alarms, run.alarms, metrics, iteration)
    metrics.update({f"alarm/{alarm.name}": 1.0 for alarm in alarms})
    run.reporter.report(metrics, iteration, exp, eval_samples)
    for alarm in alarms if dist.is_main() else ():  # below the iteration's progress line
        log.warning("%s", alarm.message)
        run.tracker.set_tag(f"alarm/{alarm.name}", alarm.message)
    run.result.history.append(metrics)
    _stop_if_diverged(metrics, iteration, run.result.last_checkpoint,  # before any save
                      grad_norms=engines.dtype != torch.float16)
    run.state.iteration, run.state.kl_controller = iteration, kl_ctl.state_dict()
    run.state.alarms = asdict(run.alarms)
    return alarms


def _checkpoint_if_due(run: _Run, iteration: int) -> bool:
    """Step 6: a checkpoint every checkpoint.every iterations (registered with
    tracking.register_every); whether one was saved."""
    cfg = run.cfg
    saved = bool(cfg.checkpoint.every) and iteration % cfg.checkpoint.every == 0
    if saved:
        best = _best_so_far(run, iteration)  # into the trainer state the save writes
        run.result.last_checkpoint = checkpoint_now(cfg, run.out, run.engines, run.state,
                                                 run.tokenizer)
        run.saved_at = iteration
        if best:
            mark_best(Path(run.result.last_checkpoint))
            if dist.is_main():
                log.info("best checkpoint by %s so far: %s (%s = %.4g)", cfg.checkpoint.keep_best,
                         run.result.last_checkpoint, cfg.checkpoint.keep_best,
                         run.state.best["value"])
        register_at_checkpoint(cfg, run.tracker, run.result.last_checkpoint, iteration,
                               run.result.history)
    return saved


def _best_so_far(run: _Run, iteration: int) -> bool:
    """checkpoint.keep_best: whether the save of `iteration` is the best so far, by the mean of
    the metric over the iterations since the previous save (recorded in run.state.best)."""
    c = run.cfg.checkpoint
    if c.keep_best is None:
        return False
    since = run.result.history[len(run.result.history) - (iteration - run.saved_at):]
    score = save_score([m[c.keep_best] for m in since if c.keep_best in m])
    if score is None:
        _warn(f"checkpoint.keep_best = {c.keep_best!r}: no iteration since the previous save "
              f"logged it, so the save of iteration {iteration} is not ranked (a metric of "
              "metrics.jsonl, e.g. score/mean, env/accuracy, eval/score_mean)")
        return False
    if not is_better(score, run.state.best.get("value"), c.keep_best_mode):
        return False
    run.state.best = {"metric": c.keep_best, "value": score, "iteration": iteration}
    return True


def _stop_on_alarm(run: _Run, alarms: list[Alarm], iteration: int, saved: bool) -> None:
    """Step 7 (tracking.alarms.stop): when an alarm fired, checkpoint (unless step 6 just did)
    and raise AlarmStop on every rank (the alarms are decided from reduced metrics)."""
    if not alarms or not run.cfg.tracking.alarms.stop:
        return
    if not saved:
        run.result.last_checkpoint = checkpoint_now(run.cfg, run.out, run.engines, run.state,
                                                 run.tokenizer)
    raise AlarmStop(f"{alarms[0].message}. Stopped (tracking.alarms.stop=true) after saving "
                    f"{run.result.last_checkpoint}; change the settings and run the same "
                    "command to resume, or set tracking.alarms.stop=false to train on.")


def _stop_if_asked(run: _Run, stop: StopRequests, iteration: int, saved: bool) -> None:
    """Step 7: when any rank got SIGTERM/SIGUSR1, checkpoint (unless step 6 just did) and raise
    Preempted on every rank."""
    signum = stop.agreed(run.device)
    if signum:
        if not saved:
            run.result.last_checkpoint = checkpoint_now(run.cfg, run.out, run.engines, run.state,
                                                     run.tokenizer)
        raise Preempted(signum, iteration, run.result.last_checkpoint)


def _end(run: _Run) -> RegistrationError | None:
    """Step 8: the final checkpoint and export, then the export into the MLflow model registry
    (tracking.register_model); a registration failure is returned, see `_register_at_end`."""
    result = run.result
    result.last_checkpoint, result.export_dir = finish(run.cfg, run.engines, run.state,
                                                        run.tokenizer, result.last_checkpoint)
    with watchdog.phase("registering the policy", limit_s=None):  # rank 0, no peers
        return _register_at_end(run.cfg, run.tracker, result, run.state.iteration)


def _register_at_end(cfg: Config, tracker, result: TrainResult,
                     iteration: int) -> RegistrationError | None:
    """The export into the model registry (tracking.register_model). A failure is returned, to
    be raised once the MLflow run is closed: the training is done and saved (exit code 4)."""
    try:
        register_policy(cfg, tracker, result.export_dir, iteration,
                        last_eval_score(result.history), strict=True)
    except RegistrationError as e:
        return e
    return None


def _start_watchdog(cfg: Config, out: Path) -> watchdog.Watchdog:
    """This rank's watchdog thread (watchdog_minutes), beating into the job's store."""
    from ds_ppo.config import watchdog_limit_s

    token = dist.broadcast_object(uuid.uuid4().hex if dist.is_main() else None)  # collective
    return watchdog.install(watchdog.Watchdog(
        watchdog_limit_s(cfg), dist.rank(), dist.world_size(), dist.watchdog_store(), out,
        run_token=token)).start()


# ------------------------------------------------------------------------- start-up
def _already_finished(cfg: Config) -> TrainResult | None:
    """The result of a run that is already complete (`finished_run`), printed; else None."""
    from ds_ppo.engine.checkpoint_files import finished_message, finished_run

    c = cfg.checkpoint
    done = finished_run(cfg.output_dir, cfg.resume, cfg.iterations, c.export_at_end)
    if done is None:
        return None
    path, state = done
    if os.environ.get("RANK", "0") == "0":
        print(finished_message(cfg.output_dir, path, state, cfg.iterations, c.export_at_end),
              flush=True)
    return TrainResult(output_dir=str(cfg.output_dir), last_checkpoint=str(path),
                       export_dir=str(Path(cfg.output_dir) / "final") if c.export_at_end else None,
                       mlflow_run_id=state.mlflow_run_id)


def _warn(message: str | None) -> None:
    if message and dist.is_main():
        log.warning("%s", message)


def _seed_everything(seed: int) -> None:
    # Same seed on every rank for initialisation; sampling streams are made per rank below.
    random.seed(seed)
    torch.manual_seed(seed)


def _load_data(cfg: Config, out: Path):
    from ds_ppo.data.prompts import load_prompts
    from ds_ppo.data.tokenizer import load_policy_tokenizer, load_tokenizer

    tokenizer = load_policy_tokenizer(cfg, out)
    prompts = load_prompts(cfg.data, tokenizer)
    eval_prompts = None
    if cfg.data.eval_split is not None and cfg.data.eval_every > 0:
        eval_prompts = load_prompts(cfg.data, tokenizer, split=cfg.data.eval_split)
    reward_encode = None
    if cfg.reward.model is not None:
        reward_encode = reward_encoder(cfg, tokenizer, load_tokenizer(
            cfg.reward.tokenizer or cfg.reward.model, out))
    ptx_rows = None
    if cfg.ppo.ptx_coef > 0:  # PPO-ptx rows (data.ptx_path)
        from ds_ppo.data.ptx import load_ptx

        ptx_rows = load_ptx(cfg.data.ptx_path, cfg.data.ptx_format, cfg.data.prompt_key,
                            cfg.data.ptx_max_len, tokenizer)
        log.info("PPO-ptx: %d rows from %s (ppo.ptx_coef = %g)", len(ptx_rows),
                 cfg.data.ptx_path, cfg.ppo.ptx_coef)
    return tokenizer, prompts, eval_prompts, reward_encode, ptx_rows


def _ptx_stream(cfg: Config, rows, tokenizer):
    """This rank's PPO-ptx rows per mini-batch (None without ppo.ptx_coef)."""
    if rows is None:
        return None
    from ds_ppo.config import steps_per_iteration
    from ds_ppo.data.ptx import PtxStream

    # per data-parallel rank: the ranks of a sequence-parallel group take the same rows
    return PtxStream(rows, cfg.ppo.mini_batch_size, steps_per_iteration(cfg), dist.dp_rank(),
                     dist.dp_world_size(), cfg.seed, tokenizer.pad_token_id)


def _evaluate(eval_prompts, engines: Engines, cfg: Config, tokenizer, gen_mode: str,
              eos_ids: list[int], reward_encode) -> tuple[dict[str, float], list]:
    """The eval/* metrics and samples of the policy; with policy.ema_decay also eval_ema/* of
    its EMA (swapped into the policy's weights for the evaluation, then swapped back)."""
    metrics, samples = evaluate(eval_prompts, engines, cfg, tokenizer, gen_mode, eos_ids,
                                reward_encode)
    if engines.policy.ema is not None:
        with engines.policy.ema.swapped_in():
            ema, _ = evaluate(eval_prompts, engines, cfg, tokenizer, gen_mode, eos_ids,
                              reward_encode)
        metrics.update({k.replace("eval/", "eval_ema/", 1): v for k, v in ema.items()})
    return metrics, samples


def _environment(cfg: Config):
    """The env section's EnvRunner (multi-turn episodes), or None."""
    if not cfg.env.enabled:
        return None
    from ds_ppo.envs.runner import EnvRunner
    from ds_ppo.rewards.service import call_deadline

    return EnvRunner(cfg.env, cfg.data.reward_keys,
                     call_deadline(cfg.dist_timeout_minutes, dist.world_size()))


def _find_resume(cfg: Config) -> tuple[Path | None, bool]:
    """The checkpoint to continue from (None: fresh start), and whether it must be loaded in
    DeepSpeed's universal format because the data-parallel world size changed."""
    path = find_resume(cfg.output_dir, cfg.resume, cfg.checkpoint.verify)
    if path is None:
        return None, False
    check_estimator_family(path, cfg.ppo.advantage_estimator)  # before any model loads
    universal = read_state(path).world_size != dist.world_size()
    if universal:
        ensure_universal(path)
    return path, universal


def _start_or_resume(cfg: Config, engines: Engines, path: Path | None, universal: bool):
    p = cfg.ppo
    kl_ctl = (AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon)
              if p.kl_controller == "adaptive" else FixedKLController(p.kl_coef))
    if path is None:
        state = TrainerState(world_size=dist.world_size(), seed=cfg.seed,
                             sequence_parallel_size=dist.sp_size(),
                             advantage_estimator=p.advantage_estimator,
                             lora_bases=lora.base_record(engines.lora_bases))
        _seed_sampling(cfg.seed)
        start_metrics_log(cfg.output_dir, None)  # an earlier log is moved aside, never truncated
        return state, kl_ctl
    lora.check_base(read_state(path).lora_bases, engines.lora_bases, path)
    state = load_checkpoint(path, engines, universal)
    state.advantage_estimator = p.advantage_estimator
    for role in TRAINED_ROLES if p.uses_critic else ("policy",):
        changed = getattr(engines, role).apply_optimizer_config(getattr(cfg, role))
        if changed:
            log.info("%s optimizer settings from the config, not the checkpoint: %s", role,
                     ", ".join(changed))
    start_metrics_log(cfg.output_dir, state.iteration)
    kl_ctl.load_state_dict(state.kl_controller)
    log.info("resumed from %s (iteration %d%s%s)", path, state.iteration,
             f", world size {state.world_size} -> {dist.world_size()} via a universal checkpoint"
             if universal else "",
             f", sequence-parallel size {state.sequence_parallel_size} -> {dist.sp_size()}"
             if state.sequence_parallel_size != dist.sp_size() else "")
    state.world_size, state.sequence_parallel_size = dist.world_size(), dist.sp_size()
    if state.iteration >= cfg.iterations:
        log.info("the run in %s already completed %d of iterations=%d; nothing to train (raise "
                 "iterations to continue)", cfg.output_dir, state.iteration, cfg.iterations)
    return state, kl_ctl


def _seed_sampling(seed: int) -> None:
    # Each data-parallel rank samples its own responses: give each its own stream (the ranks
    # of a sequence-parallel group share one: they generate the same rows)
    torch.manual_seed(seed * 1000 + dist.dp_rank())
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed * 1000 + dist.dp_rank())


def _sampler(cfg: Config, num_prompts: int):
    from ds_ppo.data.prompts import PromptSampler

    # grouped by PPO mini-batch, so each optimizer step sees the same prompts at any world size
    # (mini_batch_size counts responses: samples_per_prompt of each prompt); indexed by the
    # data-parallel rank: a sequence-parallel group's ranks take the same prompts
    return PromptSampler(num_prompts, cfg.ppo.rollout_batch_size, dist.dp_rank(),
                         dist.dp_world_size(),
                         cfg.seed, shuffle=cfg.data.shuffle,
                         group_size=cfg.ppo.mini_batch_size // cfg.ppo.samples_per_prompt)


def _open_tracker(cfg: Config, resume_from: Path | None):
    """MLflow on rank 0 (continuing the checkpoint's run on resume); no-ops elsewhere."""
    import importlib.metadata as md

    from ds_ppo.redaction import redact_url
    from ds_ppo.run.tracking import TrackingError, open_tracker

    tags = {"world_size": str(dist.world_size()), "num_nodes": str(dist.num_nodes()),
            "policy": cfg.policy.path or f"arch:{(cfg.policy.arch or {}).get('model_type')}",
            "reward": cfg.reward.model or cfg.reward.function or redact_url(cfg.reward.url) or "",
            "generation_mode": cfg.generation.mode}
    try:
        tags["ds_ppo_version"] = md.version("ds-ppo")
    except md.PackageNotFoundError:
        pass
    run_id = read_state(resume_from).mlflow_run_id if resume_from is not None else None
    tracker, error = None, None
    try:
        tracker = open_tracker(cfg, is_main=dist.is_main(), run_id=run_id, tags=tags)
    except TrackingError as e:
        error = e
    # rank 0's verdict reaches every rank, so a failed start stops the whole job, not one rank
    message = dist.broadcast_object(str(error) if error is not None else None)
    if message is not None:
        raise error or TrackingError(f"rank 0 could not start MLflow tracking: {message}")
    if dist.is_main() and tracker.run_id:
        log.info("%s", tracker.where())
    return tracker


def _log_ds_configs(tracker, engines: Engines, resumed: bool) -> None:
    """Each role's final DeepSpeed config as a run artifact (once per run)."""
    if not resumed:
        for role, ds_config in engines.ds_configs.items():
            tracker.log_dict(ds_config, f"deepspeed/{role}.json")


# ------------------------------------------------------------------------- per iteration
# Metrics that are never NaN or infinite while training is healthy. With bf16 or fp32, DeepSpeed
# applies a non-finite gradient, so one is enough to ruin the weights; stopping before the next
# checkpoint keeps the saved ones usable. fp16's loss scaler skips such steps and reports their
# gradient norm as inf, routinely in the first steps: there only the losses are checked.
_LOSSES = ("loss/policy", "loss/value")
_GRAD_NORMS = ("policy/grad_norm", "value/grad_norm")


def _stop_if_diverged(metrics: dict[str, float], iteration: int, last_checkpoint: str | None,
                      grad_norms: bool = True):
    """Raise `Diverged` (on every rank alike: the metrics are reduced) when a loss (or, with
    `grad_norms`, a gradient norm) of this iteration is not finite."""
    keys = _LOSSES + (_GRAD_NORMS if grad_norms else ())
    bad = {k: metrics[k] for k in keys if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        where = (f"the last checkpoint, {last_checkpoint}, was saved before it" if last_checkpoint
                 else "no checkpoint was saved before it")
        raise Diverged(f"iteration {iteration}: {', '.join(f'{k} = {v}' for k, v in bad.items())}"
                       f": training diverged and this iteration's weights are not saved; {where}. "
                       "Resume from a checkpoint with a lower learning rate (policy.lr, value.lr), "
                       "gradient clipping (max_grad_norm) or a smaller ppo.clip_eps.")
