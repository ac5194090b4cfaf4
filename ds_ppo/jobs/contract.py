"""The one interface between the run driver (run/driver.py) and a training job, and the registry
of jobs. A job is its module or folder (jobs/ppo/ over ppo/, jobs/supervised/ over sft/ and
rm/), a config section, and one `JobSpec` row in `JOBS`: the command line makes its training
commands from the rows, the driver calls only what `Job` declares (a test reads the driver's
calls against it), and nothing outside a job's own files names a job by its string.

torchtune's recipe interface is the model: a job supplies its data, its engines, one unit of
training and what its checkpoints hold; the run around it (lock, tracking, resume, watchdog,
signals, saves, export) is the driver's. No torch at import: `--dry-run` stays light.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from ds_ppo.config import Config
    from ds_ppo.engine.checkpoint import TrainerState
    from ds_ppo.run.driver import Run


class Job(Protocol):
    """A training job as the driver sees it. Its unit (a PPO iteration, an optimizer step) is
    what `checkpoint.every`, the progress lines and `metrics.jsonl` count."""

    name: str  # its registry row's name: what checkpoints record (`TrainerState.job`)
    unit: str  # "iteration" or "step": the word messages use
    total_key: str  # the setting that counts the run's units (iterations, sft.steps, ...)
    model_class: str  # the transformers class the final export loads with
    registers: bool  # its exports go to the MLflow model registry (tracking.register_*)
    model_keys: tuple[str, ...]  # the settings naming models it loads (our exports are verified)
    watched: tuple[str, ...]  # metrics that are never NaN or infinite while training is healthy
    diverged_fix: str  # what to change when one of them is

    def known_total(self, cfg: Config) -> int | None:
        """The run's units from the config alone (None: they depend on the data)."""

    def serve(self, cfg: Config, device: torch.device) -> None:
        """The whole run of a rank that only generates (ppo.placement = split); a job with no
        such ranks refuses."""

    def load_data(self, cfg: Config, out: Path) -> tuple[Any, int]:
        """The tokenizer and the run's units; data problems fail here, before any model."""

    def check_checkpoint(self, path: Path) -> None:
        """Refuse a checkpoint this job cannot continue (another job's, another estimator's)."""

    def build(self, cfg: Config, device: torch.device, universal: bool,
              autoep: frozenset[str] = frozenset()):
        """The engines (`universal`: they will load a checkpoint of another world size; `autoep`:
        trained roles built with AutoEP's layers even at expert_parallel_size 1)."""

    def trained_roles(self) -> tuple[str, ...]:
        """The roles whose optimizer settings a resume takes from the config."""

    def zero_stages(self, cfg: Config, device: torch.device) -> dict[str, int]:
        """Each trained role's ZeRO stage in this run (`zero_stage: auto` resolved)."""

    def fresh_state(self, run_engines) -> TrainerState:
        """The state of a run that starts from scratch (seeds its sampling streams)."""

    def resumed(self, state: TrainerState) -> None:
        """Take the job's own parts of a loaded checkpoint's state (a KL controller, ...)."""

    def in_flight(self) -> Any:
        """This rank's work in flight at a unit boundary, for a checkpoint to hold beside the
        engines and the state (buffered rollouts, their random stream); None: nothing."""

    def in_flight_problem(self, saved: Any, iteration: int) -> str | None:
        """What in `saved` (this rank's `in_flight` of a checkpoint of `iteration`) is out of
        range for this job (words after "holds"), or None: checked before `restore_in_flight`,
        whether or not a manifest verified the file."""

    def restore_in_flight(self, saved: Any) -> None:
        """Before `start`: the `in_flight` a resumed checkpoint holds for this rank (None: it
        holds none, or was saved at another world size)."""

    def start(self, run: Run) -> None:
        """Everything the steps share, once the engines and the state exist."""

    def step(self, run: Run, unit: int) -> dict[str, float]:
        """Unit `unit` (1-based): train and evaluate when due; its metrics, reduced across
        ranks. Leaves `run.state` ready to be saved as of this unit but for what the driver
        sets (`iteration`, `alarms`)."""

    def report(self, run: Run, unit: int, metrics: dict[str, float]) -> None:
        """The unit's progress line, metrics.jsonl and MLflow (rank 0)."""


@dataclass(frozen=True)
class JobSpec:
    """One training job's row: its command, the checks before a start and the job itself. Each
    hook imports what it needs when called (`ds-ppo --help` and `--dry-run` import no torch)."""

    name: str  # the registry key and what its checkpoints record (TrainerState.job)
    command: str  # the `ds-ppo` subcommand that runs it
    help: str  # its line in `ds-ppo --help`
    example: str  # an override its --help shows
    configure: Callable[[Config], Config]  # the config the job runs with (a new tree)
    check: Callable[[Config, int, bool], None]  # (cfg, world size, dry run): ConfigError or
    # warnings on stderr, every check that needs no model; with dry run also local paths
    finished: Callable[[Config], str | None]  # what to print when a rerun has nothing left
    # (before torch imports); None: a run to start or resume
    make: Callable[[Config], Job]  # the job the driver runs


JOBS: dict[str, JobSpec] = {}  # name -> row, in the order `ds-ppo --help` lists them


def register(spec: JobSpec) -> JobSpec:
    """Add a job's row (its module does, when ds_ppo.jobs imports it). A name or command taken
    by another row is refused."""
    taken = [s.name for s in JOBS.values() if spec.command == s.command or spec.name == s.name]
    if taken:
        raise ValueError(f"job {spec.name!r} (command {spec.command!r}) clashes with {taken}")
    JOBS[spec.name] = spec
    return spec


def by_command(command: str) -> JobSpec:
    """The row whose `ds-ppo` subcommand is `command`."""
    return next(s for s in JOBS.values() if s.command == command)
