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
from ds_ppo.algo.choices import ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS
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
    else:
        validate(cfg, world_size=1)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_each_function_returns_targets_only_with_a_critic(name):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 5, generator=gen)
    mask = torch.ones(4, 5, dtype=torch.bool)
    values = torch.randn(4, 5, generator=gen) if ESTIMATORS[name].critic else None
    adv, ret = advantages_for(name, AdvantageInputs(rewards, mask, values, group_size=2,
                                                    whiten_across_ranks=False))
    assert adv.shape == (4, 5) and torch.isfinite(adv).all()
    assert (ret is not None) == ESTIMATORS[name].critic


def test_a_function_without_a_table_row_is_refused():
    with pytest.raises(ValueError, match="no row"):
        register_estimator("ppo_classic")


def test_readme_estimator_table_lists_the_rows():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Choosing an estimator"):]
    section = section[:section.index("\n\n- ")]
    names = re.findall(r"^\| `(\w+)`", section, flags=re.M)
    assert names == list(ESTIMATORS)


def test_the_tables_and_the_config_import_no_torch():
    code = ("import sys; import ds_ppo.algo.choices, ds_ppo.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_the_staleness_bound_has_one_home():
    """ppo.max_lag is the schedule's staleness bound (0 sync, 1 one_step_off, max_staleness
    async), and outside algo/ only the config's property computes it from the two settings."""
    import re
    from pathlib import Path

    from ds_ppo.config import PPOConfig

    lags = [PPOConfig(schedule=s, max_staleness=3).max_lag
            for s in ("sync", "one_step_off", "async")]
    assert lags == [0, 1, 3]
    package = Path(__file__).resolve().parents[2] / "ds_ppo"
    callers = sorted(str(f.relative_to(package)) for f in package.rglob("*.py")
                     if re.search(r"\bmax_lag\(", f.read_text()) and f.parts[-2] != "algo")
    assert callers == ["config/algorithm.py"]
