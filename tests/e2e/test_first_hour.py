"""What a new user meets first, through the installed `ds-ppo` console script: the README's
reward function example, paths checked by `--dry-run`, config errors on hostile input, progress
and log noise, credentials in tracking URIs, tokenizer paths and an unreachable hub."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import clean_env


def ds_ppo(args: list[str], cwd: Path, timeout: float = 60, **env: str
           ) -> subprocess.CompletedProcess:
    """The installed console script (not `python -m`, which puts the working directory on the
    import path by itself), with this checkout first on PYTHONPATH."""
    exe = shutil.which("ds-ppo")
    assert exe, "the ds-ppo console script is not on PATH (pip install -e .)"
    return subprocess.run([exe, *args], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------- reward function from cwd
def test_console_script_imports_the_reward_module_from_the_working_directory(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def exact_answer(prompts, responses, answer):\n"
        "    return [float(r.strip().endswith(a)) for r, a in zip(responses, answer)]\n")
    (tmp_path / "problems.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    proc = ds_ppo(["train", "--dry-run", "reward.function=my_rewards:exact_answer",
                   "data.path=problems.jsonl", "data.reward_keys=[answer]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "config OK" in proc.stdout
    # a module that is not there names the directory it was looked for in
    proc = ds_ppo(["train", "--dry-run", "reward.function=their_rewards:exact_answer",
                   "data.path=problems.jsonl", "data.reward_keys=[answer]"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "their_rewards" in proc.stderr and str(tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------ progress
def test_eta_is_the_mean_of_recent_iterations_times_those_left():
    from ds_ppo.progress import Eta, format_duration

    now = [100.0]
    eta = Eta(window=3, clock=lambda: now[0])
    eta.tick(1, 7.0)  # the first: its own duration
    assert eta.left(10) == 70.0
    for t in (102.0, 104.0, 110.0, 112.0):  # durations 2, 2, 6, 2: the last 3 count
        now[0] = t
        eta.tick(eta.iteration + 1, 99.0)
    assert eta.left(5) == (2 + 6 + 2) / 3 * 5
    now[0] = 500.0
    eta.tick(3, 4.0)  # a new (or resumed) run in the same process starts afresh
    assert eta.left(2) == 8.0
    assert [format_duration(s) for s in (0, 44.6, 200, 3599, 7500)] == [
        "0s", "45s", "3m20s", "59m59s", "2h05m"]


def test_progress_line_shows_a_per_token_kl_and_small_losses_in_scientific_notation(tmp_path):
    """kl/tok is kl/token_mean (TRL and verl print a per-token KL), not the per-sequence sum;
    a policy loss of a group estimator (mean advantage 0 by construction) does not print
    +-0.0000."""
    from ds_ppo.ppo.iteration_report import Reporter, ReportSettings
    from ds_ppo.progress import format_signed

    reporter = Reporter(ReportSettings(40, 1, 0, 0, "sync", 1024), None, tmp_path, None)
    metrics = {"score/mean": 0.5, "kl/sequence_mean": 1.2, "kl/token_mean": 0.1,
               "policy/entropy": 5.0, "loss/policy": -2.5e-5, "response/length_mean": 12.0,
               "time/generation_s": 1.0, "time/iteration_s": 2.0}
    reporter.eta.tick(1, 2.0)
    line = reporter.progress_line(metrics, 1)
    assert "| kl/tok +0.1000 |" in line and "+1.2" not in line
    assert "| pg -2.50e-05 |" in line
    assert [format_signed(x) for x in (0.0, -0.0, 0.0213, -0.00099, 12.5)] == [
        "+0.0000", "+0.0000", "+0.0213", "-9.90e-04", "+12.5000"]


def test_log_level_info_silences_library_bars_and_debug_keeps_them(tmp_path):
    import sys

    code = ("import logging, sys; from ds_ppo.run.log_setup import quiet_libraries; "
            "from transformers.utils import logging as hf; quiet_libraries(sys.argv[1]); "
            "r = logging.LogRecord('DeepSpeed', 30, '', 0, 'Setting accelerator to CPU.', (), "
            "None); print(hf.is_progress_bar_enabled(), logging.getLogger('DeepSpeed').filter(r))")
    for level, expected in (("info", "False False"), ("debug", "True True")):
        proc = subprocess.run([sys.executable, "-c", code, level], cwd=tmp_path, env=clean_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.split() == expected.split(), proc.stderr[-2000:]


# ------------------------------------------------------------------------- hostile input
_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
policy: {arch: {layers: *i}}
"""


@pytest.mark.parametrize("command", [["config"], ["train", "--dry-run"]])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, command):
    (tmp_path / "bomb.yaml").write_text(_BOMB)
    proc = ds_ppo([*command, "--config", "bomb.yaml"], cwd=tmp_path, timeout=30)
    assert proc.returncode == 2
    assert "bomb.yaml" in proc.stderr and "aliases" in proc.stderr
    assert len(proc.stderr) < 1000 and "Traceback" not in proc.stderr


