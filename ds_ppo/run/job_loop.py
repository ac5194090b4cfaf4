"""The loop of a supervised job (`ds-ppo sft`, `ds-ppo rm`): the same run around it as PPO's
(run/loop.py): run directory lock, MLflow (resumed runs continue their MLflow run), metrics.jsonl,
progress lines with the ETA, checkpoints every checkpoint.every optimizer steps that resume
exactly, SIGTERM / SIGUSR1 / Ctrl-C ending the run with a checkpoint, an export to
output_dir/final at the end. A job (sft/job.py, rm/job.py) supplies its rows, micro-batches and
loss; `run_job` reads as a table of contents.

Steps and batches: step s (1-based) trains on global batch s - 1 of `PromptSampler` (one
permutation of the rows per epoch, seeded): rank r takes its slice, so the same rows make a step
at any world size. Loss normalisation: each micro-batch loss is a sum (tokens or pairs) divided by
the count of the whole global batch (all micro-batches, all ranks; one all-reduce), then
multiplied by world size x accumulation steps to undo DeepSpeed's averaging over both: the
gradient of a step is that of the mean loss over the global batch, whatever the world size or the
micro-batch split (tested at 1 and 2 ranks). The optimizer step is placed explicitly on each
rank's last micro-batch; ranks with fewer (packed) micro-batches run zero-weight ones, as the
PPO update does.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from ds_ppo.config import Config, job_accum_steps
from ds_ppo.data.prompts import PromptSampler
from ds_ppo.engine import dist, lora
from ds_ppo.engine.checkpoint import TrainerState, find_resume, load_checkpoint, read_state
from ds_ppo.engine.checkpoint_files import verify_model_paths
from ds_ppo.engine.dist import init_distributed
from ds_ppo.errors import ConfigError, Diverged
from ds_ppo.metrics import Accumulator
from ds_ppo.run.log_setup import quiet_libraries, setup_logging
from ds_ppo.run.loop import TrainResult, _log_ds_configs, _open_tracker, _seed_everything
from ds_ppo.run.preemption import Preempted, StopRequests
from ds_ppo.run.progress import Eta, format_duration
from ds_ppo.run.rundir import lock_output_dir, start_metrics_log
from ds_ppo.run.saves import checkpoint_now, finish

log = logging.getLogger("ds_ppo")


class Job(Protocol):
    """What a supervised job supplies to `run_job` (sft/job.py, rm/job.py)."""

    name: str  # the config section and the command: sft or rm
    model_class: str  # the transformers class its export loads with

    def load(self, cfg: Config, tokenizer, split: str | None = None) -> Any: ...
    def packed(self, cfg: Config) -> bool: ...
    def micro_batches(self, cfg: Config, data, rows: list[int], packed: bool
                      ) -> list[list[int]]: ...
    def count(self, data, rows: list[int]) -> float: ...
    def loss(self, cfg: Config, role, data, rows: list[int], pad_id: int,
             packed: bool = False): ...
    def eval_metrics(self, m: dict[str, float]) -> dict[str, float]: ...
    def progress(self, m: dict[str, float]) -> str: ...


def total_steps(section, num_rows: int) -> int:
    """Optimizer steps of the run: `steps`, else epochs x whole global batches per epoch."""
    if section.steps is not None:
        return section.steps
    return section.epochs * max(1, num_rows // section.batch_size)


def run_job(cfg: Config, job: Job) -> TrainResult:
    """Train the job's model as configured; resumes from output_dir's latest checkpoint when
    resume=auto (on the same world size)."""
    from ds_ppo.engine.supervised import init_job_engines

    quiet_libraries(cfg.log_level)
    device = init_distributed(cfg.dist_timeout_minutes)
    setup_logging(cfg.log_level)
    _seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    lock_output_dir(out)
    section = getattr(cfg, job.name)

    # step 0. data, then the model (a bad dataset fails before any model loads; an export of
    # ours it starts from is checked before its tokenizer loads)
    verify_model_paths({"policy.path": cfg.policy.path}, cfg.checkpoint.verify)
    tokenizer, data, eval_data = _load_data(cfg, job, out)
    total = total_steps(section, len(data))
    resume_from = find_resume(cfg.output_dir, cfg.resume, cfg.checkpoint.verify)
    tracker = _open_tracker(cfg, resume_from)
    engines = init_job_engines(cfg, job.name, tokenizer, device, total)
    _log_ds_configs(tracker, engines, resumed=resume_from is not None)
    state = _start_or_resume(cfg, job.name, engines, resume_from)
    state.mlflow_run_id = tracker.run_id
    sampler = PromptSampler(len(data), section.batch_size, dist.rank(), dist.world_size(),
                            cfg.seed, shuffle=cfg.data.shuffle)
    result = TrainResult(output_dir=str(out), mlflow_run_id=tracker.run_id,
                         last_checkpoint=str(resume_from) if resume_from is not None else None)
    eta, status = Eta(), "FAILED"
    with StopRequests(cfg.checkpoint.save_on_signal) as stop:
        try:
            for step in range(state.iteration + 1, total + 1):
                t_step = time.perf_counter()
                # step 1. one optimizer step on the step's global batch
                acc = Accumulator()
                train_step(job, cfg, engines, data, sampler.indices(step - 1), acc,
                           tokenizer.pad_token_id)
                metrics = _step_metrics(job, acc, engines, t_step,
                                         (step - 1) * section.batch_size // len(data))
                # step 2. evaluation (every eval_every steps and after the last)
                if eval_data is not None and (step == total or (
                        section.eval_every and step % section.eval_every == 0)):
                    metrics.update(evaluate(job, cfg, engines, eval_data, tokenizer.pad_token_id))
                # step 3. report: progress line, metrics.jsonl, MLflow
                _report(cfg, job, tracker, metrics, step, total, eta, out)
                result.history.append(metrics)
                _stop_if_diverged(job, metrics, step, result.last_checkpoint)
                state.iteration = step
                # step 4. checkpoint; a scheduler's stop request
                saved = bool(cfg.checkpoint.every) and step % cfg.checkpoint.every == 0
                if saved:
                    result.last_checkpoint = checkpoint_now(cfg, out, engines, state, tokenizer)
                signum = stop.agreed(device)
                if signum:
                    if not saved:
                        result.last_checkpoint = checkpoint_now(cfg, out, engines, state, tokenizer)
                    raise Preempted(signum, step, result.last_checkpoint)
            result.last_checkpoint, result.export_dir = finish(
                cfg, engines, state, tokenizer, result.last_checkpoint, job.model_class)
            status = "FINISHED"
        except (KeyboardInterrupt, Preempted):
            status = "KILLED"
            raise
        finally:
            tracker.close(status)
    return result


# ------------------------------------------------------------------------- start-up
def _load_data(cfg: Config, job: Job, out: Path):
    from ds_ppo.data.supervised import format_stats
    from ds_ppo.data.tokenizer import load_policy_tokenizer

    tokenizer = load_policy_tokenizer(cfg, out)
    data = job.load(cfg, tokenizer)
    log.info("%s rows, split %s: %s", job.name, cfg.data.split, format_stats(data.stats))
    eval_data = None
    if cfg.data.eval_split is not None:
        eval_data = job.load(cfg, tokenizer, cfg.data.eval_split)
        log.info("%s evaluation rows, %s: %s", job.name, cfg.data.eval_split,
                 format_stats(eval_data.stats))
    return tokenizer, data, eval_data


def _start_or_resume(cfg: Config, job: str, engines, path: Path | None) -> TrainerState:
    world = dist.world_size()
    if path is None:
        start_metrics_log(cfg.output_dir, None)
        return TrainerState(world_size=world, seed=cfg.seed, job=job,
                            lora_bases=lora.base_record(engines.lora_bases))
    saved = read_state(path)
    if saved.job != job:
        raise ConfigError(f"cannot resume from {path}: it is a checkpoint of `ds-ppo "
                          f"{'train' if saved.job == 'ppo' else saved.job}`, not of `ds-ppo "
                          f"{job}`; use another output_dir")
    if saved.world_size != world:
        raise ConfigError(f"{path} was saved on world size {saved.world_size}; a supervised job "
                          f"resumes on the same world size (this one: {world})")
    lora.check_base(saved.lora_bases, engines.lora_bases, path)
    state = load_checkpoint(path, engines)
    changed = engines.policy.apply_optimizer_config(cfg.policy)
    if changed:
        log.info("optimizer settings from the config, not the checkpoint: %s", ", ".join(changed))
    start_metrics_log(cfg.output_dir, state.iteration)
    log.info("resumed from %s (step %d)", path, state.iteration)
    return state


# ---------------------------------------------------------------------------- one step
def train_step(job: Job, cfg: Config, engines, data, rows: list[int], acc: Accumulator,
               pad_id: int) -> None:
    """One optimizer step on this rank's `rows` of the global batch (module docstring: the
    loss normalisation); adds the micro-batches' statistics to `acc` (sums, counts)."""
    world = dist.world_size()
    scale = float(world * job_accum_steps(cfg, job.name, world))
    packed = job.packed(cfg)
    divisor = max(float(dist.all_reduce_sum(torch.tensor([job.count(data, rows)],
                                                         dtype=torch.float64))[0]), 1.0)
    mine = job.micro_batches(cfg, data, rows, packed)
    steps = len(mine)
    if packed:  # the most micro-batches of any rank: the others idle to keep step
        steps = int(dist.all_reduce_max(torch.tensor([float(steps)], dtype=torch.float64))[0])
    lengths = data.lengths()
    shortest = min(rows, key=lengths.__getitem__)
    engines.policy.train()
    for k in range(steps):
        batch = mine[k] if k < len(mine) else [shortest]
        loss, stats = job.loss(cfg, engines.policy, data, batch, pad_id, packed)
        weight = scale / divisor if k < len(mine) else 0.0
        engines.policy.backward_step(loss * weight, boundary=k == steps - 1)
        if k < len(mine):
            for name, (total, count) in stats.items():
                acc.add_mean(name, float(total), count)
    norm = engines.policy.grad_norm()
    if norm is not None:
        acc.add_replicated("grad_norm", norm)


