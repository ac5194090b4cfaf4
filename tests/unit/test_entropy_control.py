"""The entropy bonus's coefficient (ds_ppo/algo/entropy.py): hand-worked values of the controller
towards ppo.entropy_target, its bounds, a fixed coefficient without a target, and its state."""
from __future__ import annotations

import pytest
import torch

from ds_ppo.algo import EntropyController


def test_entropy_controller_hand_worked():
    ctl = EntropyController(max_coef=0.01, target=2.0)
    assert ctl.value == 0.01  # before any entropy is measured: the ceiling
    # entropy 3.0, above the target: 0.01 x clip(1 - 1.5, 0, 1) = 0 (no bonus)
    ctl.update(3.0)
    assert ctl.value == 0.0
    # entropy 1.5: 0.01 x (1 - 0.75) = 0.0025
    ctl.update(torch.tensor(1.5))
    assert ctl.value == pytest.approx(0.0025)
    # entropy 0.5: 0.01 x (1 - 0.25) = 0.0075
    ctl.update(0.5)
    assert ctl.value == pytest.approx(0.0075)
    # at the target: 0; at entropy 0: the ceiling
    ctl.update(2.0)
    assert ctl.value == 0.0
    ctl.update(0.0)
    assert ctl.value == 0.01


def test_entropy_controller_without_a_target_is_the_fixed_coefficient():
    ctl = EntropyController(max_coef=0.005)
    for h in (0.0, 6.0, 0.1):
        ctl.update(h)
        assert ctl.value == 0.005


def test_entropy_controller_state_restores_the_coefficient():
    ctl = EntropyController(max_coef=0.01, target=2.0)
    ctl.update(1.0)
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = EntropyController(max_coef=0.01, target=2.0)
    assert restored.value != ctl.value
    restored.load_state_dict(state)
    assert restored.value == ctl.value == pytest.approx(0.005)
    # a checkpoint without the key (written without ppo.entropy_target) keeps the start
    fresh = EntropyController(max_coef=0.01, target=2.0)
    fresh.load_state_dict({})
    assert fresh.value == 0.01
    # a lower ceiling on resume clamps the saved value
    lower = EntropyController(max_coef=0.001, target=2.0)
    lower.load_state_dict({"value": 0.008})
    assert lower.value == 0.001


@pytest.mark.parametrize("max_coef,target", [(-0.1, 1.0), (0.01, 0.0), (0.01, -1.0)])
def test_entropy_controller_refuses_bad_settings(max_coef, target):
    with pytest.raises(ValueError):
        EntropyController(max_coef, target)