def test_config_errors_print_no_unbounded_repr_of_the_input(tmp_path):
    proc = ds_ppo(["config", f"iterations=[{'1, ' * 5000}1]"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "iterations = [1, 1," in proc.stderr and len(proc.stderr) < 1000, proc.stderr[:2000]


# ------------------------------------------------------------------------ credentials
def test_credentials_in_mlflow_tracking_uri_are_never_printed(tmp_path):
    from conftest import SMALL, free_port

    uri = f"http://alice:SECRET@127.0.0.1:{free_port()}/?token=TOKEN"  # nothing listens there
    proc = ds_ppo(["train", *[a for a in SMALL if not a.startswith("tracking.")],
                   "iterations=1", f"output_dir={tmp_path / 'out'}"], cwd=tmp_path,
                  timeout=300, MLFLOW_TRACKING_URI=uri)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot use MLflow at http://***@127.0.0.1:" in proc.stderr
    assert "SECRET" not in proc.stdout + proc.stderr and "TOKEN" not in proc.stdout + proc.stderr


# ------------------------------------------------------------------------- dry-run paths
def test_dry_run_names_local_paths_that_do_not_exist(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    proc = ds_ppo(["train", "--dry-run", "data.path=prompts.jsonl", "policy.tokenizer=./tok",
                   "reward.function=null", "reward.model=Org/reward-model"],  # hub: unchecked
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = ds_ppo(["train", "--dry-run", "data.path=promts.jsonl", "policy.tokenizer=tok/",
                   "reference.path=/nonexistent/llama", "reward.function=null",
                   "reward.model=models/rm/v2",
                   "data.eval_split=held_out.csv"], cwd=tmp_path)
    assert proc.returncode == 2
    for key in ("data.path = 'promts.jsonl'", "reference.path = '/nonexistent/llama'",
                "reward.model = 'models/rm/v2'", "data.eval_split = 'held_out.csv'"):
        assert f"{key}: no such file or directory" in proc.stderr, proc.stderr
    assert "policy.tokenizer" not in proc.stderr and "Traceback" not in proc.stderr


def test_hub_names_and_local_paths():
    from ds_ppo.config.paths import is_hub_name, missing_local

    for spec in ("gpt2", "Qwen/Qwen2.5-0.5B", "Dahoas/rm-static", "org/name.v2"):
        assert is_hub_name(spec) and not missing_local(spec), spec
    for spec in ("/abs/dir", "./rel", "~/nope", "a/b/c", "dir/", "p.jsonl", "sp.model",
                 "../up", "org/../x"):
        assert not is_hub_name(spec) and missing_local(spec), spec
    assert not missing_local("builtin:tiny") and not missing_local(None)


# --------------------------------------------------------------------------- tokenizers
def _load_tokenizer(*specs: str, cwd: Path, **env: str
                    ) -> tuple[subprocess.CompletedProcess, float]:
    """load_tokenizer(spec) of each spec in one fresh process; each ConfigError on stderr."""
    import sys
    import time

    code = ("import sys\nfrom ds_ppo.data.tokenizer import load_tokenizer\n"
            "from ds_ppo.errors import ConfigError\n"
            "for spec in sys.argv[1:]:\n    try:\n        load_tokenizer(spec, '.')\n"
            "    except ConfigError as e:\n        print(f'ConfigError: {e}', file=sys.stderr)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, *specs], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - t0


def test_a_missing_local_tokenizer_path_says_so(tmp_path):
    specs = ("./my_tok", str(tmp_path / "no" / "tok"), "tok/")
    proc, _ = _load_tokenizer(*specs, cwd=tmp_path)
    for spec in specs:
        expected = f"ConfigError: cannot load tokenizer {spec!r}: no such directory or file"
        assert expected in proc.stderr, proc.stderr[-2000:]
    assert "Repo id" not in proc.stderr


def test_an_unreachable_hub_fails_fast_and_hf_hub_offline_is_honoured(tmp_path):
    from conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc, seconds = _load_tokenizer("someorg/some-tokenizer", cwd=tmp_path, HF_ENDPOINT=dead)
    assert f"the hub at {dead} does not answer" in proc.stderr, proc.stderr[-2000:]
    assert "(offline?)" in proc.stderr and seconds < 60
    proc, seconds = _load_tokenizer("someorg/some-tokenizer", cwd=tmp_path, HF_ENDPOINT=dead,
                                    HF_HUB_OFFLINE="1")
    assert "HF_HUB_OFFLINE is set: only the local cache is used" in proc.stderr, proc.stderr
    assert "does not answer" not in proc.stderr and seconds < 60
