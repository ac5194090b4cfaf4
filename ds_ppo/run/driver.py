"""The run around any training job of the registry (jobs/contract.py's `JOBS`): `ds-ppo train`
(ppo/train_job.py), `ds-ppo sft` and `ds-ppo rm` (jobs/supervised/training.py over sft/task.py and
rm/task.py).

`run(cfg, job)` owns what every job needs and no job repeats: the process (distributed group,
logging, seeds), the output_dir's lock, the finished-run check, resume (the latest checkpoint,
verified; at another world size through DeepSpeed's universal format), MLflow, the hang
watchdog, the stop requests of a scheduler (SIGTERM / SIGUSR1: a checkpoint, then exit; a
SIGTERM that gave up a reward call, an environment call or a decode: exit, no save), the
checkpoint every `checkpoint.every` units, the divergence stop, a failed collective named by
the watchdog, and at the end the final save, the export and its registration. A job plugs in
through `Job` (jobs/contract.py; torchtune's recipe interface is the model): its data, its engines,
one step, and what its checkpoints hold. The driver never imports a job, nor the jobs layer.
"""
from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_ppo import abandon, watchdog
from ds_ppo.config import Config
from ds_ppo.config.model_checks import expert_parallel_problems
from ds_ppo.engine import dist, lora
from ds_ppo.engine.checkpoint import (TrainerState, ensure_universal, expert_parallel_resume,
                                      find_resume, load_checkpoint, read_in_flight,
                                      read_state, rng_state, stage_changed)
from ds_ppo.engine.checkpoint.files import verify_model_paths
from ds_ppo.engine.dist import init_distributed
from ds_ppo.errors import AlarmStop, ConfigError, Diverged, RegistrationError, RewardError
from ds_ppo.run.alarms import Alarm, AlarmState, check_alarms, is_better, save_score
from ds_ppo.run.log_setup import quiet_libraries, setup_logging
from ds_ppo.run.preemption import Preempted, StopRequests, abandoned
from ds_ppo.run.registry import last_eval_score, register_at_checkpoint, register_policy
from ds_ppo.run.rundir import lock_output_dir, start_metrics_log
from ds_ppo.run.saves import checkpoint_now, finish, stop_on_reward_error

log = logging.getLogger("ds_ppo")

# a job as jobs/contract.py's `Job` protocol declares it (test_jobs checks that the driver calls
# nothing else); the driver sits below the jobs layer and does not import it
Job = Any


@dataclass
class TrainResult:
    """What a finished run returns (identical on every rank)."""

    history: list[dict[str, float]] = field(default_factory=list)  # metrics of this process's steps
    output_dir: str = ""
    last_checkpoint: str | None = None
    export_dir: str | None = None
    mlflow_run_id: str | None = None


@dataclass
class Run:
    """What the driver and the job's steps share, built once by `run`."""

    cfg: Config
    out: Path
    device: torch.device
    tracker: Any
    engines: Any  # engine.roles.Engines (ppo) or engine.supervised.JobEngines
    tokenizer: Any
    state: TrainerState
    result: TrainResult
    alarms: AlarmState  # tracking.alarms' memory (saved in the trainer state)
    saved_at: int  # the unit of the last checkpoint (checkpoint.keep_best's window)
    in_flight: Any = None  # the job's `in_flight`: this rank's unfinished work a save holds


