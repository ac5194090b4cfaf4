"""What a user gets from a preset or config file plus command-line keys: a model or reward
source given on the command line replaces the file's (with one line saying so), each
supervised job's learning rate, and `--dry-run` on presets whose paths are still placeholders."""
from __future__ import annotations

import pytest

from conftest import REPO
from ds_ppo.cli import main
from ds_ppo.config import job_config, load_config, preset_names, validate
from ds_ppo.errors import ConfigError

EXAMPLE = str(REPO / "examples" / "my_run.yaml")


def test_a_path_on_the_command_line_replaces_the_presets_arch_and_tokenizer(capsys):
    notes: list[str] = []
    cfg = load_config("recipe", ["policy.path=out/sft/final"], notes)
    assert cfg.policy.path == "out/sft/final"
    assert cfg.policy.arch is None and cfg.policy.tokenizer is None  # the tokenizer: the path's
    assert notes == ["policy.path from the command line replaces the config file's "
                     "policy.arch, policy.tokenizer"]
    validate(cfg, 1)  # was: "policy.path ... and policy.arch are both set: keep one"
    # a tokenizer given beside it is kept; a value.path replaces value.arch the same way
    cfg = load_config("recipe", ["policy.path=p", "policy.tokenizer=t"])
    assert cfg.policy.tokenizer == "t"
    cfg = load_config(None, ["value.arch={model_type: llama}", "value.path=v"])
    assert cfg.value.arch == {"model_type": "llama"} and cfg.value.path == "v"  # both given


def test_both_set_in_one_file_is_still_an_error(tmp_path):
    source = tmp_path / "both.yaml"
    source.write_text("policy: {path: some/model, arch: {model_type: llama}}\n")
    with pytest.raises(ConfigError, match="are both set"):
        validate(load_config(source), 1)


def test_a_reward_model_on_the_command_line_replaces_the_files_function_and_its_columns():
    notes: list[str] = []
    cfg = load_config(EXAMPLE, ["reward.model=out/rm/final"], notes)
    assert cfg.reward.model == "out/rm/final" and cfg.reward.function is None
    assert cfg.data.reward_keys == []  # a reward model takes no columns
    assert notes == ["reward.model from the command line replaces the config file's "
                     "reward.function, data.reward_keys"]
    cfg = load_config(EXAMPLE, ["reward.url=http://127.0.0.1:1/score"])
    assert cfg.reward.function is None and cfg.data.reward_keys == ["answer"]  # a service does
    assert load_config(EXAMPLE, ["reward.model=null"]).reward.function is not None


def test_the_cli_says_once_what_the_command_line_replaced(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert main(["config", "--config", "recipe", "policy.path=out/sft/final"]) == 0
    err = capsys.readouterr().err
    assert err == ("ds-ppo: policy.path from the command line replaces the config file's "
                   "policy.arch, policy.tokenizer\n")
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    assert main(["config", "--config", "recipe", "policy.path=out/sft/final"]) == 0
    assert capsys.readouterr().err == ""


def test_each_supervised_job_has_its_own_learning_rate():
    cfg = load_config("recipe")
    assert cfg.policy.lr == 5e-4  # RL from the SFT model
    assert job_config(cfg, "sft").policy.lr == 3e-3 and job_config(cfg, "rm").policy.lr == 1e-3
    plain = load_config(None)
    assert plain.sft.lr is None and job_config(plain, "sft") is plain  # policy.lr then


# (preset, world size it is for)
WORLD = {"tiny": 1, "1b": 1, "8b": 8, "70b": 64, "grpo": 8, "distill": 8, "70b-lora": 8, "recipe": 1,
         "calculator": 1, "lookup": 1, "8b-long": 8, "70b-long": 64, "30b-a3b": 8,
         "235b-a22b": 64}


def test_every_preset_has_a_world_size_here():
    assert sorted(WORLD) == preset_names()


@pytest.mark.parametrize("name", sorted(WORLD))
def test_dry_run_checks_a_preset_as_shipped_and_lists_the_paths_to_fill(name, capsys):
    """Every setting of a preset is checked at its world size; what is left is the list of
    /path/to/... placeholders, each named with its key (or "config OK" for presets that run
    as shipped on this machine)."""
    text = (REPO / "ds_ppo" / "presets" / f"{name}.yaml").read_text()
    rc = main(["train", "--dry-run", "--config", name, "--world-size", str(WORLD[name])])
    out, err = capsys.readouterr()
    if "/path/to/" not in text:
        assert (rc, out) == (0, f"config OK for world size {WORLD[name]}\n"), err
        return
    assert rc == 2
    lines = err.splitlines()
    assert lines[0] == ("ds-ppo: error: paths still to fill in (the preset's placeholders; "
                        "every other setting is checked):"), err
    filled = []
    for line in lines[1:]:
        key, value = line.strip().split(" = ")
        assert value.startswith("/path/to/") and value in text, line
        filled.append(f"{key}={REPO / 'examples' / 'problems.jsonl'}" if key == "data.path"
                      else f"{key}={REPO}")
    assert len(filled) == text.count("/path/to/") - text.count("/path/to/...")
    # with the placeholders filled in, nothing else is left to fix
    assert main(["train", "--dry-run", "--config", name, "--world-size", str(WORLD[name]),
                 *filled]) == 0, capsys.readouterr().err


def test_world_size_is_for_dry_runs(capsys):
    assert main(["train", "--world-size", "2"]) == 2
    assert "--world-size only applies to --dry-run" in capsys.readouterr().err
    assert main(["sft", "--dry-run", "--world-size", "0", "data.path=x.jsonl"]) == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_sft_from_random_weights_for_a_handful_of_steps_is_warned_about():
    from ds_ppo.jobs.supervised.training import few_steps_warning, total_steps

    cfg = load_config(None)  # the tiny preset: a random-init policy.arch, sft.epochs 1
    total = total_steps(cfg.sft, 400)
    assert total == 12
    assert few_steps_warning(cfg, "sft", total, 400) == (
        "sft trains a randomly initialised policy.arch for 12 optimizer steps (sft.epochs = 1 "
        "over 400 rows at sft.batch_size = 32): too few to learn a task; set sft.steps "
        "(examples/my_run.yaml: 150 for sft) or start from a trained model (policy.path)")
    assert few_steps_warning(load_config(EXAMPLE), "sft", 150, 300) is None  # enough steps
    trained = load_config(None, ["policy.path=some/model"])
    assert few_steps_warning(trained, "rm", 12, 400) is None  # a trained model: fine-tuning


def test_a_supervised_job_without_data_says_what_it_needs(capsys):
    assert main(["sft"]) == 2
    err = capsys.readouterr().err
    assert "set data.path (e.g. data.path=examples/demos.jsonl" in err
