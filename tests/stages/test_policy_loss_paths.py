"""Every ppo.policy_loss through the update's real micro-batch paths on CPU in float32: packed
micro-batches (ppo.micro_batch_tokens) with tiled logits give the padded, untiled update's
losses, statistics and gradients (two epochs of two mini-batches, fresh tiny models). A
sequence-level loss needs each response whole in one micro-batch: a wrong split or a mean over
the packed sequence instead of the response would move its loss by far more than float noise.
(ppo itself: tests/stages/test_packing.py and test_long_context.py.)"""
from __future__ import annotations

import pytest
import torch

from ds_ppo.algo.choices import ESTIMATORS, POLICY_LOSSES
from test_packing import _scored_and_updated

# critic-free (no value model to run), 2 responses per prompt: one advantage per response, as
# gspo and gmpo need; clips that some responses and tokens pass and others do not
BASE = ["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=2", "ppo.rollout_batch_size=4",
        "ppo.kl_in_reward=false", "ppo.gspo_clip_eps=0.02", "ppo.gspo_clip_eps_high=0.03",
        "ppo.gmpo_clip_eps=0.1", "ppo.cispo_eps_high=0.1",
        "ppo.ppo_epochs=1"]  # the fake engines never step: a second epoch repeats the first
PACKED_TILED = ["ppo.micro_batch_tokens=12", "ppo.tiled_logits=true",
                "ppo.logits_tile_tokens=5"]
LOSSES = [n for n in POLICY_LOSSES if n != "ppo"]


def _scores(prompts, responses):
    """Scores by place in the batch (the test rollout's texts are empty): every group of 2
    differs."""
    return [float(i % 3) for i in range(len(responses))]


def _run(name: str, extra: list[str]):
    return _scored_and_updated([*BASE, f"ppo.policy_loss={name}", *extra], old_noise=0.1,
                               reward_fn=_scores)


@pytest.mark.parametrize("name", LOSSES)
def test_packed_tiled_update_equals_padded(name):
    assert ESTIMATORS["rloo"].per_response
    exp, metrics, grads, _ = _run(name, [])
    pexp, pmetrics, pgrads, _ = _run(name, PACKED_TILED)
    assert torch.equal(pexp.advantages, exp.advantages) and exp.advantages.abs().max() > 0
    keys = [k for k in metrics if k.startswith("policy/") and k != "policy/grad_norm"]
    assert {"policy/approx_kl", "policy/ratio_mean"} <= set(keys)
    for k in ["loss/policy", "loss/kl", *keys]:
        assert pmetrics[k] == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), k
    assert metrics["policy/approx_kl"] > 0  # the old log-probs' noise: ratios spread
    clip = [k for k in keys if "clip_frac" in k]
    assert all(0 < metrics[k] < 1 for k in clip), {k: metrics[k] for k in clip}
    assert pmetrics["padding/update_positions_per_token"] == 1.0  # packed: no padding
    assert metrics["padding/update_positions_per_token"] > 1
    assert grads.keys() == pgrads.keys() and any(g.abs().max() > 0 for g in grads.values())
    for n, g in grads.items():
        torch.testing.assert_close(pgrads[n], g, atol=1e-5, rtol=1e-4)