def run(cfg: Config, job: Job) -> TrainResult:
    """Run `job` (a jobs/contract.py `Job`: the driver calls nothing else of it) as configured;
    resumes from output_dir's latest checkpoint when resume=auto."""
    finished = _already_finished(cfg, job, job.known_total(cfg))
    if finished is not None:  # nothing to load, train or export
        return finished
    device, out = _start_process(cfg)
    if dist.is_generation_rank():  # ppo.placement = split: this rank only generates
        job.serve(cfg, device)
        return TrainResult(output_dir=str(out))
    # step 0. data, then the models (a bad dataset fails before any model loads; an export of
    # ours that a model starts from is checked before its tokenizer loads)
    verify_model_paths({key: _setting(cfg, key) for key in job.model_keys},
                       cfg.checkpoint.verify)
    tokenizer, total = job.load_data(cfg, out)
    if job.known_total(cfg) is None and (done := _already_finished(cfg, job, total)) is not None:
        return done
    resume_from, universal, autoep = _find_resume(cfg, job, device)
    tracker = _open_tracker(cfg, resume_from)  # an unreachable server fails before models load
    engines = job.build(cfg, device, universal, autoep)
    _log_ds_configs(tracker, engines, resumed=resume_from is not None)
    tracker.log_params(lora.trainable_counts(engines))
    state = _start_or_resume(cfg, job, engines, resume_from, universal, total)
    state.mlflow_run_id = tracker.run_id
    run = Run(cfg, out, device, tracker, engines, tokenizer, state, TrainResult(
        output_dir=str(out), mlflow_run_id=tracker.run_id,
        last_checkpoint=str(resume_from) if resume_from is not None else None),
        AlarmState(**state.alarms), state.iteration, job.in_flight)
    job.start(run)
    dog = _start_watchdog(cfg, out)  # from here a hang names its phase and the missing ranks
    status, unregistered, rng_at_start, flight_at_start = "FAILED", None, None, None
    # a SIGTERM/SIGUSR1 from here on ends the run at the next unit's boundary (step 5)
    with StopRequests(cfg.checkpoint.save_on_signal) as stop:
        try:
            for unit in range(state.iteration + 1, total + 1):
                # what a save of the previous unit would hold
                rng_at_start, flight_at_start = rng_state(), job.in_flight()
                # step 1. the job's unit: train, evaluate when due
                metrics = job.step(run, unit)
                # step 2. alarms (tracking.alarms), then the report
                alarms = _report(run, job, unit, metrics)
                # step 3. a diverged run stops before any save
                _stop_if_diverged(job, metrics, unit, run.result.last_checkpoint)
                state.iteration, state.alarms = unit, asdict(run.alarms)
                # step 4. checkpoint when due (and which one is the best)
                saved = _checkpoint_if_due(run, job, unit)
                # step 5. a scheduler asked to stop (SIGTERM/SIGUSR1, any rank), or an alarm
                # fired with tracking.alarms.stop: checkpoint, leave
                _stop_if_asked(run, stop, unit, saved)
                _stop_on_alarm(run, alarms, saved)
            # step 6. final save and export; the export into the MLflow model registry
            unregistered = _end(run, job)
            status = "FINISHED"
        except RewardError as e:  # reward function or service failed: keep the last unit
            raise stop_on_reward_error(e, cfg, out, engines, state, tokenizer,
                                       run.result.last_checkpoint, rng_at_start,
                                       flight_at_start) from None
        except abandon.Abandoned as e:  # SIGTERM in a reward call, env call or decode: no save
            status = "KILLED"
            raise abandoned(e, run.saved_at, run.result.last_checkpoint) from None
        except (KeyboardInterrupt, Preempted):
            status = "KILLED"
            raise
        except Exception as e:
            if dist.is_collective_failure(e) and abandon.requested():
                # after a SIGTERM here, a peer that gave its iteration up (and left) ends this one
                status = "KILLED"
                raise abandoned(abandon.Abandoned(abandon.requested(), "a collective (another "
                                                  "rank stopped on the signal)"),
                                run.saved_at, run.result.last_checkpoint) from None
            if dist.is_collective_failure(e):  # a peer stopped or went away: the watchdog's line
                dog.fire(f"a collective failed: {(str(e).strip().splitlines() or [''])[0][:300]}")
            raise
        finally:
            dog.stop()
            tracker.close(status)
    if unregistered is not None:
        raise unregistered
    return run.result


# ------------------------------------------------------------------------- start-up
def _start_process(cfg: Config) -> tuple[torch.device, Path]:
    """This process's distributed group, logging, seeds and the output_dir's lock."""
    quiet_libraries(cfg.log_level)
    split = cfg.ppo.placement == "split"
    device = init_distributed(cfg.dist_timeout_minutes,
                              cfg.ppo.generation_ranks if split else 0)
    setup_logging(cfg.log_level)
    seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    if not dist.is_generation_rank():  # the training ranks' group takes the lock
        lock_output_dir(out)  # one run per output_dir: a second one stops here (exit 2)
    return device, out


