"""Settings that would do nothing: `ds-ppo train --dry-run` (and every start) says so in one line:
a warning where the run can go on without them, an error where the setting asks for something
the config makes impossible (an alarm on a metric the job never logs, a stop with no alarm that
can fire, batch-invariant log-probs that HF generate never keeps)."""
from __future__ import annotations

import pytest

from ds_ppo.cli import main
from ds_ppo.config import load_config, validate, validate_job
from ds_ppo.errors import ConfigError

ASYNC = ["ppo.schedule=async", "ppo.rollout_correction=tis"]
CALCULATOR = ["env.function=ds_ppo.envs.calculator:Calculator"]


def _dry_run(capsys, *overrides: str) -> tuple[int, str]:
    rc = main(["train", "--dry-run", "output_dir=out", *overrides])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.err


@pytest.mark.parametrize("overrides, line", [
    (["ppo.max_staleness=3"], "ppo.max_staleness = 3 is ignored: ppo.schedule = 'sync'"),
    (["ppo.schedule=one_step_off", "ppo.rollout_correction=tis", "ppo.max_staleness=2"],
     "ppo.max_staleness = 2 is ignored: ppo.schedule = 'one_step_off' generates every sample "
     "one update old"),
    (["ppo.dynamic_sampling_max_rounds=8"],
     "ppo.dynamic_sampling_max_rounds = 8 is ignored: ppo.dynamic_sampling = false"),
    (["tracking.alarms.enabled=false", "tracking.alarms.watch=[score/mean]"],
     "tracking.alarms.watch = ['score/mean'] is ignored: tracking.alarms.enabled = false"),
])
def test_a_setting_the_config_ignores_is_a_warning(capsys, overrides, line):
    rc, err = _dry_run(capsys, *overrides)
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and warnings[0].startswith(f"ds-ppo: warning: {line}"), err


@pytest.mark.parametrize("overrides", [
    [*ASYNC, "ppo.max_staleness=3"],  # async reads it
    ["ppo.dynamic_sampling=true", "ppo.samples_per_prompt=2", "ppo.dynamic_sampling_max_rounds=8"],
    ["tracking.alarms.watch=[score/mean]"],
])
def test_a_setting_the_config_reads_is_no_warning(capsys, overrides):
    rc, err = _dry_run(capsys, *overrides)
    assert rc == 0 and "warning" not in err, err


@pytest.mark.parametrize("overrides, words", [
    (["tracking.alarms.watch=[scor/mean]"],
     ["tracking.alarms.watch: 'scor/mean' is not a metric `ds-ppo train` logs",
      "never fires", "did you mean 'score/mean'?"]),
    (["tracking.alarms.watch=[score/mean, eval/score_mean]"],
     ["'eval/score_mean' is logged only with data.eval_split"]),
    (["tracking.alarms.watch=[env/correct]"], ["'env/correct' is logged only with an env"]),
    (["tracking.alarms.watch=[kl_coef]", "ppo.advantage_estimator=grpo",
      "ppo.samples_per_prompt=2"], ["'kl_coef' is logged only with ppo.kl_in_reward=true"]),
    (["checkpoint.keep_best=eval/scoremean"],
     ["checkpoint.keep_best: 'eval/scoremean' is not a metric", "is ever ranked best",
      "did you mean 'eval/score_mean'?"]),
    (["checkpoint.keep_best=scor/mean"], ["did you mean 'score/mean'?"]),
    (["checkpoint.keep_best="], ["checkpoint.keep_best: '' names no metric",
                                 "checkpoint.keep_best=null"]),
    (["tracking.alarms.watch=['']"], ["tracking.alarms.watch: '' names no metric"]),
    (["tracking.alarms.stop=true", "tracking.alarms.enabled=false"],
     ["tracking.alarms.stop = true", "tracking.alarms.enabled = false checks none"]),
    (["tracking.alarms.stop=true", "tracking.alarms.entropy_floor=0",
      "tracking.alarms.zero_std_ceiling=1"], ["tracking.alarms.stop = true", "no alarm can fire"]),
    (["ppo.dynamic_sampling=true", "ppo.samples_per_prompt=2",
      "ppo.dynamic_sampling_max_rounds=100000000"],
     ["ppo.dynamic_sampling_max_rounds = 100000000", "less than or equal to 64"]),
    (["generation.batch_invariant=true", "generation.loop=hf"],
     ["generation.batch_invariant = true", "generation.loop = 'hf'",
      "generation.batch_invariant=false"]),
])
def test_a_setting_that_cannot_take_effect_is_refused(capsys, overrides, words):
    rc, err = _dry_run(capsys, *overrides)
    assert rc == 2, err
    problems = [ln for ln in err.splitlines() if ln.startswith("  ")]
    assert len(problems) == 1, err  # one line, the problem's
    for w in words:
        assert w in problems[0], err


@pytest.mark.parametrize("overrides", [
    ["tracking.alarms.watch=[score/mean, group/zero_std_frac]", "checkpoint.keep_best=kl_coef"],
    [*CALCULATOR, "tracking.alarms.watch=[env/correct, env/turns_mean]",
     "checkpoint.keep_best=env/correct_3"],  # env/<key>: the environment's own numbers
    ["data.eval_split=test", "checkpoint.keep_best=eval/score_mean"],
    [*ASYNC, "tracking.alarms.watch=[async/staleness_mean]", "tracking.alarms.stop=true"],
    ["tracking.alarms.stop=true", "tracking.alarms.entropy_floor=0"],  # zero_std can fire
    ["generation.batch_invariant=true"],
])
def test_metrics_the_job_logs_are_accepted(overrides):
    validate(load_config(None, overrides), 1)


@pytest.mark.parametrize("job, overrides, words", [
    ("sft", ["checkpoint.keep_best=eval/perplexity"], None),
    ("rm", ["data.eval_split=test", "checkpoint.keep_best=eval/accuracy",
            "tracking.alarms.watch=[rm/accuracy]", "tracking.alarms.stop=true"], None),
    ("rm", ["checkpoint.keep_best=rm/acuracy"], ["did you mean 'rm/accuracy'?"]),
    ("sft", ["tracking.alarms.watch=[score/mean]"], ["is not a metric `ds-ppo sft` logs"]),
    ("sft", ["tracking.alarms.stop=true"], ["no alarm can fire", "tracking.alarms.watch"]),
])
def test_supervised_jobs_check_the_metrics_they_log(job, overrides, words):
    cfg = load_config(None, ["data.path=rows.jsonl", "data.eval_split=test", *overrides])
    if words is None:
        validate_job(cfg, job, 1)
        return
    with pytest.raises(ConfigError) as info:
        validate_job(cfg, job, 1)
    for w in words:
        assert w in str(info.value)
