"""Shared helpers: run ds_ppo as users do (a subprocess, or the real `deepspeed` launcher)."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# a one-process stand-in for a DeepSpeedEngine (the tools/ scripts measure the stages with it)
from ds_ppo.bench.stand_ins import OneProcessEngine as FakeEngine  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


# A smaller variant of the tiny default for the resume, crash and preemption tests (same code
# paths as the default run, fewer sequences).
SMALL = ["tracking.enabled=false", "ppo.rollout_batch_size=16", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=4", "generation.max_new_tokens=8", "checkpoint.keep_last=2",
         "checkpoint.export_at_end=false"]


def pytest_configure(config):
    """xdist workers share the machine's cores: each takes cores / workers torch threads (as
    ds_ppo shares a node's cores among CPU ranks) instead of one per core each, which made
    in-process tests fight over the cores. Subprocesses get OMP_NUM_THREADS=1 (clean_env)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(session, config, items):
    """A full run (`pytest` with no paths: the testpaths) must collect every tests/**/test_*.py:
    a folder left out by norecursedirs (pytest's default skips any folder named dist) or a
    file that collects nothing would otherwise pass unseen."""
    narrowed = [getattr(config.option, name, None)
                for name in ("keyword", "markexpr", "deselect", "lf", "stepwise")]
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or any(narrowed):
        return
    collected = {Path(item.path).resolve() for item in items}
    missing = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                     if f.resolve() not in collected)
    if missing:
        raise pytest.UsageError(f"these test files were not collected: {missing}")


@pytest.fixture(scope="session", autouse=True)
def _session_working_directory(tmp_path_factory):
    """Module and session fixtures (launcher jobs shared by a file's tests) start in an empty
    directory too, not in the directory pytest was started from."""
    start = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("session_cwd"))
    yield
    os.chdir(start)


@pytest.fixture(autouse=True)
def _empty_working_directory(tmp_path_factory, monkeypatch):
    """Every test runs in an empty directory of its own: what the repository root holds (say
    the `outputs/` a user's `ds-ppo train` left there, as the README's first command does)
    must not change a result, and no test may write there."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny in-process models (`pytestmark =
    pytest.mark.usefixtures("one_thread")`): they gain nothing from intra-op threads, and beside
    the other xdist worker their spinning made such tests ~30x slower on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def rank_threads():
    """This process's torch threads set to those of a launched rank (clean_env's
    OMP_NUM_THREADS) while an in-process run is compared bit for bit with launched ones: the
    last bits of a CPU matmul depend on how many threads split it (on AMD EPYC, not on the
    Intel CPUs seen), so a run is only equal to one made with as many threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(clean_env()["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mask_from_lengths(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B,) long response lengths (tokens that count, EOS included) -> (B, T) bool prefix mask,
    the shape of every mask ds_ppo.algo.response_mask derives (a test helper)."""
    positions = torch.arange(T, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh user shell: no launcher variables, no MLflow URI."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "MLFLOW_TRACKING_URI", "CROSS_RANK", "CROSS_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


class _ForkServer:
    """This test process's tests/support/forkserver.py: `ds-ppo` commands as forked children
    of a process that imported the libraries once (started on first use, ended at exit)."""

    def __init__(self) -> None:
        self.env = clean_env()
        self.dir = Path(tempfile.mkdtemp(prefix="ds_ppo_forkserver_"))
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "support" / "forkserver.py")], cwd=self.dir,
            env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(self.dir / "server.err", "w"), text=True)
        if self._line(600) != "ready":
            raise RuntimeError("the fork server did not start:\n"
                               + (self.dir / "server.err").read_text()[-4000:])
        atexit.register(self.proc.kill)

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else None

    def run(self, args: list[str], cwd: Path, timeout: float,
            env: dict[str, str]) -> subprocess.CompletedProcess:
        out, err = self.dir / "out.txt", self.dir / "err.txt"
        self.proc.stdin.write(json.dumps({"args": args, "cwd": str(cwd), "env": env,
                                          "out": str(out), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        pid = int(self._line(60))
        code = self._line(timeout)
        if code is None:
            os.killpg(pid, signal.SIGKILL)
            self._line(60)
            raise subprocess.TimeoutExpired(["ds-ppo", *args], timeout, out.read_text(),
                                            err.read_text())
        return subprocess.CompletedProcess([sys.executable, "-m", "ds_ppo", *args], int(code),
                                           out.read_text(), err.read_text())


_FORK_SERVER: list[_ForkServer] = []

# Variables read when a command runs, never while importing (the fault injection of
# ds_ppo/engine/checkpoint/save_load.py, ppo/split.py and ppo/schedule.py; the tests' own
# environment functions): a forked command may have them set.
RUN_TIME_VARS = frozenset({"DS_PPO_FAULT", "FLAKY_ENV_FAIL"})


def _forkable(env: dict[str, str]) -> bool:
    """`env` is the fork server's (clean_env()) but for RUN_TIME_VARS."""
    base = clean_env()
    return all(env.get(k) == base.get(k) for k in (set(env) | set(base)) - RUN_TIME_VARS)


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None,
            check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m ds_ppo ARGS` in a process of its own: forked from a process that has imported
    the libraries already (tests/support/forkserver.py), or with `fresh` (or an environment
    other than `clean_env()` beyond RUN_TIME_VARS) a new interpreter, for tests of what happens
    while importing."""
    env = env or clean_env()
    if fresh or not _forkable(env):
        proc = subprocess.run([sys.executable, "-m", "ds_ppo", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    else:
        if not _FORK_SERVER or _FORK_SERVER[0].proc.poll() is not None:
            _FORK_SERVER[:] = [_ForkServer()]
        proc = _FORK_SERVER[0].run(args, cwd, timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"ds-ppo {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def deepspeed_cmd(num_ranks: int, port: int) -> list[str]:
    exe = shutil.which("deepspeed")
    assert exe, "the deepspeed launcher is not on PATH"
    return [exe, "--num_gpus", str(num_ranks), "--master_port", str(port)]


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO




def sigterm_after(step: int, monkeypatch) -> None:
    """A scheduler's SIGTERM seen by the run driver at the end of unit `step` (what
    StopRequests reports), with no signal sent."""
    import signal

    from ds_ppo.run import driver

    calls = {"n": 0}

    def agreed(self, device):
        calls["n"] += 1
        return signal.SIGTERM if calls["n"] == step else 0
    monkeypatch.setattr(driver.StopRequests, "agreed", agreed)
