"""The config tree: loading, overrides, validation errors (key + value + fix), presets, CLI.

Everything here is in-process except a handful of `python -m ds_ppo` runs that check what a
user sees: exit status 2, the message on stderr and no traceback.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from conftest import REPO, clean_env, run_cli
from ds_ppo.cli import main
from ds_ppo.config import (Config, apply_overrides, describe, grad_accum_steps, load_config,
                           preset_names, validate, world_size_from_env, yaml_value)
from ds_ppo.config.load import _load_yaml  # the reader of config files and overrides
from ds_ppo.errors import ConfigError, UserError


def config_error(overrides: list[str] = (), world_size: int = 1, source=None) -> str:
    """The ConfigError message that loading + validating raises (fails the test if none)."""
    with pytest.raises(ConfigError) as info:
        validate(load_config(source, list(overrides)), world_size)
    return str(info.value)


def problem_line(message: str, key: str) -> str:
    """The one line of a (possibly multi-problem) message that names `key`."""
    lines = [ln.strip() for ln in message.splitlines() if key in ln]
    assert lines, f"no problem names {key!r} in:\n{message}"
    return lines[0]


def leaves(model: BaseModel, prefix: str = ""):
    """(dotted key, field info, default value) of every leaf field of a config instance."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field, value


# ---------------------------------------------------------------------------- loading
def test_default_is_the_tiny_preset_and_launch_tiny_is_a_link_to_it(monkeypatch):
    link = REPO / "launch" / "tiny.yaml"
    assert link.is_symlink() and link.resolve() == (REPO / "ds_ppo/presets/tiny.yaml").resolve()
    default = load_config()
    assert load_config("tiny") == default
    assert load_config(link) == default
    monkeypatch.chdir(REPO)
    assert load_config("launch/tiny.yaml") == default
    assert default.reward.function == "ds_ppo.rewards:positive_words"
    assert default.policy.arch["model_type"] == "llama" and default.output_dir == "outputs/tiny"
    validate(default, 1)


