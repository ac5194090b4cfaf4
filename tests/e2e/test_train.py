"""The main job end to end, as a user runs it: `ds-ppo train` in a fresh process.

- the embedded default experiment learns (mean score rises clearly, fixed seed);
- `ds-ppo export` writes a Hugging Face model that loads with no ds_ppo import and continues
  greedily exactly like the in-training export of the same weights;
- bad configs and bad data end with one message and exit 2; a diverged run (NaN losses)
  stops with exit 3 before saving its weights.
(Resume and crash recovery: test_resume.py; preemption: test_preemption.py.)
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SMALL, clean_env, read_metrics, run_cli

def _first_and_last_mean_score(rows: list[dict]) -> tuple[float, float]:
    """Mean score/mean of the first 5 and of the last 5 iterations."""
    return (sum(r["score/mean"] for r in rows[:5]) / 5,
            sum(r["score/mean"] for r in rows[-5:]) / 5)


def _train_in_a_new_dir(tmp_path_factory, name: str, *overrides: str, fresh: bool = False):
    """`ds-ppo train OVERRIDES` in a new directory: (its output_dir, the finished process)."""
    work = tmp_path_factory.mktemp(name)
    proc = run_cli(["train", f"output_dir={work / 'out'}", *overrides], cwd=work, timeout=900,
                   fresh=fresh)
    return work / "out", proc


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's main command: `ds-ppo train` with no config (the tiny default), in a new
    interpreter as a user starts it (its start-up lines are checked below)."""
    return _train_in_a_new_dir(tmp_path_factory, "default", fresh=True)


@pytest.mark.slow
def test_default_experiment_raises_reward(default_run):
    out, proc = default_run
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == list(range(1, 41))
    first, last = _first_and_last_mean_score(rows)
    assert last > first + 0.25, (first, last)
    assert "iter   40/40" in proc.stdout  # the per-iteration progress line
    for key in ("loss/policy", "loss/value", "kl/sequence_mean", "policy/entropy",
                "policy/clip_frac", "policy/approx_kl", "value/explained_variance",
                "response/length_mean", "response/eos_rate", "kl_coef", "lr/policy",
                "time/generation_s", "tokens_per_s/generation",
                "padding/scoring_positions_per_token", "padding/update_positions_per_token"):
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    assert rows[-1]["padding/update_positions_per_token"] >= 1.0


MOE_ARCH = ["policy.arch.model_type=qwen3_moe", "policy.arch.num_experts=4",
            "policy.arch.num_experts_per_tok=2", "policy.arch.moe_intermediate_size=64",
            "policy.arch.head_dim=16", "ppo.router_replay=true"]


