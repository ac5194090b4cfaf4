"""`ds-ppo train --dry-run` finds what a real start would trip over, in about a second: data
columns (read from a local file's first rows), reward functions that data.reward_keys cannot
call, misspelt keys (with a "did you mean"), batch sizes that do not divide (with a set that
works), and it imports neither torch nor DeepSpeed."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import clean_env
from ds_ppo.cli import main
from ds_ppo.config import PPOConfig, load_config, validate
from ds_ppo.config.batches import _batch_sizes_fit, working_batch_sizes

REWARDS = """
def exact(prompts, responses, answer):
    return [float(r.strip().endswith(a)) for r, a in zip(responses, answer)]
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A directory with a reward module (named after the test, so each test imports its own)
    and a JSON-lines file with columns prompt and answer."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "problems.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n'
                                            '{"prompt": "2+2=", "answer": "4"}\n')
    module = f"rewards_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    return tmp_path, module


def _dry_run(capsys, *overrides: str) -> tuple[int, str]:
    rc = main(["train", "--dry-run", "output_dir=out", *overrides])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_the_dry_run_imports_no_torch(work):
    """The config/dry-run path stays light: no torch, DeepSpeed or transformers import."""
    tmp, module = work
    code = textwrap.dedent(f"""
        import sys
        from ds_ppo.cli import main
        rc = main(["train", "--dry-run", "output_dir=out", "data.path=problems.jsonl",
                   "reward.function={module}:exact", "data.reward_keys=[answer]"])
        print(rc, [m for m in ("torch", "deepspeed", "transformers") if m in sys.modules])
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[-2] == "0 []", proc.stdout + proc.stderr[-2000:]
    assert "config OK" in proc.stdout


def test_a_finished_run_stops_before_torch_imports(tmp_path):
    """Re-running a run whose latest checkpoint holds `iterations` and whose export holds that
    iteration prints so and stops, before any model (or torch) loads; an export of an earlier
    iteration (a run stopped before its export) is written again (the start goes on)."""
    ckpt = tmp_path / "out" / "checkpoints" / "iter_000040"
    for role in ("policy", "value"):  # a gae run's roles
        (ckpt / role).mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": 40, "world_size": 1}))
    (ckpt.parent / "latest").write_text("iter_000040")
    (tmp_path / "out" / "final").mkdir()
    marker = tmp_path / "out" / "final" / "ds_ppo_export.json"
    code = textwrap.dedent("""
        import sys
        from ds_ppo.engine.checkpoint.files import finished_run
        from ds_ppo.cli import main
        print(main(["train", "output_dir=out"]), "torch" in sys.modules)
        print(finished_run("out", "auto", 41, True))
    """)
    marker.write_text(json.dumps({"checkpoint": "the run in out", "iteration": 40}))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0] == ("ds-ppo: the run in out already completed 40 of iterations=40 "
                        "(out/checkpoints/iter_000040, exported to out/final); nothing to "
                        "train: raise iterations to continue"), proc.stdout + proc.stderr[-2000:]
    assert lines[1:] == ["0 False", "None"]  # iterations=41: something to do
    from ds_ppo.engine.checkpoint.files import finished_run

    marker.write_text(json.dumps({"checkpoint": "the run in out", "iteration": 20}))
    assert finished_run(tmp_path / "out", "auto", 40, True) is None
    assert finished_run(tmp_path / "out", "auto", 40, False) is not None


def test_a_required_argument_that_reward_keys_does_not_supply(work, capsys):
    _, module = work
    rc, out = _dry_run(capsys, "data.path=problems.jsonl", f"reward.function={module}:exact")
    assert rc == 2
    assert (f"reward.function = '{module}:exact' requires argument answer, which "
            "data.reward_keys = [] does not supply") in out
    rc, out = _dry_run(capsys, "data.path=problems.jsonl", f"reward.function={module}:exact",
                       "data.reward_keys=[answer]")
    assert rc == 0 and "config OK" in out


def test_a_misspelt_reward_key_is_reported_as_the_column(work, capsys):
    _, module = work
    rc, out = _dry_run(capsys, "data.path=problems.jsonl", f"reward.function={module}:exact",
                       "data.reward_keys=[answr]")
    assert rc == 2
    assert ("no column 'answr' (data.reward_keys); did you mean 'answer'? its columns are: "
            "'prompt', 'answer'") in out
    assert "keyword argument" not in out  # not a signature problem


@pytest.mark.parametrize("name,text", [
    ("q.jsonl", '{"question": "1+1=", "answer": "2"}\n'),
    ("q.json", json.dumps([{"question": "1+1=", "answer": "2"}])),
    ("q.csv", "question,answer\n1+1=,2\n"),
])
def test_prompt_and_reward_columns_the_data_does_not_have(work, capsys, name, text):
    tmp, _ = work
    (tmp / name).write_text(text)
    rc, out = _dry_run(capsys, f"data.path={name}", "data.messages_key=msgs",
                       "data.reward_keys=[answer, tests]", "reward.function=null",
                       "reward.url=http://127.0.0.1:9/")
    assert rc == 2
    assert f"file {name}: no column 'prompt' (data.prompt_key) or 'msgs' (data.messages_key)" in out
    assert "no column 'tests' (data.reward_keys)" in out and "'question', 'answer'" in out
    rc, out = _dry_run(capsys, f"data.path={name}", "data.prompt_key=question",
                       "data.reward_keys=[answer]", "reward.function=null",
                       "reward.url=http://127.0.0.1:9/")
    assert rc == 0, out


@pytest.mark.parametrize("override,hint", [
    ("ppo.kl_coeff=0.1", "did you mean 'ppo.kl_coef'?"),
    ("itertions=3", "did you mean 'iterations'?"),
    ("ppo.lr=1e-5", "did you mean 'policy.lr' or 'value.lr' or 'sft.lr'?"),
])
def test_unknown_keys_say_what_was_meant(work, capsys, override, hint):
    rc, out = _dry_run(capsys, override)
    assert rc == 2 and hint in out
    tmp, _ = work
    key, value = override.split("=")
    section, _, leaf = key.rpartition(".")
    (tmp / "c.yaml").write_text(f"{section}:\n  {leaf}: {value}\n" if section else
                                f"{leaf}: {value}\n")
    rc, out = _dry_run(capsys, "--config", "c.yaml")
    assert rc == 2 and hint in out


def test_batch_size_errors_give_a_set_that_works(work, capsys):
    rc, out = _dry_run(capsys, "ppo.mini_batch_size=7")
    assert rc == 2
    assert "batch sizes that work at world size 1: ppo.mini_batch_size=8" in out
    fix = out.split("batch sizes that work at world size 1: ")[1].split()
    rc, out = _dry_run(capsys, "ppo.mini_batch_size=7", *fix)
    assert rc == 0, out


def test_working_batch_sizes_fit_every_rule():
    """For each broken combination, the suggested change passes validate() at that world size."""
    for rollout, mini, micro, n, world in itertools.product(
            (8, 30), (6, 12), (3, 4), (1, 4), (1, 3)):
        p = PPOConfig(rollout_batch_size=rollout, mini_batch_size=mini, micro_batch_size=micro,
                      samples_per_prompt=n)
        fix = working_batch_sizes(p, world)
        assert fix is not None, (rollout, mini, micro, n, world)
        assert (fix == {}) == _batch_sizes_fit(rollout, mini, micro, n, world)
        if n == 1 and fix:  # the whole config validates with it (n > 1 needs grpo or similar)
            cfg = load_config(None, [f"ppo.{k}={v}" for k, v in
                                     {"rollout_batch_size": rollout, "mini_batch_size": mini,
                                      "micro_batch_size": micro, **fix}.items()])
            validate(cfg, world)


def test_the_help_says_in_one_sentence_every_command(capsys):
    """`ds-ppo --help` opens with a complete sentence naming every sub-command (bench too)."""
    import argparse

    from ds_ppo.cli import build_parser

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    description = " ".join(text.split("\n\n")[1].split())  # after the usage, before the options
    assert description.startswith("RLHF for language models") and description.endswith(".")
    assert description.count(".") == 1  # one sentence
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = list(sub.choices)
    assert "bench" in names and len(names) >= 10
    listed = description.split("the commands ")[1].split(" (")[0]
    assert listed == ", ".join(names[:-1]) + " and " + names[-1]


# ------------------------------------------ the supervised jobs' and PPO-ptx files, as read
SFT_ROWS = '{"prompt": "hi", "completion": "there"}\n'
BAD_DATA = [
    # (job, file content, the run's words for it)
    ("sft", '{"prompt": "hi", "answer": "there"}\n', "no column 'messages'"),
    ("sft", SFT_ROWS + '{"prompt": "hi", "completion": " "}\n',
     "line 2: column 'completion' is an empty answer"),
    ("sft", SFT_ROWS.encode() + b'{"prompt": "hi", "completion": "th\xffere"}\n', "line 2"),
    ("sft", '{"messages": [{"role": "user", "content": "hi"}]}\n', "no assistant message"),
    ("rm", '{"prompt": "p", "chosen": "a", "rejected": "a"}\n', "are the same answer"),
    ("rm", '{"prompt": "p", "chosen": "a", "rejected": "b", "m": "x"}\n', "must be a number"),
]


@pytest.mark.parametrize("job, content, words", BAD_DATA)
def test_the_job_dry_run_refuses_rows_the_job_would_refuse(job, content, words, tmp_path,
                                                           monkeypatch, capsys):
    """`ds-ppo sft|rm --dry-run` reads the rows as the job does (without a tokenizer): what
    the job would stop on seconds later, the dry run stops on."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "d.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    extra = ["rm.margin_key=m"] if '"m"' in str(content) else []
    assert main([job, "--dry-run", f"data.path={path}", "output_dir=out", *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and str(path) in err and "Traceback" not in err, err


def test_the_job_dry_run_accepts_good_rows_and_skips_bad_ones_when_told(tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "d.jsonl"
    path.write_text(SFT_ROWS + '{"prompt": "hi", "completion": ""}\n')
    args = ["sft", "--dry-run", f"data.path={path}", "output_dir=out"]
    assert main([*args, "data.on_bad_row=skip"]) == 0
    assert "config OK" in capsys.readouterr().out
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", '
                     '"content": "a"}], "rejected": [{"role": "user", "content": "q"}, '
                     '{"role": "assistant", "content": "b"}]}\n')
    assert main(["rm", "--dry-run", f"data.path={pairs}", "output_dir=out"]) == 0, \
        capsys.readouterr().err


@pytest.mark.parametrize("content, words", [
    ("", "ptx.jsonl: the file is empty"),
    ('{"text": "a b c"\n', "line 1"),
    ('{"body": "a b c"}\n', "rows need a `text` column"),
    ('{"text": "a b c"}\n{"other": 1}\n', "line 2: column 'text' is missing"),
])
def test_the_train_dry_run_reads_the_ptx_rows(content, words, work, capsys):
    """data.ptx_path (with ppo.ptx_coef > 0) is read and checked at --dry-run as the run reads
    it: an empty, malformed or wrong-column file, a row without `text` (named as missing)."""
    tmp_path, _ = work
    (tmp_path / "ptx.jsonl").write_text(content)
    rc, out = _dry_run(capsys, "ppo.ptx_coef=0.1", "data.ptx_path=ptx.jsonl")
    assert rc == 2 and words in out and "Traceback" not in out and "<object" not in out, out
    (tmp_path / "ptx.jsonl").write_text('{"text": "a b c"}\n')
    assert _dry_run(capsys, "ppo.ptx_coef=0.1", "data.ptx_path=ptx.jsonl")[0] == 0