def test_config_round_trips_through_its_dict():
    cfg = load_config("70b")
    assert Config.model_validate(cfg.to_dict()) == cfg
    assert Config.model_validate(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("text, expected", [
    ("ppo: [1, 2", "not valid YAML"),
    ("- a\n- b\n", "must hold a mapping at the top, got list"),
])
def test_unreadable_yaml_files(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = config_error(source=path)
    assert str(path) in message and expected in message


def test_missing_config_file_and_directory(tmp_path):
    message = config_error(source=tmp_path / "nope.yaml")
    assert "nope.yaml" in message and "does not exist" in message and "tiny" in message
    message = config_error(source=tmp_path)
    assert str(tmp_path) in message and "directory" in message


def test_empty_yaml_file_is_all_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == Config()


# -------------------------------------------------------------------------- overrides
def test_overrides_are_parsed_as_yaml_and_reach_nested_keys():
    cfg = load_config(None, [
        "ppo.kl_coef=0.05",                       # float
        "iterations=4",                           # int
        "data.shuffle=false",                     # bool
        "reward.score_clip=null",                 # null
        "generation.stop_tokens=[</s>, '###']",   # list
        "policy.betas=[0.9, 0.99]",               # list -> tuple
        "ppo.value_clip_eps=1e-1",                # exponent without a dot: still a float
        "policy.arch.rms_norm_eps=1e-6",          # ... also inside an untyped map
        "policy.arch.hidden_size=128",            # nested key of a free-form map
        "tracking.tags.version=2",                # a number where a string is expected
        "tracking.run_name=a=b",                  # only the first '=' splits
        "deepspeed.reference.zero_stage=3",       # three levels deep
    ])
    assert cfg.ppo.kl_coef == 0.05 and cfg.iterations == 4
    assert cfg.data.shuffle is False and cfg.reward.score_clip is None
    assert cfg.generation.stop_tokens == ["</s>", "###"]
    assert cfg.policy.betas == (0.9, 0.99)
    assert cfg.ppo.value_clip_eps == 0.1
    assert cfg.policy.arch["rms_norm_eps"] == 1e-6 and isinstance(cfg.policy.arch["rms_norm_eps"], float)
    # the override changed one arch key and kept the preset's others
    assert cfg.policy.arch["hidden_size"] == 128 and cfg.policy.arch["num_hidden_layers"] == 2
    assert cfg.tracking.tags == {"version": "2"}
    assert cfg.tracking.run_name == "a=b"
    # untouched keys keep the preset's values
    assert cfg.ppo.rollout_batch_size == 32 and cfg.seed == 1
    validate(cfg, 1)


def test_later_override_wins_and_input_dict_is_not_changed():
    data = {"ppo": {"kl_coef": 0.1}}
    out = apply_overrides(data, ["ppo.kl_coef=0.2", "ppo.kl_coef=0.3", "iterations=4"])
    assert out == {"ppo": {"kl_coef": 0.3}, "iterations": 4}
    assert data == {"ppo": {"kl_coef": 0.1}}


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match=r"'ppo\.kl_coef' is not of the form key=value"):
        load_config(None, ["ppo.kl_coef"])


@pytest.mark.parametrize("override, key, where, valid_example", [
    ("itterations=4", "itterations", "the top level", "iterations"),
    ("ppo.kl_coeff=0.05", "ppo.kl_coeff", "ppo", "kl_coef"),
    ("deepspeed.policy.foo=1", "deepspeed.policy.foo", "deepspeed.policy", "zero_stage"),
    ("deepspeed.critic.zero_stage=2", "deepspeed.critic.zero_stage", "deepspeed", "reference"),
    ("policy.foo.bar=1", "policy.foo.bar", "policy", "arch"),
])
def test_unknown_override_key_at_every_level(override, key, where, valid_example):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert f"unknown config key {key!r}" in message
    assert f"{where} has no" in message
    assert "valid:" in message and valid_example in message


def test_free_form_maps_take_any_key():
    cfg = load_config(None, ["policy.arch.rope_theta=10000.0", "tracking.tags.team=rl"])
    assert cfg.policy.arch["rope_theta"] == 10000.0 and cfg.tracking.tags == {"team": "rl"}


def test_unknown_keys_in_the_yaml_file_are_all_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("iteration: 3\nppo:\n  kl_coeff: 0.05\ndeepspeed:\n  policy:\n    stage: 2\n")
    message = config_error(source=path)
    for key, valid_example in [("iteration", "iterations"), ("ppo.kl_coeff", "kl_coef"),
                               ("deepspeed.policy.stage", "zero_stage")]:
        line = problem_line(message, f"unknown config key {key!r}")
        assert "valid here:" in line and valid_example in line


# ------------------------------------------------------------------ range errors (pydantic)
@pytest.mark.parametrize("override, key, value, valid", [
    ("ppo.clip_eps=0", "ppo.clip_eps", "0", "greater than 0"),
    ("ppo.lam=1.5", "ppo.lam", "1.5", "less than or equal to 1"),
    ("ppo.gamma=-0.1", "ppo.gamma", "-0.1", "greater than or equal to 0"),
    ("generation.top_p=0", "generation.top_p", "0", "greater than 0"),
    ("iterations=0", "iterations", "0", "greater than 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last", "0", "greater than 0"),
    ("ppo.micro_batch_size=-2", "ppo.micro_batch_size", "-2", "greater than 0"),
    ("ppo.micro_batch_tokens=0", "ppo.micro_batch_tokens", "0", "greater than 0"),
    ("deepspeed.policy.zero_stage=4", "deepspeed.policy.zero_stage", "4", "0, 1, 2, 3 or 'auto'"),
    ("generation.mode=fast", "generation.mode", "'fast'", "'auto', 'gathered', 'tensor_parallel' or 'zero3'"),
    ("ppo.kl_coef=abc", "ppo.kl_coef", "'abc'", "valid number"),
])
def test_range_errors_name_key_value_and_what_is_valid(override, key, value, valid):
    line = problem_line(config_error([override]), key)
    assert line.startswith(f"{key} = {value}:"), line
    assert valid in line


# ------------------------------------------------------------- cross-field errors (validate)
@pytest.mark.parametrize("overrides, world_size, key, value", [
    # batch sizes
    (["ppo.rollout_batch_size=33", "ppo.mini_batch_size=11", "ppo.micro_batch_size=1"], 2,
     "ppo.rollout_batch_size", "33 must be divisible by the data-parallel world size 2"),
    (["ppo.mini_batch_size=24"], 1, "ppo.mini_batch_size", "= 24 must divide ppo.rollout_batch_size = 32"),
    ([], 4, "ppo.micro_batch_size * world size", "= 8 * 4 = 32"),
    (["ppo.value_clip_eps=0"], 1, "ppo.value_clip_eps", "= 0.0"),
    (["ppo.value_clip_eps=-0.2"], 1, "ppo.value_clip_eps", "= -0.2"),
    # reward
    # (both on the command line: one there replaces the file's other source)
    (["reward.model=/models/rm", "reward.function=ds_ppo.rewards:positive_words"], 1,
     "reward.model", "model='/models/rm'"),
    (["reward.function=null"], 1, "reward.function", "function=None, model=None"),
    (["reward.function=my_rewards.score"], 1, "reward.function", "'my_rewards.score'"),
    (["reward.score_clip=0"], 1, "reward.score_clip", "= 0.0"),
    (["data.reward_keys=[answer]"], 1, "data.reward_keys", "the builtin prompts (data.path = "),
    (["data.path=p.jsonl", "data.reward_keys=[answer]", "reward.function=null",
      "reward.model=/rm", "value.init_from=policy"], 1, "data.reward_keys",
     "only a reward.function or reward.url takes dataset columns"),
    (["data.path=p.jsonl", "data.reward_keys=[a, a]"], 1, "data.reward_keys", "must be distinct"),
    (["data.path=p.jsonl", "data.reward_keys=[prompts]"], 1, "data.reward_keys",
     "not prompts or responses"),
    # models
    (["policy.path=/models/llama", "policy.arch={model_type: llama}"], 1, "policy.path",
     "'/models/llama'"),
    (["policy.arch={hidden_size: 8}"], 1, "policy.arch", "{'hidden_size': 8}"),
    (["value.arch={hidden_size: 8}"], 1, "value.arch", "{'hidden_size': 8}"),
    (["policy.arch=null"], 1, "policy.path", "policy.arch = None"),
    (["value.init_from=reward"], 1, "value.init_from", "'reward'"),
    (["value.init_from=path"], 1, "value.init_from", "'path'"),
    (["value.max_grad_norm=0"], 1, "value.max_grad_norm", "= 0.0"),
    # generation
    (["generation.min_new_tokens=20"], 1, "generation.min_new_tokens", "= 20 must be <= "
     "generation.max_new_tokens = 12"),
    (["generation.tp_size=3"], 2, "generation.tp_size = 3", "must divide the world size 2"),
    (["generation.loop=own", "generation.mode=zero3"], 1, "generation.loop = 'own' runs",
     "generation.mode=gathered"),
    (["generation.loop=own", "generation.cache_implementation=static"], 1,
     "generation.cache_implementation / generation.compile", "generation.loop=hf"),
    (["generation.loop=own", "generation.compile=true"], 1,
     "generation.cache_implementation / generation.compile", "generation.loop=hf"),
    (["generation.loop=own", "policy.attn_implementation=flash_attention_2"], 1,
     "generation.loop = 'own' supports", "generation.loop=auto"),
    (["generation.loop=hf", "generation.continuous=true"], 1,
     "generation.continuous = true", "generation.continuous=auto"),
    (["generation.mode=zero3", "ppo.rollout_correction=tis"], 1,
     "ppo.rollout_correction = 'tis'", "generation.mode = 'zero3'"),
    (["generation.loop=hf", "ppo.old_logprobs=rollout"], 1,
     "ppo.old_logprobs = 'rollout'", "generation.loop = 'hf'"),
    (["generation.loop=hf", "generation.require_exact=true"], 1,
     "generation.require_exact = True", "generation.require_exact=false"),
    (["generation.batch_invariant=true", "generation.mode=zero3"], 1,
     "generation.batch_invariant = true", "generation.mode=gathered"),
    (["generation.require_exact=true", "ppo.old_logprobs=rollout"], 1,
     "generation.require_exact = true compares", "ppo.old_logprobs=training"),
    (["ppo.rollout_correction=mis", "ppo.old_logprobs=rollout"], 1,
     "ppo.rollout_correction = 'mis'", "ppo.old_logprobs = 'rollout'"),
    # deepspeed (the reference's default offload_param=True needs ZeRO-3 too)
    (["deepspeed.value.zero_stage=2", "deepspeed.value.offload_param=true"], 1,
     "deepspeed.value.offload_param", "deepspeed.value.zero_stage = 3 (got 2)"),
    (["deepspeed.reference.zero_stage=1", "deepspeed.reference.offload_param=true"], 1,
     "deepspeed.reference.offload_param", "deepspeed.reference.zero_stage = 3 (got 1)"),
    (["deepspeed.policy.config=/no/such/zero3.json"], 1, "deepspeed.policy.config",
     "'/no/such/zero3.json': file does not exist"),
    # resume
    (["resume=/no/such/run/checkpoints/iter_000010"], 1, "resume",
     "'/no/such/run/checkpoints/iter_000010'"),
])
def test_cross_field_errors_name_key_and_value(overrides, world_size, key, value):
    line = problem_line(config_error(overrides, world_size), key)
    assert value in line, line


def test_every_problem_is_reported_at_once():
    message = config_error(["ppo.mini_batch_size=24", "generation.min_new_tokens=20",
                            "reward.model=/rm", "reward.function=ds_ppo.rewards:positive_words"])
    assert message.startswith("invalid config:")
    for key in ("ppo.mini_batch_size = 24", "generation.min_new_tokens = 20", "model='/rm'"):
        problem_line(message, key)
    message = config_error(["ppo.clip_eps=0", "ppo.lam=1.5"])
    problem_line(message, "ppo.clip_eps = 0")
    problem_line(message, "ppo.lam = 1.5")


def test_range_errors_and_unknown_keys_in_a_file_are_reported_together(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("ppo:\n  clip_eps: 0\n  kl_coeff: 0.05\niterations: 0\n")
    message = config_error(source=path)
    problem_line(message, "ppo.clip_eps = 0")
    problem_line(message, "iterations = 0")
    problem_line(message, "unknown config key 'ppo.kl_coeff'")


def test_existing_paths_pass(tmp_path):
    ds = tmp_path / "my_zero3.json"
    ds.write_text("{}")
    (tmp_path / "ckpt").mkdir()
    cfg = load_config(None, [f"deepspeed.policy.config={ds}", f"resume={tmp_path / 'ckpt'}"])
    validate(cfg, 1)
    for resume in ("auto", "never"):
        validate(load_config(None, [f"resume={resume}"]), 1)


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError) and ConfigError.exit_code == 2


# ------------------------------------------------------------------------- the tree
def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.iterations = 3
    with pytest.raises(ValidationError, match="frozen"):
        cfg.ppo.kl_coef = 0.5
    with pytest.raises(ValidationError, match="frozen"):
        cfg.deepspeed.policy.zero_stage = 2


def test_describe_covers_every_leaf_with_a_description_and_its_real_default():
    lines = describe()
    assert len(lines) == len(set(lines))
    by_key = {line.split(" (default ", 1)[0]: line for line in lines}
    expected = list(leaves(Config()))
    assert sorted(by_key) == sorted(key for key, _, _ in expected)
    undocumented = [key for key, field, _ in expected if not (field.description or "").strip()]
    assert not undocumented, f"fields without a description: {undocumented}"
    for key, field, default in expected:
        assert by_key[key] == f"{key} (default {yaml_value(default)}): {field.description}"
        if isinstance(default, (int, float, str, list, type(None))):  # as a config file reads
            assert _load_yaml(f"v: {yaml_value(default)}")["v"] == default, key
    # YAML, as in a config file and docs/CONFIG.md, not Python
    assert by_key["policy.betas"].startswith("policy.betas (default [0.9, 0.95]): ")
    assert by_key["policy.path"].startswith("policy.path (default null): ")
    # a section whose default differs from its class's defaults is described as it is
    assert by_key["deepspeed.reference.offload_param"].startswith(
        "deepspeed.reference.offload_param (default true)")


@pytest.mark.parametrize("mini, micro, world_size, accum", [
    (16, 8, 1, 2), (64, 4, 8, 2), (256, 1, 64, 4), (32, 32, 1, 1)])
def test_grad_accum_steps(mini, micro, world_size, accum):
    cfg = load_config(None, [f"ppo.rollout_batch_size={mini * 4}", f"ppo.mini_batch_size={mini}",
                             f"ppo.micro_batch_size={micro}"])
    assert grad_accum_steps(cfg, world_size) == accum


def test_world_size_from_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world_size_from_env() == 1
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert world_size_from_env() == 16


# --------------------------------------------------------------------------- presets
# (preset, world size, accumulation, prompts per rank) as each preset's comments state them
PRESETS = [("tiny", 1, 2, 32), ("1b", 1, 4, 128), ("8b", 8, 2, 32), ("70b", 64, 4, 16),
           ("grpo", 8, 4, 8), ("distill", 8, 4, 8), ("70b-lora", 8, 4, 16), ("recipe", 1, 1, 32),
           ("calculator", 1, 2, 16), ("lookup", 1, 4, 16), ("8b-long", 8, 8, 2),
           ("70b-long", 64, 16, 1),  # 70b-long: 8 data-parallel ranks (sequence parallel 8)
           ("30b-a3b", 8, 8, 8), ("235b-a22b", 64, 2, 2)]


def test_presets_are_all_tested():
    assert preset_names() == sorted(name for name, *_ in PRESETS)


@pytest.mark.parametrize("name, world_size, accum, per_rank", PRESETS)
def test_presets_validate_at_their_world_size(name, world_size, accum, per_rank):
    cfg = load_config(name)
    assert load_config(REPO / "launch" / f"{name}.yaml") == cfg
    validate(cfg, world_size)
    assert grad_accum_steps(cfg, world_size) == accum
    assert cfg.ppo.rollout_batch_size // world_size == per_rank


def test_a_preset_at_the_wrong_world_size_names_it():
    line = problem_line(config_error(world_size=48, source="70b"), "ppo.rollout_batch_size")
    assert "1024" in line and "world size 48" in line


# ------------------------------------------------------------------------------- CLI
def test_cli_in_process(capsys):
    assert main(["train", "--dry-run", "ppo.clip_eps=0"]) == 2
    assert "ppo.clip_eps = 0" in capsys.readouterr().err
    assert main(["config", "iterations=4", "ppo.kl_coef=0.05"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["iterations"] == 4 and printed["ppo"]["kl_coef"] == 0.05
    assert Config.model_validate(printed) == load_config(None, ["iterations=4", "ppo.kl_coef=0.05"])


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return run_cli(args, cwd=REPO, timeout=60, env=clean_env(**env), check=False)


def test_config_command_hides_credentials_as_the_run_does(tmp_path):
    """`ds-ppo config` prints the config as the run records it: the passwords and query tokens
    of reward.url, env.url and tracking.uri masked, from a file and from overrides alike."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "reward": {"url": "http://alice:S3cret'Pw@rm.example:8000/score?token=T0kenValue"},
        "tracking": {"uri": "http://bob:TrackPw99@mlflow.example:5000"}}))
    proc = _cli(["config", "--config", str(path),
                 "env.url=https://carol:EnvPw777@env.example/step?key=EnvKey42"])
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["reward"]["url"] == "http://***@rm.example:8000/score?token=***"
    assert printed["tracking"]["uri"] == "http://***@mlflow.example:5000"
    assert printed["env"]["url"] == "https://***@env.example/step?key=***"
    for secret in ("S3cret", "T0kenValue", "TrackPw99", "EnvPw777", "EnvKey42"):
        assert secret not in proc.stdout + proc.stderr


def test_cli_batch_size_error_exits_2_without_traceback():
    proc = _cli(["train", "--dry-run", "ppo.mini_batch_size=7"])
    assert proc.returncode == 2
    assert "ppo.mini_batch_size = 7" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_reads_world_size_from_env():
    proc = _cli(["train", "--dry-run", "ppo.rollout_batch_size=33"], WORLD_SIZE="2")
    assert proc.returncode == 2, proc.stderr
    assert "ppo.rollout_batch_size = 33" in proc.stderr and "world size 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_missing_config_file():
    proc = _cli(["train", "--dry-run", "--config", "nonexistent.yaml"])
    assert proc.returncode == 2
    assert "nonexistent.yaml" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_describe():
    proc = _cli(["config", "--describe"])
    assert proc.returncode == 0, proc.stderr
    assert "ppo.kl_coef (default 0.1): KL penalty coefficient" in proc.stdout
    assert "policy.betas (default [0.9, 0.95]): " in proc.stdout
    assert len(proc.stdout.splitlines()) == len(describe())


def test_cli_describe_into_a_closed_pipe_is_quiet():
    """`ds-ppo config --describe | head`: the reader may leave before the output is written."""
    import shutil

    exe = shutil.which("ds-ppo")
    assert exe, "the ds-ppo console script is not on PATH (pip install -e .)"
    proc = subprocess.run(f"'{exe}' config --describe | true", shell=True, cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "Error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_dry_run_loads_no_deepspeed_and_no_model_code():
    code = ("import sys; from ds_ppo.cli import main; "
            "rc = main(['train', '--dry-run', '--config', 'launch/tiny.yaml', "
            "'ppo.kl_coef=0.05', 'iterations=4']); "
            "assert rc == 0, rc; "
            "heavy = [m for m in ('deepspeed', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "config OK for world size 1" in proc.stdout


def test_config_doc_lists_every_key_with_its_description():
    """docs/CONFIG.md's tables are generated from `ds-ppo config --describe`; a key added or
    re-described in its config/ section module without regenerating them fails here."""
    import re

    doc = (REPO / "docs" / "CONFIG.md").read_text()
    rows = {key: (default, text) for key, default, text in
            re.findall(r"^\| `([\w.]+)` \| `(.*?)` \| (.*) \|$", doc, re.M)}
    described = {}
    for line in describe():
        key, rest = line.split(" (default ", 1)
        described[key] = tuple(rest.split("): ", 1))
    assert set(rows) == set(described)
    assert {k: (d, v.replace("\\|", "|")) for k, (d, v) in rows.items()} == described


# --------------------------------------------------------------- advantage estimators
GRPO = ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4"]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_need_two_samples_per_prompt(estimator, capsys):
    assert main(["train", "--dry-run", f"ppo.advantage_estimator={estimator}"]) == 2
    err = capsys.readouterr().err
    assert f"ppo.advantage_estimator = '{estimator}'" in err
    assert "ppo.samples_per_prompt = 1" in err and "set ppo.samples_per_prompt=4" in err
    assert main(["train", "--dry-run", f"ppo.advantage_estimator={estimator}",
                 "ppo.samples_per_prompt=2"]) == 0


@pytest.mark.parametrize("override,fix", [
    ("ppo.kl_loss_coef=-0.1", "ppo.kl_loss_coef = -0.1 must be >= 0"),
    ("ppo.dual_clip=1.0", "ppo.dual_clip = 1.0 must be > 1"),
    ("ppo.dual_clip=0.5", "ppo.dual_clip = 0.5 must be > 1"),
    ("ppo.clip_eps_high=0", "ppo.clip_eps_high = 0.0 must be > 0"),
    ("ppo.entropy_target_scope=token", "ppo.entropy_target_scope = 'token' weights each "
                                       "token's entropy by how far it is below "
                                       "ppo.entropy_target, which is null: set"),
    ("ppo.mini_batch_size=6", "ppo.mini_batch_size = 6 counts responses and must be a "
                              "multiple of ppo.samples_per_prompt = 4"),
    ("ppo.filter_zero_std_groups=true", None),
])
def test_bad_estimator_settings_fail_the_dry_run_with_key_and_fix(override, fix, capsys):
    extra = [] if fix is None else GRPO
    assert main(["train", "--dry-run", *extra, override]) == 2
    err = capsys.readouterr().err
    assert (fix or "ppo.filter_zero_std_groups = true needs groups") in err, err
    assert "Traceback" not in err


def test_mini_batch_counts_responses_and_holds_whole_prompts_per_rank():
    cfg = load_config(None, GRPO)  # tiny: 32 prompts x 4 = 128 responses, mini-batch 16
    validate(cfg, 1)
    validate(cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"micro_batch_size": 4})}),
             4)  # 16 responses = 4 prompts: one per rank
    line = problem_line(config_error(GRPO + ["ppo.micro_batch_size=2"], world_size=8),
                        "ppo.mini_batch_size")
    assert "4 prompts of 4 responses" in line and "ppo.mini_batch_size=32" in line
    # rollout_batch_size x n responses must split into whole mini-batches
    line = problem_line(config_error(GRPO + ["ppo.rollout_batch_size=2",
                                             "ppo.mini_batch_size=16"]), "ppo.mini_batch_size")
    assert "x ppo.samples_per_prompt = 4" in line
    from ds_ppo.config import optimizer_steps
    assert optimizer_steps(cfg) == cfg.iterations * 2 * (32 * 4 // 16)


def test_kl_in_reward_default_follows_the_estimator():
    for estimator, default in (("gae", True), ("reinforce_pp", True), ("rloo", True),
                               ("grpo", False), ("dr_grpo", False)):
        cfg = load_config(None, [f"ppo.advantage_estimator={estimator}"])
        assert cfg.ppo.kl_in_reward is default, estimator
        assert cfg.ppo.uses_critic is (estimator == "gae")
    assert load_config(None, GRPO + ["ppo.kl_in_reward=true"]).ppo.kl_in_reward is True
    cfg = load_config(None, GRPO)
    assert Config.model_validate(cfg.to_dict()) == cfg  # the resolved default round-trips


def test_value_section_given_to_a_critic_free_run_is_warned_about(capsys, tmp_path):
    assert main(["train", "--dry-run", *GRPO, "value.lr=1e-5"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "value.lr" in err and "trains no value model" in err
    source = REPO / "ds_ppo" / "presets" / "grpo.yaml"
    data, tok = tmp_path / "train.jsonl", tmp_path / "tok"  # the example's /path/to/... (checked)
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    tok.mkdir()
    assert main(["train", "--dry-run", "--config", str(source), f"data.path={data}",
                 f"data.eval_split={data}", f"policy.tokenizer={tok}"]) == 0
    assert "warning" not in capsys.readouterr().err  # the grpo example has no value section
    assert main(["train", "--dry-run", "ppo.advantage_estimator=gae", "value.lr=1e-5"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_reward_service_retries_longer_than_the_call_deadline_are_warned_about():
    from ds_ppo.config import config_warnings

    url = ["reward.function=null", "reward.url=http://h:8000/s"]
    cfg = load_config(None, url)  # 600 s x 4 attempts + 7 s back-off > 30 min
    (warning,) = config_warnings(cfg, world_size=2)
    assert "2407 s" in warning and "deadline of 1620 s" in warning
    assert "dist_timeout_minutes = 30" in warning
    assert config_warnings(cfg, world_size=1) == []  # no other rank to wait
    assert config_warnings(load_config(None, url + ["reward.timeout_s=60"]), world_size=2) == []
    assert config_warnings(load_config(None, url + ["dist_timeout_minutes=60"]), 2) == []


def test_continuous_batching_is_decided_in_one_place():
    """generation.continuous: our loop with more rows than generation.batch_size slots (auto
    or true); never with HF generate, where true is an error naming the key."""
    from ds_ppo.engine.generation.choice import choose_loop, use_continuous

    def gen(*overrides):
        return load_config(None, list(overrides)).generation

    auto = gen("generation.batch_size=8")
    assert use_continuous(auto, "own", 32) and not use_continuous(auto, "own", 8)
    assert not use_continuous(auto, "hf", 32)
    assert not use_continuous(gen(), "own", 32)  # no batch_size: every row at once
    assert not use_continuous(gen("generation.batch_size=8", "generation.continuous=false"),
                              "own", 32)
    with pytest.raises(ConfigError, match="generation.continuous=true needs our decoding loop"):
        choose_loop(gen("generation.continuous=true"), "zero3", None)


# ------------------------------------------------------------- the RLHF recipe's extras
@pytest.mark.parametrize("overrides, key, fix", [
    (["ppo.critic_warmup_iterations=2", *GRPO], "ppo.critic_warmup_iterations = 2",
     "ppo.advantage_estimator=gae"),
    (["ppo.critic_warmup_iterations=40"], "ppo.critic_warmup_iterations = 40",
     "less than iterations = 40"),
    (["policy.ema_decay=0.99", "policy.lora.r=8"], "policy.ema_decay = 0.99", "drop one"),
    (["ppo.ptx_coef=0.1"], "ppo.ptx_coef = 0.1", "needs data.ptx_path"),
])
def test_recipe_extras_rules_name_key_and_fix(overrides, key, fix):
    assert fix in problem_line(config_error(overrides), key)


def test_recipe_extras_ranges_and_warnings():
    from ds_ppo.config import config_warnings

    for bad in ("policy.ema_decay=1", "policy.ema_decay=0", "ppo.ptx_coef=-1",
                "ppo.critic_warmup_iterations=-1", "data.ptx_max_len=1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[-1]):
            load_config(None, [bad])
    (warning,) = config_warnings(load_config(None, ["data.ptx_path=x.jsonl"]))
    assert "data.ptx_path = 'x.jsonl' is ignored: ppo.ptx_coef = 0" in warning
    validate(load_config(None, ["ppo.ptx_coef=0.5", "data.ptx_path=x.jsonl",
                                "policy.ema_decay=0.99", "ppo.critic_warmup_iterations=5"]), 1)


def test_value_starts_from_its_path_under_auto_and_the_policy_schedule_skips_the_warmup():
    """value.path (e.g. a reward model's export) is where an auto value model starts; with a
    critic warm-up the policy's LR schedule spans only the iterations that train it."""
    from ds_ppo.config import optimizer_steps, value_init_source

    def source(*o):
        return value_init_source(load_config(None, list(o)))

    assert source() == "policy"
    assert source("reward.model=/rm") == "reward"
    assert source("reward.model=/rm", "value.path=/rm_export") == "path"
    assert source("value.arch={model_type: llama}") == "path"
    assert source("value.path=/v", "value.init_from=policy") == "policy"
    cfg = load_config(None, ["ppo.critic_warmup_iterations=10"])  # tiny: 40 x 2 epochs x 2
    assert optimizer_steps(cfg) == 160 and optimizer_steps(cfg, "policy") == 120


@pytest.mark.parametrize("overrides", [
    ["generation.top_p=0.9"], ["generation.top_k=5", "generation.min_new_tokens=2"],
    ["generation.temperature=0.7", "generation.stop_tokens=[b]"],
    ["env.function=ds_ppo.envs.calculator:Calculator"],
])
def test_old_logprobs_from_the_rollout_with_any_sampling_setting(overrides):
    """The trainer shapes its logits as the sampler did, so the sampler's log-probs stand for
    the policy's with every sampling setting and with episodes: no refusal."""
    validate(load_config(None, [*overrides, "ppo.old_logprobs=rollout"]), 1)


def test_keep_best_needs_periodic_saves(capsys):
    assert main(["train", "--dry-run", "checkpoint.keep_best=score/mean",
                 "checkpoint.every=0"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.keep_best = 'score/mean'" in err and "set checkpoint.every" in err
    assert "Traceback" not in err
    assert main(["train", "--dry-run", "checkpoint.keep_best=score/mean"]) == 0


def test_dynamic_sampling_needs_groups(capsys):
    assert main(["train", "--dry-run", "ppo.dynamic_sampling=true"]) == 2
    err = capsys.readouterr().err
    assert "ppo.dynamic_sampling = true keeps groups" in err and "ppo.samples_per_prompt >= 2" in err
    assert "Traceback" not in err
    assert main(["train", "--dry-run", "ppo.dynamic_sampling=true", "ppo.samples_per_prompt=2"]) == 0


@pytest.mark.parametrize("overrides, named", [
    (["generation.loop=hf"], "generation.loop = 'hf'"),
    (["generation.mode=zero3"], "generation.mode = 'zero3'"),
    (["env.function=ds_ppo.envs.calculator:Calculator"], "env.enabled = true"),
])
def test_router_replay_needs_our_loop_on_a_gathered_replica(overrides, named, capsys):
    """ppo.router_replay replays what our decoding loop records on a gathered replica: the
    other generation paths (and episodes) are refused at --dry-run, naming the key."""
    assert main(["train", "--dry-run", "ppo.router_replay=true"]) == 0
    assert main(["train", "--dry-run", "ppo.router_replay=true", *overrides]) == 2
    err = capsys.readouterr().err
    assert "ppo.router_replay = true" in err and named in err and "Traceback" not in err