@torch.no_grad()
def evaluate(job: Job, cfg: Config, engines, data, pad_id: int) -> dict[str, float]:
    """The job's statistics on the first data.eval_size evaluation rows (rounded down to a
    multiple of the world size; rank r takes every world-th row), as `eval/<name>`, reduced
    across ranks. Padded micro-batches; every rank runs the same number (ZeRO-3 forwards are
    collective)."""
    world = dist.world_size()
    n = max(world, min(len(data), cfg.data.eval_size) // world * world)
    rows = [i for i in range(n) if i % world == dist.rank() and i < len(data)]
    mine = job.micro_batches(cfg, data, rows, packed=False)
    steps = int(dist.all_reduce_max(torch.tensor([float(len(mine))], dtype=torch.float64))[0])
    acc = Accumulator()
    engines.policy.eval()
    for k in range(steps):
        _, stats = job.loss(cfg, engines.policy, data, mine[min(k, len(mine) - 1)], pad_id)
        if k < len(mine):
            for name, (total, count) in stats.items():
                acc.add_mean(f"eval/{name}", float(total), count)
    engines.policy.train()
    m = acc.reduce()
    m.update(job.eval_metrics(m))
    return m


def _step_metrics(job: Job, acc: Accumulator, engines, t_step: float, epoch: int
                  ) -> dict[str, float]:
    """The step's statistics reduced across ranks (docs/METRICS.md): `loss/<job>` and
    `<job>/<name>` (global means, `<job>/grad_norm` among them), `lr/<job>`, `<job>/epoch`,
    `time/step_s` (the slowest rank's)."""
    acc.add_max("time/step_s", time.perf_counter() - t_step)
    m = acc.reduce()
    out = {(f"loss/{job.name}" if k == "loss" else k if "/" in k else f"{job.name}/{k}"): v
           for k, v in m.items()}
    out[f"lr/{job.name}"] = engines.policy.lr()
    out[f"{job.name}/epoch"] = float(epoch)
    return out


def _report(cfg: Config, job: Job, tracker, metrics: dict[str, float], step: int, total: int,
            eta: Eta, out: Path) -> None:
    """Rank 0: metrics.jsonl (always), MLflow, and every log_every steps a progress line."""
    if not dist.is_main():
        return
    eta.tick(step, metrics["time/step_s"])
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": step, **metrics}) + "\n")
    tracker.log_metrics(metrics, step=step)
    if step % cfg.log_every == 0 or step == total:
        evals = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))
        print(f"{job.name} step {step:>5}/{total} | {job.progress(metrics)} "
              f"| lr {metrics[f'lr/{job.name}']:.2e} | step {metrics['time/step_s']:.2f}s "
              + (f"| {evals} " if evals else "")
              + f"| eta {format_duration(eta.left(total - step))}", flush=True)


def _stop_if_diverged(job: Job, metrics: dict[str, float], step: int, last: str | None) -> None:
    """Stop (every rank alike: the metrics are reduced) before a non-finite loss or gradient
    norm can be saved over good checkpoints."""
    bad = {k: metrics[k] for k in (f"loss/{job.name}", f"{job.name}/grad_norm")
           if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        where = (f"the last checkpoint, {last}, was saved before it" if last
                 else "no checkpoint was saved before it")
        raise Diverged(f"step {step}: {', '.join(f'{k} = {v}' for k, v in bad.items())}: "
                       f"training diverged and this step's weights are not saved; {where}. "
                       "Resume from a checkpoint with a lower policy.lr or gradient clipping "
                       "(policy.max_grad_norm).")