@pytest.mark.slow
def test_a_mixture_of_experts_policy_learns_the_default_task(tmp_path_factory):
    """The tiny default with a Qwen3-MoE policy (and MoE critic: 4 experts, top-2) and router
    replay: the mean score rises as the dense policy's does, the load-balancing loss and the
    route flips are logged (none: sampler and trainer share float32 weights on CPU), and the
    export loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    out, _ = _train_in_a_new_dir(tmp_path_factory, "moe", *MOE_ARCH)
    rows = read_metrics(out)
    first, last = _first_and_last_mean_score(rows)
    assert last > first + 0.25, (first, last)
    assert all(r["rollout/route_flip_frac"] == 0.0 for r in rows)
    assert all(1.5 < r["policy/moe_aux_loss"] < 4.0 for r in rows)
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.num_experts == 4
    doc = (REPO / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"`([a-z_]+/[a-z0-9_]+|kl_coef)`", doc))
    assert set(rows[0]) - {"iteration"} <= documented, sorted(set(rows[0]) - documented)


@pytest.mark.slow
def test_every_logged_metric_is_documented(default_run):
    out, _ = default_run
    doc = (REPO / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"`([a-z_]+/[a-z0-9_]+|kl_coef)`", doc))
    logged = set(read_metrics(out)[0]) - {"iteration"}
    assert logged <= documented, sorted(logged - documented)


def test_default_run_leaves_checkpoint_export_and_local_mlflow(default_run):
    out, proc = default_run
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000040"
    assert (out / "final" / "model.safetensors").exists()
    from ds_ppo.run.export import check_export_target
    check_export_target(out / "final", overwrite=False)  # marked: `ds-ppo export` may replace it
    assert "mlflow ui --backend-store-uri" in proc.stdout + proc.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlruns' / 'mlflow.db').resolve()}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "score/mean")]
    assert steps == list(range(1, 41))


def test_readme_prints_what_the_default_run_prints(default_run):
    """The README's lines of the tiny default are this run's: the first iteration to its
    digits, later ones within the spread of seeds (another make of CPU prints other last digits
    there; to regenerate the lines after a change of the training numbers:
    python -m tests.support.readme_lines --write)."""
    from support.readme_lines import blocks, differences, progress_lines

    _, proc = default_run
    printed = progress_lines(proc.stdout)
    shown = next(lines for overrides, lines in blocks((REPO / "README.md").read_text())
                 if not overrides)
    assert len(shown) >= 3, shown
    assert not differences(shown, printed), (
        differences(shown, printed), "README.md's lines of `ds-ppo train` differ from the run's; "
        "regenerate them with python -m tests.support.readme_lines --write")


def test_readme_lines_are_checked_to_the_digit_first_and_within_bands_later():
    """What the README test accepts: the other CPU's 40th line (issue report) and another
    seed's, not a first line off by a digit or a later one off by a changed default."""
    from support.readme_lines import differences

    readme = {1: "iter    1/40 | score +0.0493 | kl/tok +0.0000 | entropy 6.225 | pg -0.0691 | "
                 "vf 0.0278 | len 12.0 | ...",
              40: "iter   40/40 | score +0.7218 | kl/tok +1.0764 | entropy 5.271 | pg -0.0214 | "
                  "vf 0.0081 | len 12.0 | ..."}
    other_cpu = dict(readme)
    other_cpu[40] = ("iter   40/40 | score +0.7028 | kl/tok +0.9434 | entropy 5.345 | pg -0.0257 | "
                     "vf 0.0125 | len 12.0 | ...")
    assert differences(readme, other_cpu) == []
    first_off = {**other_cpu, 1: readme[1].replace("+0.0493", "+0.0513")}
    assert differences(readme, first_off) == ["iteration 1: score 0.0513 (README: 0.0493)"]
    no_learning = {**other_cpu, 40: other_cpu[40].replace("+0.7028", "+0.3028")}
    assert differences(readme, no_learning) == ["iteration 40: score 0.3028 (README: 0.7218)"]
    assert differences(readme, {1: readme[1]}) == ["iteration 40: the run printed no line"]


def test_start_up_says_each_roles_zero_stage_in_one_line_and_no_library_notices(default_run):
    _, proc = default_run
    assert ("ZeRO stage per role (world size 1): policy 0 (auto), value 0 (auto), "
            "reference 0 (auto)") in proc.stdout
    assert "zero_stage auto ->" not in proc.stdout
    for notice in ("Creating initial MLflow database tables", "Setting accelerator to",
                   "FutureWarning"):
        assert notice not in proc.stdout + proc.stderr, notice


def test_a_finished_run_stops_before_loading_anything(default_run):
    """Re-running a finished run's command loads no model and exports nothing again."""
    out, _ = default_run
    final = (out / "final" / "model.safetensors").stat().st_mtime_ns
    proc = run_cli(["train", f"output_dir={out}"], cwd=out.parent, timeout=300)
    assert "already completed 40 of iterations=40" in proc.stdout
    assert "nothing to train" in proc.stdout
    for later in ("built", "generation: mode", "exported the policy", "MLflow: run"):
        assert later not in proc.stdout, later
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == final


