"""`ds-ppo sft`, `ds-ppo rm` and `ds-ppo dpo` as jobs of the run driver (run/driver.py; their
registry rows: jobs/supervised/__init__.py, jobs/dpo/__init__.py): a `Task` (sft/task.py,
rm/task.py, jobs/dpo/task.py) supplies its rows, micro-batches, loss and any frozen model;
`Supervised` makes an optimizer step of it the driver's unit, with its evaluation and progress
line. The run around it (lock, MLflow, resume at any world size, watchdog, signals, checkpoints,
export) is the driver's, as for PPO.

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
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from ds_ppo import watchdog
from ds_ppo.config import Config, job_accum_steps
from ds_ppo.data.prompts import PromptSampler
from ds_ppo.engine import dist, lora
from ds_ppo.engine.checkpoint import TrainerState, read_state
from ds_ppo.errors import ConfigError
from ds_ppo.jobs.contract import JOBS
from ds_ppo.metrics import Accumulator
from ds_ppo.progress import Eta, format_duration

log = logging.getLogger("ds_ppo")


class Task(Protocol):
    """What a supervised job supplies (sft/task.py, rm/task.py, jobs/dpo/task.py)."""

    name: str  # the config section and the command: sft, rm or dpo
    model_class: str  # the transformers class its export loads with

    def add_frozen(self, cfg: Config, engines) -> None:
        """Add the frozen models its loss reads beside the trained one (dpo: the reference)."""

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


# a randomly initialised model trained for fewer optimizer steps than this learns no task
FEW_STEPS_FROM_RANDOM = 100


def few_steps_warning(cfg: Config, job: str, total: int, num_rows: int) -> str | None:
    """A warning when a supervised job trains a random-init `policy.arch` for fewer than
    FEW_STEPS_FROM_RANDOM optimizer steps (`<job>.epochs` over a small file gives a handful)."""
    section = getattr(cfg, job)
    if cfg.policy.arch is None or total >= FEW_STEPS_FROM_RANDOM:
        return None
    how = (f"{job}.steps = {section.steps}" if section.steps is not None else
           f"{job}.epochs = {section.epochs} over {num_rows} rows at {job}.batch_size = "
           f"{section.batch_size}")
    return (f"{job} trains a randomly initialised policy.arch for {total} optimizer steps "
            f"({how}): too few to learn a task; set {job}.steps (examples/my_run.yaml: 150 "
            "for sft) or start from a trained model (policy.path)")


class Supervised:
    """One optimizer step of a `Task` per unit (a jobs/contract.py `Job`)."""

    unit = "step"
    registers = False
    model_keys = ("policy.path",)

    def __init__(self, cfg: Config, task: Task) -> None:
        self.cfg, self.task = cfg, task
        self.name, self.model_class = task.name, task.model_class
        self.total_key = f"{task.name}.steps"
        self.section = getattr(cfg, task.name)
        self.watched = (f"loss/{task.name}", f"{task.name}/grad_norm")
        self.diverged_fix = ("Resume from a checkpoint with a lower policy.lr or gradient "
                             "clipping (policy.max_grad_norm).")

    # ------------------------------------------------------------------- start-up
    def known_total(self, cfg: Config) -> int | None:
        return self.section.steps

    def load_data(self, cfg: Config, out: Path):
        from ds_ppo.data.supervised_rows import format_stats
        from ds_ppo.data.tokenizer import load_policy_tokenizer

        name = self.name
        tokenizer = load_policy_tokenizer(cfg, out)
        self.data = self.task.load(cfg, tokenizer)
        log.info("%s rows, split %s: %s", name, cfg.data.split, format_stats(self.data.stats))
        self.eval_data = None
        if cfg.data.eval_split is not None:
            self.eval_data = self.task.load(cfg, tokenizer, cfg.data.eval_split)
            log.info("%s evaluation rows, %s: %s", name, cfg.data.eval_split,
                     format_stats(self.eval_data.stats))
        self.total = total_steps(self.section, len(self.data))
        warning = few_steps_warning(cfg, name, self.total, len(self.data))
        if warning and dist.rank() == 0:
            log.warning(warning)
        self.tokenizer, self.pad_id = tokenizer, tokenizer.pad_token_id
        return tokenizer, self.total

    def serve(self, cfg: Config, device: torch.device) -> None:
        raise ConfigError(f"ds-ppo {self.name} has no generation ranks: ppo.placement = split "
                          "applies to ds-ppo train only")

    def check_checkpoint(self, path: Path) -> None:
        saved = read_state(path)
        if saved.job != self.name:
            other = JOBS[saved.job].command if saved.job in JOBS else saved.job
            raise ConfigError(f"cannot resume from {path}: it is a checkpoint of `ds-ppo "
                              f"{other}`, not of `ds-ppo {self.name}`; use another output_dir")

    def build(self, cfg: Config, device: torch.device, universal: bool,
              autoep: frozenset[str] = frozenset()):
        from ds_ppo.engine.supervised import init_job_engines
        from ds_ppo.plan.fit import zero_stages

        engines = init_job_engines(
            cfg, self.name, self.tokenizer, device, self.total,
            zero_stages(cfg, device, universal, self.name), universal, autoep="policy" in autoep,
            scorer=self.task.model_class == "AutoModelForSequenceClassification")
        self.task.add_frozen(cfg, engines)
        return engines

    def trained_roles(self) -> tuple[str, ...]:
        return ("policy",)

    def zero_stages(self, cfg: Config, device: torch.device) -> dict[str, int]:
        from ds_ppo.plan.fit import zero_stages

        return zero_stages(cfg, device, job=self.name).stages

    def fresh_state(self, engines) -> TrainerState:
        return TrainerState(world_size=dist.world_size(), seed=self.cfg.seed, job=self.name,
                            sequence_parallel_size=dist.sp_size(),
                            lora_bases=lora.base_record(engines.lora_bases))

    def resumed(self, state: TrainerState) -> None:
        pass

    def in_flight(self) -> None:
        return None  # nothing runs between steps

    def in_flight_problem(self, saved, iteration: int) -> str | None:
        return None if saved is None else "work in flight, which a supervised job never saves"

    def restore_in_flight(self, saved) -> None:
        pass

    def start(self, run) -> None:
        self.sampler = PromptSampler(len(self.data), self.section.batch_size, dist.rank(),
                                     dist.world_size(), run.cfg.seed, shuffle=run.cfg.data.shuffle)
        self.eta = Eta()

    # ------------------------------------------------------------------- one step
    def step(self, run, step: int) -> dict[str, float]:
        cfg, engines, task, section = run.cfg, run.engines, self.task, self.section
        t_step = time.perf_counter()
        # one optimizer step on the step's global batch
        watchdog.at("update", step)
        acc = Accumulator()
        train_step(task, cfg, engines, self.data, self.sampler.indices(step - 1), acc,
                   self.pad_id)
        metrics = _step_metrics(task, acc, engines, t_step,
                                (step - 1) * section.batch_size // len(self.data))
        # evaluation (every eval_every steps and after the last)
        if self.eval_data is not None and (step == self.total or (
                section.eval_every and step % section.eval_every == 0)):
            watchdog.at("evaluation", step)
            metrics.update(evaluate(task, cfg, engines, self.eval_data, self.pad_id))
        return metrics

    def report(self, run, step: int, metrics: dict[str, float]) -> None:
        _report(run.cfg, self.task, run.tracker, metrics, step, self.total, self.eta, run.out)

# ---------------------------------------------------------------------------- one step
def train_step(job: Task, cfg: Config, engines, data, rows: list[int], acc: Accumulator,
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
        engines.policy.backward_step(loss * weight, boundary=k == steps - 1, aux=k < len(mine))
        watchdog.progress(k)
        if k < len(mine):
            for name, (total, count) in stats.items():
                acc.add_mean(name, float(total), count)
    total, count = engines.policy.take_aux_loss()  # a mixture-of-experts model's
    if count:
        acc.add_mean("moe_aux_loss", total, count)
    norm = engines.policy.grad_norm()
    if norm is not None:
        acc.add_replicated("grad_norm", norm)


@torch.no_grad()
def evaluate(job: Task, cfg: Config, engines, data, pad_id: int) -> dict[str, float]:
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


def _step_metrics(job: Task, acc: Accumulator, engines, t_step: float, epoch: int
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


def _report(cfg: Config, job: Task, tracker, metrics: dict[str, float], step: int, total: int,
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