def _setting(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def seed_everything(seed: int) -> None:
    # Same seed on every rank for initialisation; a job seeds its sampling streams per rank.
    random.seed(seed)
    torch.manual_seed(seed)


def _already_finished(cfg: Config, job: Job, total: int | None) -> TrainResult | None:
    """The result of a run that already completed `total` units (`finished_run`), printed
    once; else None."""
    from ds_ppo.engine.checkpoint.files import finished_message, finished_run

    if total is None:
        return None
    c = cfg.checkpoint
    done = finished_run(cfg.output_dir, cfg.resume, total, c.export_at_end, job.name)
    if done is None:
        return None
    path, state = done
    if os.environ.get("RANK", "0") == "0":
        print(finished_message(cfg.output_dir, path, state, total, c.export_at_end,
                               job.total_key), flush=True)
    return TrainResult(output_dir=str(cfg.output_dir), last_checkpoint=str(path),
                       export_dir=str(Path(cfg.output_dir) / "final") if c.export_at_end else None,
                       mlflow_run_id=state.mlflow_run_id)


def _find_resume(cfg: Config, job: Job, device: torch.device
                 ) -> tuple[Path | None, bool, frozenset[str]]:
    """The checkpoint to continue from (None: fresh start); whether it must be loaded in
    DeepSpeed's universal format: the data-parallel world size changed, a trained role's
    expert-parallel size changed, or its ZeRO stage moved to or from 3 (zero_stage auto on
    another GPU or config, or an explicit change); and the trained roles to build with AutoEP's
    layers whatever their expert-parallel size (the checkpoint holds them so)."""
    path = find_resume(cfg.output_dir, cfg.resume, cfg.checkpoint.verify)
    if path is None:
        return None, False, frozenset()
    job.check_checkpoint(path)  # before any model loads
    autoep, ep_changed = expert_parallel_resume(path, {
        r: n for r in job.trained_roles()
        if (n := getattr(cfg.deepspeed, r).expert_parallel_size) > 1})
    if problems := expert_parallel_problems(cfg, dist.world_size(), autoep):
        raise ConfigError("; ".join(problems))
    universal = read_state(path).world_size != dist.world_size() or ep_changed
    if ep_changed and dist.is_main():
        log.info("the expert-parallel size changed since %s was saved: loading it through a "
                 "universal checkpoint", path)
    if not universal:
        changed = stage_changed(path, job.zero_stages(cfg, device))
        if changed and dist.is_main():
            log.info("the ZeRO stage of %s changed since %s was saved: loading it through a "
                     "universal checkpoint", ", ".join(changed), path)
        universal = bool(changed)
    if universal:
        ensure_universal(path, autoep)
    return path, universal, autoep


def _start_or_resume(cfg: Config, job: Job, engines, path: Path | None, universal: bool,
                     total: int) -> TrainerState:
    if path is None:
        start_metrics_log(cfg.output_dir, None)  # an earlier log is moved aside, never truncated
        return job.fresh_state(engines)
    lora.check_base(read_state(path).lora_bases, engines.lora_bases, path)
    state = load_checkpoint(path, engines, universal)
    job.restore_in_flight(read_in_flight(path, job.in_flight_problem))
    for role in job.trained_roles():
        changed = getattr(engines, role).apply_optimizer_config(getattr(cfg, role))
        if changed:
            log.info("%s optimizer settings from the config, not the checkpoint: %s", role,
                     ", ".join(changed))
    start_metrics_log(cfg.output_dir, state.iteration)
    job.resumed(state)
    log.info("resumed from %s (%s %d%s%s)", path, job.unit, state.iteration,
             f", world size {state.world_size} -> {dist.world_size()} via a universal checkpoint"
             if universal else "",
             f", sequence-parallel size {state.sequence_parallel_size} -> {dist.sp_size()}"
             if state.sequence_parallel_size != dist.sp_size() else "")
    state.world_size, state.sequence_parallel_size = dist.world_size(), dist.sp_size()
    if state.iteration >= total:
        log.info("the run in %s already completed %d of %s=%d; nothing to train (raise %s to "
                 "continue)", cfg.output_dir, state.iteration, job.total_key, total,
                 job.total_key)
    return state


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


def _log_ds_configs(tracker, engines, resumed: bool) -> None:
    """Each role's final DeepSpeed config as a run artifact (once per run)."""
    if not resumed:
        for role, ds_config in engines.ds_configs.items():
            tracker.log_dict(ds_config, f"deepspeed/{role}.json")


def _start_watchdog(cfg: Config, out: Path) -> watchdog.Watchdog:
    """This rank's watchdog thread (watchdog_minutes), beating into the job's store."""
    from ds_ppo.config import watchdog_limit_s

    token = dist.run_token()  # collective (under a split placement: the bridge's, sent at start)
    world, generation_ranks = dist.watchdog_world()  # a split placement's generation ranks too
    return watchdog.install(watchdog.Watchdog(
        watchdog_limit_s(cfg), dist.rank(), world, dist.watchdog_store(), out,
        run_token=token, generation_ranks=generation_ranks)).start()


# ------------------------------------------------------------------------- per unit
def _report(run: Run, job: Job, unit: int, metrics: dict[str, float]) -> list[Alarm]:
    """The alarms of this unit (alike on every rank: the metrics are reduced), as metrics
    `alarm/<name>`, then the job's report, each alarm's line below it and its MLflow tag."""
    alarms = check_alarms(run.cfg.tracking.alarms, run.alarms, metrics, unit)
    metrics.update({f"alarm/{alarm.name}": 1.0 for alarm in alarms})
    job.report(run, unit, metrics)
    for alarm in alarms if dist.is_main() else ():
        log.warning("%s", alarm.message)
        run.tracker.set_tag(f"alarm/{alarm.name}", alarm.message)
    run.result.history.append(metrics)
    return alarms


def _stop_if_diverged(job: Job, metrics: dict[str, float], unit: int,
                      last_checkpoint: str | None) -> None:
    """Raise `Diverged` (on every rank alike: the metrics are reduced) when a watched metric
    of this unit is not finite: its weights must not be saved over good checkpoints."""
    stop_if_diverged(metrics, job.watched, f"{job.unit} {unit}", last_checkpoint,
                     job.diverged_fix)


def stop_if_diverged(metrics: dict[str, float], watched: tuple[str, ...], where: str,
                     last_checkpoint: str | None, fix: str) -> None:
    bad = {k: metrics[k] for k in watched if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        saved = (f"the last checkpoint, {last_checkpoint}, was saved before it" if last_checkpoint
                 else "no checkpoint was saved before it")
        unit = where.split()[0]
        raise Diverged(f"{where}: {', '.join(f'{k} = {v}' for k, v in bad.items())}: training "
                       f"diverged and this {unit}'s weights are not saved; {saved}. {fix}")


def _checkpoint_if_due(run: Run, job: Job, unit: int) -> bool:
    """A checkpoint every checkpoint.every units (registered with tracking.register_every);
    whether one was saved."""
    cfg = run.cfg
    saved = bool(cfg.checkpoint.every) and unit % cfg.checkpoint.every == 0
    if saved:
        # into the trainer state the save writes; its commit points checkpoints/best at it
        best = _best_so_far(run, unit)
        run.result.last_checkpoint = checkpoint_now(cfg, run.out, run.engines, run.state,
                                                    run.tokenizer, run.in_flight())
        run.saved_at = unit
        if best:
            if dist.is_main():
                log.info("best checkpoint by %s so far: %s (%s = %.4g)", cfg.checkpoint.keep_best,
                         run.result.last_checkpoint, cfg.checkpoint.keep_best,
                         run.state.best["value"])
        if job.registers:
            register_at_checkpoint(cfg, run.tracker, run.result.last_checkpoint, unit,
                                   run.result.history)
    return saved


def _best_so_far(run: Run, unit: int) -> bool:
    """checkpoint.keep_best: whether the save of `unit` is the best so far, by the mean of the
    metric over the units since the previous save (recorded in run.state.best)."""
    c = run.cfg.checkpoint
    if c.keep_best is None:
        return False
    since = run.result.history[len(run.result.history) - (unit - run.saved_at):]
    score = save_score([m[c.keep_best] for m in since if c.keep_best in m])
    if score is None:
        if dist.is_main():
            log.warning("checkpoint.keep_best = %r: no unit since the previous save logged it, so "
                        "the save of %d is not ranked (a metric of metrics.jsonl, e.g. score/mean, "
                        "env/accuracy, eval/score_mean)", c.keep_best, unit)
        return False
    if not is_better(score, run.state.best.get("value"), c.keep_best_mode):
        return False
    run.state.best = {"metric": c.keep_best, "value": score, "iteration": unit}
    return True


def _stop_on_alarm(run: Run, alarms: list[Alarm], saved: bool) -> None:
    """tracking.alarms.stop: when an alarm fired, checkpoint (unless one was just saved) and
    raise AlarmStop on every rank (the alarms are decided from reduced metrics)."""
    if not alarms or not run.cfg.tracking.alarms.stop:
        return
    if not saved:
        run.result.last_checkpoint = checkpoint_now(run.cfg, run.out, run.engines, run.state,
                                                    run.tokenizer, run.in_flight())
    raise AlarmStop(f"{alarms[0].message}. Stopped (tracking.alarms.stop=true) after saving "
                    f"{run.result.last_checkpoint}; change the settings and run the same "
                    "command to resume, or set tracking.alarms.stop=false to train on.")


def _stop_if_asked(run: Run, stop: StopRequests, unit: int, saved: bool) -> None:
    """When any rank got SIGTERM/SIGUSR1: checkpoint (unless one was just saved) and raise
    Preempted on every rank."""
    signum = stop.agreed(run.device)
    if signum:
        if not saved:
            run.result.last_checkpoint = checkpoint_now(run.cfg, run.out, run.engines, run.state,
                                                        run.tokenizer, run.in_flight())
        raise Preempted(signum, unit, run.result.last_checkpoint)


def _end(run: Run, job: Job) -> RegistrationError | None:
    """The final checkpoint and export, then (a job that registers) the export into the MLflow
    model registry; a registration failure is returned, to be raised once the MLflow run is
    closed: the training is done and saved (exit code 4)."""
    result = run.result
    result.last_checkpoint, result.export_dir = finish(
        run.cfg, run.engines, run.state, run.tokenizer, result.last_checkpoint, job.model_class,
        job.in_flight())
    if not job.registers:
        return None
    with watchdog.phase("registering the policy", limit_s=None):  # rank 0, no peers
        try:
            register_policy(run.cfg, run.tracker, result.export_dir, run.state.iteration,
                            last_eval_score(result.history), strict=True)
        except RegistrationError as e:
            return e
    return None