def test_generate_from_an_export_and_from_a_checkpoint(default_run, capsys):
    """`ds-ppo generate`: greedy responses of the export equal HF generate's on the same text
    (through the chat template when asked); a run's output_dir means its latest checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_ppo.cli import main
    from ds_ppo.run.generate import model_dir

    out, _ = default_run
    assert model_dir(str(out)) == out / "checkpoints" / "iter_000040" / "hf"
    assert model_dir(str(out / "final")) == out / "final"
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final").float()
    assert tok.chat_template  # the tiny tokenizer has one: the prompt becomes a user turn
    for flags, text in (([], tok.apply_chat_template([{"role": "user", "content": "the cat"}],
                                                     add_generation_prompt=True, tokenize=False)),
                        (["--no-chat-template"], "the cat")):
        # the rendered template holds its special tokens; plain text gets the tokenizer's
        ids = tok(text, return_tensors="pt", add_special_tokens=bool(flags))["input_ids"]
        want = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False,
                                         pad_token_id=tok.pad_token_id)[0, ids.shape[1]:],
                          skip_special_tokens=True)
        assert main(["generate", "--model", str(out / "final"), "--max-new-tokens", "8",
                     *flags, "the cat"]) == 0
        assert capsys.readouterr().out == want + "\n"
    assert main(["generate", "--model", str(out), "--max-new-tokens", "8", "--temperature",
                 "1.0", "the cat", "my aunt is"]) == 0
    assert capsys.readouterr().out.startswith("'the cat' -> '")


def _export_and_generate(script: str, cwd: Path) -> list:
    """Run generation code in a fresh interpreter that never imports ds_ppo."""
    code = script + "\nimport sys, json; assert not any(m.startswith('ds_ppo') for m in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=""), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_export_loads_without_ds_ppo_and_matches_training_export(default_run, tmp_path):
    out, _ = default_run
    run_cli(["export", "--checkpoint", str(out), "--out", str(tmp_path / "hf"), "--value"],
            cwd=tmp_path)
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "hf" / "value" / "model.safetensors").exists()
    gen = """
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
outs = []
for d in ({a!r}, {b!r}, {c!r}):
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert next(model.parameters()).dtype == torch.float32  # as trained (fp32 on CPU)
    model = model.float()
    ids = tok(["the cat", "my aunt is"], return_tensors="pt", padding=True)
    o = model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    outs.append(o.tolist())
