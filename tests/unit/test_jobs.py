"""The jobs layer (ds_ppo/jobs/): the driver calls only what the `Job` protocol declares, every
registered job has all of it, and the command line makes its training commands from the
registry's rows, so a job registered in a test gets its command, checks and run from its row."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ds_ppo.cli import build_parser, main
from ds_ppo.jobs import JOBS, Job, JobSpec, register

DRIVER = Path(__file__).resolve().parents[2] / "ds_ppo" / "run" / "driver.py"


def _declared() -> set[str]:
    """The members of `Job`: its methods and its annotated attributes."""
    methods = {n for n, v in vars(Job).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods | set(Job.__annotations__)


def driver_calls(source: str) -> set[str]:
    """Every attribute the driver's code reads of a name `job` (`job.step`, `job.unit`, ...)."""
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "job"}


def test_the_driver_calls_only_what_the_job_protocol_declares():
    calls = driver_calls(DRIVER.read_text())
    assert len(calls) > 15, calls  # the scan sees the driver's calls
    assert calls - _declared() == set()


def test_the_scan_sees_an_undeclared_call():
    assert driver_calls("def run(cfg, job):\n    job.serve(cfg)\n    job.warm_up()\n") == {
        "serve", "warm_up"}
    assert {"warm_up"} - _declared() == {"warm_up"}


def test_every_registered_job_has_every_method_of_the_protocol():
    """The built-in jobs' classes (imported as the rows' `make` would) have each method."""
    from ds_ppo.jobs.supervised.training import Supervised
    from ds_ppo.ppo.train_job import PPOJob

    methods = {n for n, v in vars(Job).items() if inspect.isfunction(v) and not n.startswith("_")}
    for cls in (PPOJob, Supervised):
        assert sorted(m for m in methods if not callable(getattr(cls, m, None))) == [], cls
    assert [s.command for s in JOBS.values()] == ["train", "sft", "rm", "dpo"]
    assert {s.name for s in JOBS.values()} == {"ppo", "sft", "rm", "dpo"}


@pytest.fixture
def toy_row():
    """A job that is not built in: its row alone, registered for the test (and removed)."""
    seen = {}

    def check(cfg, world, dry_run):
        seen["check"] = (world, dry_run)

    def make(cfg):
        seen["made"] = cfg.seed
        raise SystemExit(0)  # stands where the driver would run the job

    register(JobSpec(name="toy", command="toy", help="a toy job of the tests", example="seed=3",
                     configure=lambda cfg: cfg, check=check, finished=lambda cfg: None,
                     make=make))
    try:
        yield seen
    finally:
        del JOBS["toy"]


def test_a_registered_job_gets_its_command_checks_and_run(toy_row, capsys, tmp_path):
    assert "a toy job of the tests" in build_parser().format_help()
    assert main(["toy", "--dry-run", "--world-size", "2", f"output_dir={tmp_path}"]) == 0
    assert toy_row == {"check": (2, True)}
    assert "config OK for world size 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["toy", "seed=7", f"output_dir={tmp_path}"])
    assert toy_row == {"check": (1, False), "made": 7}
    assert "toy" in build_parser().parse_args(["plan", "--job", "toy"]).job


def test_a_row_may_not_take_another_jobs_name_or_command(toy_row):
    with pytest.raises(ValueError, match="clashes"):
        register(JobSpec(name="other", command="train", help="", example="", configure=None,
                         check=None, finished=None, make=None))
