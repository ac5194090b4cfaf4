"""The entropy bonus's coefficient (ds_ppo/algo/entropy.py): hand-worked steps of the controller
towards ppo.entropy_target, its bounds, a fixed coefficient without a target, and its state."""
from __future__ import annotations

import pytest
import torch

from ds_ppo.algo import ENTROPY_STEPS, EntropyController


def test_entropy_controller_hand_worked():
    assert ENTROPY_STEPS == 10
    ctl = EntropyController(max_coef=0.01, target=1.0)
    assert ctl.value == 0.01  # starts at the ceiling
    # entropy 3.0: error 1 - 3 = -2, clipped to -1: 0.01 - 0.01 x 1 / 10 = 0.009
    ctl.update(3.0)
    assert ctl.value == pytest.approx(0.009)
    # entropy 0.5: error 0.5: 0.009 + 0.01 x 0.5 / 10 = 0.0095
    ctl.update(torch.tensor(0.5))
    assert ctl.value == pytest.approx(0.0095)
    # entropy 1.2: error -0.2: 0.0095 - 0.0002 = 0.0093
    ctl.update(1.2)
    assert ctl.value == pytest.approx(0.0093)
    # entropy 0: error 1: 0.0093 + 0.001 = 0.0103, clamped to the ceiling 0.01
    ctl.update(0.0)
    assert ctl.value == 0.01
    # above the target it falls to 0 and stays there (no bonus above the target)
    for _ in range(ENTROPY_STEPS):
        ctl.update(5.0)
    assert ctl.value == pytest.approx(0.0, abs=1e-12)
    ctl.update(5.0)
    assert ctl.value == 0.0
    # at the target it does not move
    ctl.update(1.0)
    assert ctl.value == 0.0


def test_entropy_controller_without_a_target_is_the_fixed_coefficient():
    ctl = EntropyController(max_coef=0.005)
    for h in (0.0, 6.0, 0.1):
        ctl.update(h)
        assert ctl.value == 0.005


def test_entropy_controller_state_restores_the_coefficient():
    ctl = EntropyController(max_coef=0.01, target=2.0)
    for h in (5.0, 4.0, 1.0):
        ctl.update(h)
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = EntropyController(max_coef=0.01, target=2.0)
    restored.load_state_dict(state)
    assert restored.value == ctl.value
    ctl.update(0.5), restored.update(0.5)
    assert restored.value == ctl.value
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
