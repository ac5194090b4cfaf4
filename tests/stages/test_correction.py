"""Rollout correction on a real mismatch: responses sampled by a perturbed replica (as a
bf16 or differently-batched replica would differ from the trainer), scored by the trainer's
model; the measured gap, the importance weights and the policy loss's mask against hand
computations (ds_ppo.ppo.correction, ds_ppo.algo.importance_sampling)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from test_continuous import _prompts, _rollout
from test_decode import EOS, PAD, tiny_llama

from ds_ppo.config import load_config
from ds_ppo.containers import Experience
from ds_ppo.engine.generation.loop import decode
from ds_ppo.engine.forward import response_logprobs
from ds_ppo.errors import ConfigError
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.correction import correction_settings, rollout_correction
from ds_ppo.ppo.update import _policy_mask_and_weights, update_settings

EOS_IDS = [EOS, *range(5, 9)]


@pytest.fixture(scope="module")
def mismatch():
    """(experience, per-token hand lists): a replica with noise on its weights samples 8
    responses (3 slots, continuous); the trainer's model gives the old log-probs."""
    model = tiny_llama(seed=5)
    replica = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in replica.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ids, mask = _prompts(8, 5)
    torch.manual_seed(1)
    out = decode(replica, ids, mask, max_new_tokens=10, eos_ids=EOS_IDS, pad_id=PAD,
                 temperature=1.0, stop_check_every=2, slots=3)
    rollout = _rollout(ids, mask, out.response_ids, EOS_IDS)
    rollout.rollout_logprobs = out.logprobs
    with torch.no_grad():
        old, _ = response_logprobs(model, rollout, 1.0)
    zeros = torch.zeros_like(old)
    exp = Experience(rollout=rollout, old_logprobs=old.masked_fill(~rollout.mask, 0.0),
                     ref_logprobs=zeros, old_values=None, scores=torch.zeros(8), entropy=zeros,
                     advantages=zeros)
    pairs = [(float(exp.old_logprobs[b, t]), float(out.logprobs[b, t]))
             for b in range(8) for t in range(rollout.mask.shape[1]) if rollout.mask[b, t]]
    return exp, pairs


def _run(exp, mode, cap=1.5):
    cfg = load_config(None, [f"ppo.rollout_correction={mode}", f"ppo.rollout_is_cap={cap}"])
    acc = Accumulator()
    out = rollout_correction(exp, correction_settings(cfg), acc)
    return out, acc.reduce(), cfg


def test_gap_metrics_by_hand(mismatch):
    exp, pairs = mismatch
    _, metrics, _ = _run(exp, "none")
    diffs = [abs(o - r) for o, r in pairs]
    k3 = [math.exp(o - r) - 1 - (o - r) for o, r in pairs]
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs),
                                                                     rel=1e-5)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(max(diffs), rel=1e-5)
    assert metrics["rollout/kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    assert metrics["rollout/logprob_abs_diff_mean"] > 0.01  # the perturbation shows
    assert "rollout_is/weight_mean" not in metrics


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_weights_and_policy_mask_by_hand(mismatch, mode):
    exp, pairs = mismatch
    cap = 1.5
    out, metrics, cfg = _run(exp, mode, cap)
    mask = exp.mask
    ratios = [math.exp(o - r) for o, r in pairs]
    if mode == "tis":
        want = [min(r, cap) for r in ratios]
        cut = [r > cap for r in ratios]
    else:
        cut = [not (1 / cap <= r <= cap) for r in ratios]
        want = [0.0 if c else r for r, c in zip(ratios, cut)]
    torch.testing.assert_close(out.is_weights[mask], torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert 0 < sum(cut) < len(cut)  # the cap acted on some tokens, not all
    kept = [w for w, c in zip(want, cut) if not (mode == "mis" and c)]
    assert metrics["rollout_is/weight_mean"] == pytest.approx(sum(kept) / len(kept), rel=1e-5)
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(sum(cut) / len(cut), rel=1e-6)
    # the update: mis leaves the dropped tokens out of the loss and its divisor's lengths
    pg_mask, agg_weights, pg_weights = _policy_mask_and_weights(out, update_settings(cfg),
                                                                filtered=False)
    assert agg_weights is None and torch.equal(pg_weights, out.is_weights)
    dropped = mask & ~pg_mask
    assert int(dropped.sum()) == (sum(cut) if mode == "mis" else 0)
    assert out.is_kept_lens == pg_mask.sum(1).tolist()


def test_correction_without_rollout_logprobs_is_an_error(mismatch):
    exp, _ = mismatch
    from dataclasses import replace

    hf = replace(exp, rollout=replace(exp.rollout, rollout_logprobs=None))
    assert _run(hf, "none")[1] == {}  # HF generate: nothing to measure
    with pytest.raises(ConfigError, match="rollout_correction"):
        _run(hf, "tis")


def test_require_exact_stops_on_any_gap(mismatch):
    """generation.require_exact: a gap stops the run with one line naming it and the fix
    (after the metrics are recorded), which is not generation.batch_invariant where that is
    on already; no gap passes; a rollout from HF generate has none to
    compare, a ConfigError."""
    from dataclasses import replace

    from ds_ppo.errors import NotOnPolicy

    exp, pairs = mismatch
    cfg = correction_settings(load_config(None, ["generation.require_exact=true"]))
    acc = Accumulator()
    with pytest.raises(NotOnPolicy) as info:
        rollout_correction(exp, cfg, acc)
    worst = max(abs(o - r) for o, r in pairs)
    assert f"by up to {worst:.3g} nats" in str(info.value)
    assert "generation.batch_invariant=true" in str(info.value) and "\n" not in str(info.value)
    # with the kernels already on, the line does not advise them
    on = correction_settings(load_config(None, ["generation.require_exact=true",
                                                "generation.batch_invariant=true"]))
    with pytest.raises(NotOnPolicy) as info_on:
        rollout_correction(exp, on, Accumulator())
    line = str(info_on.value)
    assert "generation.batch_invariant = true" in line and "batch_invariant=true" not in line
    assert line.endswith("set generation.require_exact=false") and "\n" not in line
    assert acc.reduce()["rollout/logprob_abs_diff_max"] == pytest.approx(worst, rel=1e-5)
    same = replace(exp, old_logprobs=exp.rollout.rollout_logprobs.clone())
    assert rollout_correction(same, cfg, Accumulator()) is same
    hf = replace(exp, rollout=replace(exp.rollout, rollout_logprobs=None))
    with pytest.raises(ConfigError, match="generation.require_exact = True needs"):
        rollout_correction(hf, cfg, Accumulator())
