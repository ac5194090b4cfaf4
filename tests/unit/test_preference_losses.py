"""The preference losses of `ds-ppo dpo` (algo/preference.py) against the papers' formulas written
out pair by pair in float64 (Python floats, math.log), on ragged answers: padding values never
change a result, the table and the registry name the same losses, and the gradients go to the
policy's log-probs only."""
from __future__ import annotations

import math

import pytest
import torch

from ds_ppo.algo.choices import PREFERENCE_LOSSES
from ds_ppo.algo.preference import (PairLogps, PreferenceSettings, preference_loss_for,
                                    registered, reward_stats, sequence_logps)


def _ragged(seed: int, pairs: int = 5, T: int = 7):
    """Token log-probs (2, P, T) of the chosen and rejected answers of the policy and the
    reference, and masks of 1..T counted tokens, with garbage at the masked positions."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand((4, pairs, T), generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, T + 1, (2, pairs), generator=g)
    mask = torch.arange(T)[None, None] < lengths[..., None]  # (2, P, T)
    lp = torch.where(torch.cat([mask, mask]), lp, torch.full_like(lp, 1e6))  # never counted
    return lp, mask


def _seq(lp_row, mask_row, mean):
    vals = [float(v) for v, m in zip(lp_row, mask_row) if m]
    return sum(vals) / len(vals) if mean else sum(vals)


def _logsig(z):
    return -math.log1p(math.exp(-z)) if z > 0 else z - math.log1p(math.exp(z))


def _oracle(name, lp, mask, beta, eps, gamma):
    """The paper's loss of each pair, by hand (float64 Python floats)."""
    mean = PREFERENCE_LOSSES[name].length_normalised
    out = []
    for i in range(lp.shape[1]):
        pw, pl = _seq(lp[0, i], mask[0, i], mean), _seq(lp[1, i], mask[1, i], mean)
        rw, rl = _seq(lp[2, i], mask[0, i], mean), _seq(lp[3, i], mask[1, i], mean)
        if name == "sigmoid":  # Rafailov et al. 2023 Eq. 7; conservative DPO's eps
            z = beta * ((pw - rw) - (pl - rl))
            out.append(-(1 - eps) * _logsig(z) - eps * _logsig(-z))
        elif name == "ipo":  # Azar et al. 2023 Eq. 17 (per-token means)
            out.append(((pw - rw) - (pl - rl) - 1 / (2 * beta)) ** 2)
        else:  # SimPO, Meng et al. 2024 Eq. 6
            z = beta * pw - beta * pl - gamma
            out.append(-(1 - eps) * _logsig(z) - eps * _logsig(-z))
    return out


def _inputs(name, lp, mask):
    mean = PREFERENCE_LOSSES[name].length_normalised
    seqs = [sequence_logps(lp[k], mask[k % 2], mean) for k in range(4)]
    return PairLogps(*seqs)


@pytest.mark.parametrize("name,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0),
                                      ("simpo", 0.0), ("simpo", 0.1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_loss_is_its_papers_formula(name, eps, seed):
    lp, mask = _ragged(seed)
    beta, gamma = 0.3, 0.4
    out = preference_loss_for(name, _inputs(name, lp, mask),
                              PreferenceSettings(beta, eps, gamma))
    # the sequence log-probs are float32: a tolerance of float32's, on float64's formula
    assert out.losses.tolist() == pytest.approx(_oracle(name, lp, mask, beta, eps, gamma),
                                                rel=1e-5, abs=1e-5)


def test_sequence_logps_sum_and_mean_by_hand():
    lp = torch.tensor([[-1.0, -2.0, 99.0], [-0.5, 99.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert sequence_logps(lp, mask).tolist() == [-3.0, -0.5]
    assert sequence_logps(lp, mask, mean=True).tolist() == [-1.5, -0.5]
    assert sequence_logps(lp, torch.zeros_like(mask), mean=True).tolist() == [0.0, 0.0]


def test_rewards_accuracy_and_margin_by_hand():
    x = PairLogps(torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -2.0]),
                  torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]))
    out = preference_loss_for("sigmoid", x, PreferenceSettings(0.5))
    assert out.chosen_rewards.tolist() == [0.5, -1.0]  # beta (log pi - log ref)
    assert out.rejected_rewards.tolist() == [-0.5, 0.0]
    stats = reward_stats(out)
    assert float(stats["correct"]) == 1.0 and float(stats["margin"]) == pytest.approx(0.0)
    simpo = preference_loss_for("simpo", PairLogps(x.chosen, x.rejected), PreferenceSettings(2.0))
    assert simpo.chosen_rewards.tolist() == [-2.0, -8.0]  # beta x mean log pi, no reference


def test_gradients_reach_the_policy_only():
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    pr = torch.tensor([-1.5, -1.0], requires_grad=True)
    rc = torch.tensor([-1.2, -1.8], requires_grad=True)
    rr = torch.tensor([-1.4, -1.1], requires_grad=True)
    for name in ("sigmoid", "ipo"):
        preference_loss_for(name, PairLogps(pc, pr, rc, rr), PreferenceSettings(0.1)
                            ).losses.sum().backward()
    assert pc.grad is not None and rc.grad is None and rr.grad is None
    # DPO's gradient on the chosen answer: -beta sigmoid(-beta h) (Rafailov et al. Eq. 8), + IPO's
    h = (pc - rc - pr + rr).detach()
    want = -0.1 * torch.sigmoid(-0.1 * h) + 2 * (h - 1 / 0.2)
    assert pc.grad.tolist() == pytest.approx(want.tolist(), rel=1e-5)


def test_a_reference_loss_refuses_inputs_without_the_reference():
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss_for("sigmoid", PairLogps(torch.zeros(1), torch.zeros(1)),
                            PreferenceSettings(0.1))


def test_the_table_and_the_registry_name_the_same_losses():
    assert registered() == tuple(PREFERENCE_LOSSES) == ("sigmoid", "ipo", "simpo")
    assert [n for n, s in PREFERENCE_LOSSES.items() if not s.reference] == ["simpo"]


def test_the_guide_and_the_config_read_the_table():
    """docs/GUIDE.md's table of losses, the config's literal type and its description name the
    table's rows, in its order."""
    import re
    from typing import get_args

    from conftest import REPO
    from ds_ppo.config import DPOConfig

    guide = (REPO / "docs" / "GUIDE.md").read_text()
    section = guide[guide.index("| `dpo.loss` |"):]
    section = section[:section.index("\n\n")]
    assert re.findall(r"^\| `(\w+)`", section, flags=re.M) == list(PREFERENCE_LOSSES)
    field = DPOConfig.model_fields["loss"]
    assert get_args(field.annotation) == tuple(PREFERENCE_LOSSES)
    assert all(s.paper in field.description for s in PREFERENCE_LOSSES.values())