print(json.dumps(outs))
""".format(a=str(tmp_path / "hf"), b=str(out / "final"), c=str(out / "init_models" / "policy"))
    offline, in_training, initial = _export_and_generate(gen, tmp_path)
    assert offline == in_training
    assert offline != initial  # the trained weights were exported, not the initial ones


def test_exports_keep_the_training_dtype_and_say_which(tmp_path):
    """A CPU run trains in fp32: output_dir/final and `ds-ppo export` write fp32 weights unless
    told otherwise (checkpoint.export_dtype, --dtype), and their log lines name the dtype."""
    from safetensors import safe_open

    def weight_dtypes(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {f.get_slice(k).get_dtype() for k in f.keys()}

    out = tmp_path / "out"
    proc = run_cli(["train", f"output_dir={out}", "iterations=1", *SMALL,
                    "checkpoint.export_at_end=true"], cwd=tmp_path)
    assert "to " + str(out / "final") + " (float32 weights" in proc.stdout + proc.stderr
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "float32"
    assert weight_dtypes(out / "final") == {"F32"}
    proc = run_cli(["export", "--checkpoint", str(out), "--out", str(tmp_path / "hf")],
                   cwd=tmp_path)
    assert "(float32 weights)" in proc.stdout and weight_dtypes(tmp_path / "hf") == {"F32"}
    proc = run_cli(["export", "--checkpoint", str(out), "--out", str(tmp_path / "half"),
                    "--dtype", "bf16"], cwd=tmp_path)
    assert "(bfloat16 weights)" in proc.stdout and weight_dtypes(tmp_path / "half") == {"BF16"}


def test_bad_config_exits_cleanly(tmp_path):
    proc = run_cli(["train", "ppo.mini_batch_size=7"], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "ppo.mini_batch_size" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["train", "ppo.no_such_key=1"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "no_such_key" in proc.stderr
    assert "Traceback" not in proc.stderr
    # an arch transformers cannot build: caught on every rank before any weights exist
    proc = run_cli(["train", *SMALL, "policy.arch.model_type=no_such_model",
                    f"output_dir={tmp_path / 'o'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "policy.arch" in proc.stderr and "no_such_model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_rank_left_alone_exits_cleanly_naming_the_address(tmp_path):
    """Rank 0 of 2 whose partner never starts: after dist_timeout_minutes, one message that
    names the address and what to check, exit 2, instead of a C++ stack dump."""
    from conftest import free_port

    port = free_port()
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
    proc = run_cli(["train", *SMALL, "dist_timeout_minutes=0.05", f"output_dir={tmp_path / 'o'}"],
                   cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rank 0 of 2 could not join the job at 127.0.0.1:{port}" in proc.stderr
    assert "1/2 clients joined" in proc.stderr and "same MASTER_ADDR" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_join_error_for_an_unreachable_rank_0():
    import torch.distributed as tdist

    from ds_ppo.engine.dist import join_error

    err = join_error(tdist.DistNetworkError("The client socket has timed out after 6000ms while "
                                            "trying to connect to (10.0.0.1, 29500).\nframe #0"),
                     {"RANK": "9", "WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.1",
                      "MASTER_PORT": "29500"}, 30.0)
    assert str(err).startswith("rank 9 of 16 could not join the job at 10.0.0.1:29500 within "
                               "dist_timeout_minutes = 30: The client socket has timed out")
    assert "frame" not in str(err) and "not localhost" in str(err) and err.exit_code == 2


def test_bad_data_exits_cleanly_naming_file_and_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "hello there"}\n{"prompt": 3}\n{"prompt": "fine"}\n')
    proc = run_cli(["train", *SMALL, f"data.path={bad}", f"output_dir={tmp_path / 'o'}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "prompts.jsonl" in proc.stderr and "line 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "init_models").exists()  # stopped before any model was built
    # skipping bad rows; held-out prompts from another file are evaluated with greedy responses
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"my aunt is {w}"}) + "\n"
                                for w in ("kind", "tall", "here")))
    ok = run_cli(["train", *SMALL, f"data.path={bad}", "data.on_bad_row=skip", "iterations=1",
                  "ppo.rollout_batch_size=8", "checkpoint.save_at_end=false",
                  f"data.eval_split={held_out}", "data.eval_every=1",
                  f"output_dir={tmp_path / 'o2'}"], cwd=tmp_path)
    assert "skipped" in ok.stdout + ok.stderr
    row = read_metrics(tmp_path / "o2")[0]
    assert 0.0 <= row["eval/score_mean"] <= 1.0 and row["eval/length_mean"] > 0
    assert f"eval    1/1 | score {row['eval/score_mean']:+.4f}" in ok.stdout  # printed, too


def test_divergence_stops_before_saving_nan_weights(tmp_path):
    """A learning rate of 1e30: the first optimizer step (end of iteration 1, one step per
    iteration) ruins the weights, iteration 2's losses are NaN. The run stops there with exit 3
    and a message naming the iteration and the last checkpoint, and saves nothing after it."""
    out = tmp_path / "o"
    args = ["train", *SMALL, "ppo.mini_batch_size=16", "ppo.ppo_epochs=1", "policy.lr=1e30",
            "value.lr=1e30", "iterations=4", "checkpoint.every=1", f"output_dir={out}"]
    proc = run_cli(args, cwd=tmp_path, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "iteration 2:" in proc.stderr and "training diverged" in proc.stderr
    assert "iter_000001" in proc.stderr and "Traceback" not in proc.stderr
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2]  # the diverged iteration is still logged
    assert math.isfinite(rows[0]["loss/policy"]) and not math.isfinite(rows[1]["loss/policy"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["iter_000001"]
    # the same command resumes from iteration 1's (finite, but ruined) weights and diverges
    # again; the message names the checkpoint it resumed from
    again = run_cli(args, cwd=tmp_path, check=False)
    assert again.returncode == 3 and "resumed from" in again.stdout
    assert "iteration 2:" in again.stderr and "iter_000001, was saved before it" in again.stderr


def test_reward_function_gets_each_prompts_dataset_columns(tmp_path):
    """data.reward_keys: the reward function gets each response's `answer` from the row of its
    own prompt (the function fails the run if one is misaligned), through sampling, sharding
    and length-sorted scoring."""
    (tmp_path / "my_reward.py").write_text(
        "def first_word(prompts, responses, answer):\n"
        "    for p, a in zip(prompts, answer):\n"
        "        assert p.split()[0] == a, (p, a)\n"
        "    return [float(len(r.split()) % 3) for r in responses]\n")
    words = ["the cat sat", "we had a wonderful day", "it was", "my aunt is kind", "what a"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": w, "answer": w.split()[0]}) + "\n"
                            for w in words * 4))
    run_cli(["train", *SMALL, f"data.path={data}", "data.reward_keys=[answer]",
             "reward.function=my_reward:first_word", "iterations=2",
             "checkpoint.save_at_end=false", f"output_dir={tmp_path / 'o'}"], cwd=tmp_path)
    assert [r["iteration"] for r in read_metrics(tmp_path / "o")] == [1, 2]
    bad = run_cli(["train", *SMALL, f"data.path={data}", "data.reward_keys=[answer]",
                   "reward.function=ds_ppo.rewards:positive_words",
                   f"output_dir={tmp_path / 'o2'}"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "takes no keyword argument answer" in bad.stderr
    assert not (tmp_path / "o2").exists()  # stopped before any data or model was loaded
    dry = run_cli(["train", "--dry-run", *SMALL, f"data.path={data}", "data.reward_keys=[answer]",
                   "reward.function=my_reward:first_wrd"], cwd=tmp_path, check=False)
    assert dry.returncode == 2 and "has no callable 'first_wrd'" in dry.stderr


# A critic-free estimator on the tiny task, smaller than the README's measurement (8 prompts x 4
# responses per iteration, as many responses as the default's 32, and 20 iterations).
GRPO_SMALL = ["ppo.samples_per_prompt=4", "ppo.rollout_batch_size=8", "iterations=20",
              "tracking.enabled=false", "checkpoint.every=0", "checkpoint.export_at_end=false"]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    return _train_in_a_new_dir(tmp_path_factory, "grpo", "ppo.advantage_estimator=grpo",
                               *GRPO_SMALL)


@pytest.mark.slow
def test_grpo_learns_without_a_value_model(grpo_run):
    out, proc = grpo_run
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == list(range(1, 21))
    first, last = _first_and_last_mean_score(rows)
    assert last > first + 0.2, (first, last)
    # no value model: no value loss, metrics, checkpoint or progress column
    assert not [k for k in rows[-1] if k.startswith("value/") or k in ("loss/value", "lr/value")]
    assert 0 <= rows[-1]["group/zero_std_frac"] <= 1 and rows[0]["score/group_std_mean"] > 0
    ckpt = out / "checkpoints" / "iter_000020"
    assert (ckpt / "policy").is_dir() and (ckpt / "hf").is_dir()
    assert not (ckpt / "value").exists() and not (ckpt / "hf_value").exists()
    assert "iter   20/20" in proc.stdout and "| vf " not in proc.stdout
    assert "value model starts from" not in proc.stdout
    doc = (REPO / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"`([a-z_]+/[a-z0-9_]+|kl_coef)`", doc))
    assert set(rows[0]) - {"iteration"} <= documented


def test_resume_into_an_estimator_with_a_value_model_is_refused(grpo_run):
    out, _ = grpo_run
    proc = run_cli(["train", "--dry-run", f"output_dir={out}", "ppo.advantage_estimator=gae",
                    *GRPO_SMALL, "iterations=21"], cwd=out.parent, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ppo.advantage_estimator = 'grpo' (without a value model)" in proc.stderr
    assert "ppo.advantage_estimator = 'gae' (with a value model)" in proc.stderr
    assert "Traceback" not in proc.stderr
