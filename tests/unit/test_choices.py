"""The tables of named choices (algo/choices.py) tie together the config, the checks, the
advantage stage, the estimator functions and the README: one row per estimator, read by all."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from ds_ppo.algo import kl_estimate, loss_token_weights
from ds_ppo.algo.choices import ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from ds_ppo.algo.estimators import AdvantageInputs, advantages_for, register_estimator, registered
from ds_ppo.config import PPOConfig, load_config, validate
from ds_ppo.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_every_estimator_row_has_one_function_and_the_config_accepts_exactly_the_rows():
    assert sorted(registered()) == sorted(ESTIMATORS)
    assert get_args(PPOConfig.model_fields["advantage_estimator"].annotation) == tuple(ESTIMATORS)
    with pytest.raises(ValidationError):
        PPOConfig(advantage_estimator="ppo_classic")


def test_kl_and_aggregation_names_are_the_algo_tables_and_each_one_computes():
    assert get_args(PPOConfig.model_fields["kl_estimator"].annotation) == KL_ESTIMATORS
    assert get_args(PPOConfig.model_fields["loss_aggregation"].annotation) == LOSS_AGGREGATIONS
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    for name in KL_ESTIMATORS:
        assert torch.isfinite(kl_estimate(logp, ref, name)).all()
    mask = torch.tensor([[True, False]])
    for name in LOSS_AGGREGATIONS:
        assert loss_token_weights(mask, name, max_new_tokens=2).shape == (1, 2)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_config_defaults_and_checks_follow_the_row(name):
    spec = ESTIMATORS[name]
    p = PPOConfig(advantage_estimator=name)
    assert p.uses_critic == spec.critic
    assert p.kl_in_reward == spec.kl_in_reward
    cfg = load_config("tiny", [f"ppo.advantage_estimator={name}", "ppo.samples_per_prompt=1"])
    if spec.groups:
        with pytest.raises(ConfigError, match="samples_per_prompt"):
            validate(cfg, world_size=1)
    elif spec.teacher:  # distillation needs a teacher model
        with pytest.raises(ConfigError, match="teacher.path"):
            validate(cfg, world_size=1)
    else:
        validate(cfg, world_size=1)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_each_function_returns_targets_only_with_a_critic(name):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 5, generator=gen)
    mask = torch.ones(4, 5, dtype=torch.bool)
    values = torch.randn(4, 5, generator=gen) if ESTIMATORS[name].critic else None
    logprobs = {"teacher_logprobs": -torch.rand(4, 5, generator=gen),
                "logprobs": -torch.rand(4, 5, generator=gen)} if ESTIMATORS[name].teacher else {}
    adv, ret = advantages_for(name, AdvantageInputs(rewards, mask, values, group_size=2,
                                                    whiten_across_ranks=False, **logprobs))
    assert adv.shape == (4, 5) and torch.isfinite(adv).all()
    assert (ret is not None) == ESTIMATORS[name].critic


def test_a_function_without_a_table_row_is_refused():
    with pytest.raises(ValueError, match="no row"):
        register_estimator("ppo_classic")


def _readme_table_names(heading: str) -> list[str]:
    """The first-column names of the README table under `heading` (up to its notes list)."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index(heading):]
    section = section[:section.index("\n\n- ")]
    return re.findall(r"^\| `(\w+)`", section, flags=re.M)


def test_readme_estimator_table_lists_the_rows():
    assert _readme_table_names("## Choosing an estimator") == list(ESTIMATORS)


