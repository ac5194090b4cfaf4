"""A scheduler's stop request loses no finished iteration: SIGTERM / SIGUSR1 make `ds-ppo train`
finish the iteration, save a checkpoint and exit 128 + the signal; the same command resumes.
Ctrl-C (SIGINT) does the same; a second Ctrl-C aborts at once. A SIGTERM during a reward call,
an environment call or a decode gives it up and exits 143 at once, without a save."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import SMALL as BASE
from conftest import clean_env, deepspeed_cmd, free_port, read_metrics, run_cli
from ds_ppo.run.preemption import StopRequests

SMALL = [*BASE, "checkpoint.every=0"]  # only the stop request saves


def _start(cmd: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=clean_env(PYTHONUNBUFFERED="1", **env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 300) -> list[str]:
    """stdout lines up to the first containing `text` (the run keeps going)."""
    seen, t0 = [], time.time()
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return seen
        assert time.time() - t0 < timeout, "".join(seen[-20:])
    raise AssertionError(f"exited before {text!r}:\n{''.join(seen[-30:])}\n{proc.stderr.read()}")


def _saved_iteration(out: Path) -> int:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    state = json.loads((out / "checkpoints" / latest / "trainer_state.json").read_text())
    return state["iteration"]


# SIGTERM to itself while iteration 2 is in its update (outside any reward call, environment
# call or decode: that iteration finishes and is saved)
SIGTERM_IN_THE_UPDATE = '''
import os
import signal
import threading
import time

calls = []


def _in_the_update():
    from ds_ppo import watchdog

    while not any(phase.name == "update" for phase in list(watchdog.current()._stack)):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGTERM)


def score(prompts, responses):
    calls.append(1)
    if len(calls) == 2 and os.path.exists("armed"):
        os.remove("armed")
        threading.Thread(target=_in_the_update, daemon=True).start()
    return [float(len(r)) for r in responses]
'''


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    (tmp_path / "sigterm_reward.py").write_text(SIGTERM_IN_THE_UPDATE)
    (tmp_path / "armed").touch()
    out = tmp_path / "out"
    args = ["train", *SMALL, f"output_dir={out}", "reward.function=sigterm_reward:score",
            "reward.stream=false"]
    proc = _start([sys.executable, "-m", "ds_ppo", *args, "iterations=500"], tmp_path)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert _saved_iteration(out) == 2
    assert "stopped by SIGTERM after iteration 2" in stderr
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2]
    # the same command (with a nearer end) resumes after the saved iteration
    run_cli([*args, "iterations=4"], cwd=tmp_path, timeout=600)
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_sigusr1_to_one_rank_stops_both_at_the_same_iteration(tmp_path):
    """Slurm's advance notice may reach one rank first: the ranks agree after each iteration,
    so both save the same checkpoint and stop (no rank left waiting in a collective)."""
    out = tmp_path / "out"
    launcher = _start([*deepspeed_cmd(2, free_port()), "--module", "ds_ppo", "train", *SMALL,
                       f"output_dir={out}", "iterations=500"], tmp_path)
    _wait_for(launcher, "iter    2/500")
    ranks = {p.environ().get("RANK"): p for p in psutil.Process(launcher.pid).children(True)
             if p.environ().get("RANK") is not None}
    assert set(ranks) == {"0", "1"}, ranks
    ranks["1"].send_signal(signal.SIGUSR1)
    stdout, stderr = launcher.communicate(timeout=300)
    n = _saved_iteration(out)
    assert launcher.returncode != 0
    assert f"stopped by SIGUSR1 after iteration {n}" in stdout + stderr
    assert [r["iteration"] for r in read_metrics(out)] == list(range(1, n + 1))
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert len(list((ckpt / "rng").iterdir())) == 2  # both ranks wrote their part


HANGS_ON_SECOND_CALL = '''
import threading
calls = []


def score(prompts, responses):
    calls.append(1)
    if len(calls) == 2:
        threading.Event().wait()  # never returns
    return [float(len(r)) for r in responses]
'''


def test_hung_reward_function_stops_the_run_with_the_last_iteration_saved(tmp_path):
    """A reward function that never returns (iteration 2): after reward.timeout_s the run saves
    iteration 1, says so and exits 2, although the hung call never ends."""
    (tmp_path / "hang_reward.py").write_text(HANGS_ON_SECOND_CALL)
    out = tmp_path / "out"
    t0 = time.time()
    proc = run_cli(["train", *SMALL, f"output_dir={out}", "iterations=3",
                    "reward.function=hang_reward:score", "reward.timeout_s=5"], cwd=tmp_path,
                   env=clean_env(PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}"),
                   check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "reward.function = 'hang_reward:score' did not return within reward.timeout_s = 5 s" \
        in proc.stderr
    assert "run the same command again to resume" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _saved_iteration(out) == 1
    assert [r["iteration"] for r in read_metrics(out)] == [1]
    assert time.time() - t0 < 250


def test_ctrl_c_saves_like_sigterm(tmp_path):
    """Through the console script a user runs: the first Ctrl-C finishes the iteration, saves
    and exits 130 with the SIGTERM message."""
    exe = shutil.which("ds-ppo")
    assert exe, "the ds-ppo console script is not on PATH (pip install -e .)"
    out, extensions = tmp_path / "out", tmp_path / "torch_extensions"
    proc = _start([exe, "train", *SMALL, f"output_dir={out}", "iterations=500"], tmp_path,
                  TORCH_EXTENSIONS_DIR=str(extensions))
    seen = _wait_for(proc, "iter    2/500")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    stdout = "".join(seen) + stdout
    # the progress line: time left from recent iterations; a line per save; no library bars
    assert "| eta " in seen[-1], seen[-1]
    assert f"saved checkpoint {out / 'checkpoints'}" in stdout
    assert "Writing model shards" not in stdout + stderr
    assert "Setting accelerator" not in stdout + stderr
    # a cold extension cache: nothing was built (DeepSpeed's CPU shm comm op is skipped)
    assert not extensions.exists() or not any(extensions.iterdir())
    assert proc.returncode == 130, stderr[-3000:]
    n = _saved_iteration(out)
    assert f"stopped by SIGINT after iteration {n}; checkpoint " in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert [r["iteration"] for r in read_metrics(out)] == list(range(1, n + 1))



def test_a_second_ctrl_c_aborts_at_once():
    """In-process (a subprocess would race the iteration's end): the first SIGINT only sets the
    flag, the second raises KeyboardInterrupt; the previous handler comes back afterwards."""
    previous = signal.getsignal(signal.SIGINT)
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous


def test_an_interrupt_outside_the_loop_is_one_line_and_exit_130(monkeypatch, capsys):
    import ds_ppo.trainer
    from ds_ppo.cli import main

    def interrupted(cfg, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(ds_ppo.trainer, "run_job", interrupted)
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert err == "ds-ppo: interrupted; nothing saved after the last checkpoint\n"


# Hangs once the test creates `hang_now` (on every rank, or on HANG_RANK only), after touching
# `hanging` so the test knows the call is under way.
HANGS_WHEN_ASKED = '''
import os
import pathlib
import threading


def _hang():
    if os.path.exists("hang_now") and os.environ.get("RANK", "0") == os.environ.get(
            "HANG_RANK", os.environ.get("RANK", "0")):
        pathlib.Path("hanging").touch()
        threading.Event().wait()  # never returns


def score(prompts, responses):
    _hang()
    return [float(len(r)) for r in responses]
'''

HANGING_ENV = '''
from ds_ppo.envs.calculator import Calculator
from hang_reward import _hang


class Hanging(Calculator):
    def step(self, action):
        _hang()
        return super().step(action)
'''

# checkpoints every iteration: the resume point is the last one before the hang
EVERY = [*BASE, "checkpoint.every=1", "iterations=500"]


def _hang_then_sigterm(proc: subprocess.Popen, cwd: Path, signalled=lambda proc: proc
                       ) -> tuple[float, str, str]:
    """After iteration 1, make the next reward or environment call hang; SIGTERM to
    `signalled(proc)` once it hangs. The seconds from the signal to the exit, and the
    output."""
    seen = _wait_for(proc, "iter    1/500")
    (cwd / "hang_now").touch()
    t0 = time.time()
    while not (cwd / "hanging").exists():
        assert proc.poll() is None and time.time() - t0 < 300, "the call did not hang"
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the hung call
    signalled(proc).send_signal(signal.SIGTERM)
    t0 = time.time()
    stdout, stderr = proc.communicate(timeout=120)
    return time.time() - t0, "".join(seen) + stdout, stderr


def _abandoned_at_the_last_checkpoint(out: Path, stderr: str, phase: str) -> int:
    n = _saved_iteration(out)
    assert f"SIGTERM during {phase}: abandoned; resume from checkpoint iteration {n} " \
        in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [r["iteration"] for r in read_metrics(out)] == list(range(1, n + 1))
    return n


def test_sigterm_abandons_a_hung_reward_call_and_the_run_resumes(tmp_path):
    """reward.timeout_s = 600: SIGTERM gives the hung call up and exits 143 at once, without
    saving; the last checkpoint (before the hang) is where the same command resumes."""
    (tmp_path / "hang_reward.py").write_text(HANGS_WHEN_ASKED)
    out = tmp_path / "out"
    args = ["train", *EVERY, f"output_dir={out}", "reward.function=hang_reward:score",
            "reward.timeout_s=600"]
    proc = _start([sys.executable, "-m", "ds_ppo", *args], tmp_path)
    seconds, stdout, stderr = _hang_then_sigterm(proc, tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert seconds < 20, seconds
    n = _abandoned_at_the_last_checkpoint(out, stderr, "reward call")
    (tmp_path / "hang_now").unlink()
    run_cli([*args[:-2], f"iterations={n + 1}", "reward.function=hang_reward:score",
             "reward.timeout_s=600"], cwd=tmp_path, timeout=600)
    assert [r["iteration"] for r in read_metrics(out)] == list(range(1, n + 2))


def test_sigterm_abandons_a_hung_environment_step(tmp_path):
    (tmp_path / "hang_reward.py").write_text(HANGS_WHEN_ASKED)
    (tmp_path / "hang_env.py").write_text(HANGING_ENV)
    out = tmp_path / "out"
    proc = _start([sys.executable, "-m", "ds_ppo", "train", "--config", "calculator", *EVERY,
                   f"output_dir={out}", "env.function=hang_env:Hanging", "env.timeout_s=600",
                   "ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=2",
                   "ppo.rollout_batch_size=8", "policy.arch.hidden_size=64",
                   "policy.arch.intermediate_size=128"], tmp_path)
    seconds, stdout, stderr = _hang_then_sigterm(proc, tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert seconds < 20, seconds
    _abandoned_at_the_last_checkpoint(out, stderr, "environment step")


def test_sigterm_to_the_rank_in_a_hung_reward_call_stops_both(tmp_path):
    """Rank 1's reward call hangs and only rank 1 gets SIGTERM: the ranks agree on every
    reward call's outcome, so rank 0 (waiting for that agreement) stops with it, at once."""
    (tmp_path / "hang_reward.py").write_text(HANGS_WHEN_ASKED)
    out = tmp_path / "out"
    launcher = _start([*deepspeed_cmd(2, free_port()), "--module", "ds_ppo", "train", *EVERY,
                       f"output_dir={out}", "reward.function=hang_reward:score",
                       "reward.timeout_s=600"], tmp_path, HANG_RANK="1")

    def rank_1(launcher):
        return next(p for p in psutil.Process(launcher.pid).children(True)
                    if p.environ().get("RANK") == "1")
    seconds, stdout, stderr = _hang_then_sigterm(launcher, tmp_path, rank_1)
    # the launcher exits with the first failed rank's code
    assert launcher.returncode == 128 + signal.SIGTERM, (stdout + stderr)[-3000:]
    assert seconds < 20, seconds
    n = _saved_iteration(out)
    line = f"SIGTERM during reward call: abandoned; resume from checkpoint iteration {n} "
    assert (stdout + stderr).count(line) == 2, (stdout + stderr)[-3000:]  # one per rank