def test_the_tables_and_the_config_import_no_torch():
    code = ("import sys; import ds_ppo.algo.choices, ds_ppo.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_the_staleness_bound_has_one_home():
    """ppo.max_lag is the schedule's staleness bound (0 sync, 1 one_step_off, max_staleness
    async), and only the config's property computes it from the run's two settings (a
    checkpoint's own saved values may be read with algo/choices.max_lag directly)."""
    import re
    from pathlib import Path

    from ds_ppo.config import PPOConfig

    lags = [PPOConfig(schedule=s, max_staleness=3).max_lag
            for s in ("sync", "one_step_off", "async")]
    assert lags == [0, 1, 3]
    package = Path(__file__).resolve().parents[2] / "ds_ppo"
    callers = sorted(str(f.relative_to(package)) for f in package.rglob("*.py")
                     if re.search(r"\bmax_lag\(\w+(\.ppo)?\.schedule", f.read_text()))
    assert callers == ["config/algorithm.py"]


# --------------------------------------------------------------- policy losses
def test_every_policy_loss_row_has_one_function_and_the_config_accepts_exactly_the_rows():
    from ds_ppo.algo.policy_losses import register_policy_loss
    from ds_ppo.algo.policy_losses import registered as registered_losses

    assert sorted(registered_losses()) == sorted(POLICY_LOSSES)
    assert get_args(PPOConfig.model_fields["policy_loss"].annotation) == tuple(POLICY_LOSSES)
    assert PPOConfig().policy_loss == "ppo"
    with pytest.raises(ValidationError):
        PPOConfig(policy_loss="ppo_classic")
    with pytest.raises(ValueError, match="no row"):
        register_policy_loss("ppo_classic")
    # each row's settings are config keys and settings of the update
    from dataclasses import fields

    from ds_ppo.algo.policy_losses import PolicyLossSettings
    names = {f.name for f in fields(PolicyLossSettings)}
    assert {k for s in POLICY_LOSSES.values() for k in s.settings} == names
    assert names <= set(PPOConfig.model_fields)


def _group_cfg(*extra):
    return load_config("tiny", ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4",
                                *extra])


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_policy_loss_defaults_and_checks_follow_the_row(name):
    spec = POLICY_LOSSES[name]
    assert PPOConfig(policy_loss=name).loss_aggregation == spec.aggregations[0]
    validate(_group_cfg(f"ppo.policy_loss={name}"), world_size=1)  # its default: valid
    for mode in LOSS_AGGREGATIONS:
        cfg = _group_cfg(f"ppo.policy_loss={name}", f"ppo.loss_aggregation={mode}")
        if mode in spec.aggregations:
            validate(cfg, world_size=1)
        else:
            with pytest.raises(ConfigError, match=f"set ppo.loss_aggregation="
                               f"{spec.aggregations[0]}"):
                validate(cfg, world_size=1)
    for est, row in ESTIMATORS.items():
        cfg = load_config("tiny", [f"ppo.advantage_estimator={est}", f"ppo.policy_loss={name}",
                                   "ppo.samples_per_prompt=4"]
                          + (["teacher.arch.model_type=llama"] if row.teacher else []))
        if spec.per_response and not row.per_response:
            with pytest.raises(ConfigError, match="weighs each response by one advantage"):
                validate(cfg, world_size=1)
        else:
            validate(cfg, world_size=1)
    for correction in ("tis", "mis"):
        cfg = _group_cfg(f"ppo.policy_loss={name}", f"ppo.rollout_correction={correction}")
        if spec.token_correction:
            validate(cfg, world_size=1)
        else:
            with pytest.raises(ConfigError, match="ppo.old_logprobs=rollout"):
                validate(cfg, world_size=1)
    validate(_group_cfg(f"ppo.policy_loss={name}", "ppo.old_logprobs=rollout"), world_size=1)


def test_another_losses_settings_are_warned_as_ignored():
    from ds_ppo.config import config_warnings

    cfg = _group_cfg("ppo.policy_loss=gspo", "ppo.gmpo_clip_eps=0.3", "ppo.gspo_clip_eps=1e-3")
    [line] = [w for w in config_warnings(cfg) if "policy loss" in w]
    assert line.startswith("ppo.gmpo_clip_eps: read by another policy loss, ignored with "
                           "ppo.policy_loss = 'gspo'")
    assert not [w for w in config_warnings(_group_cfg("ppo.policy_loss=gmpo",
                                                      "ppo.gmpo_clip_eps=0.3"))
                if "policy loss" in w]


def test_dry_run_refuses_a_contradicting_aggregation_in_one_line(capsys):
    from ds_ppo.cli import main

    assert main(["train", "--dry-run", "ppo.policy_loss=gspo", "ppo.advantage_estimator=grpo",
                 "ppo.samples_per_prompt=4", "ppo.loss_aggregation=token_mean"]) == 2
    err = capsys.readouterr().err
    assert ("ppo.policy_loss = 'gspo' is defined with ppo.loss_aggregation "
            "seq_mean_token_mean") in err
    assert "Traceback" not in err


def test_readme_policy_loss_table_lists_the_rows():
    assert _readme_table_names("## Choosing a policy loss") == list(POLICY_LOSSES)
