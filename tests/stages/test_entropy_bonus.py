"""ppo.entropy_coef without DeepSpeed: the policy's gradient of one optimizer step is the PPO
loss's gradient minus entropy_coef x the gradient of the policy's entropy, aggregated as
ppo.loss_aggregation and computed here by hand from the model's logits (plain autograd), for a
critic and critic-free estimators, tiled and untiled."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from ds_ppo.config import max_model_tokens
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo import update
from ds_ppo.bench.stand_ins import small_llama
from test_recipe_extras import UPDATE, _engines, _experience, _grads
from test_stages import _cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def _entropy_by_hand(model, rollout, temperature: float, mode: str, max_new: int,
                     floor: float | None = None):
    """The aggregated entropy of `model` over `rollout`'s response tokens, one row at a time,
    with autograd's own softmax (no ds_ppo kernel). `floor`: each token's entropy weighted by
    the constant clip(1 - H / floor, 0, 1) (ppo.entropy_target_scope=token)."""
    per_row, tokens = [], 0
    for b in range(len(rollout)):
        P, R = rollout.prompt_lens[b], rollout.response_lens[b]
        ids = torch.cat([rollout.prompt_ids[b, rollout.prompt_ids.shape[1] - P:],
                         rollout.response_ids[b, :R]])[None]
        z = model(ids).logits[0, P - 1:P + R - 1].float() / temperature  # (R, V)
        h = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)  # (R,)
        if floor is not None:
            h = h * (1 - h.detach() / floor).clamp(0, 1)
        per_row.append((h.sum(), R))
        tokens += R
    if mode == "token_mean":
        return sum(s for s, _ in per_row) / tokens
    if mode == "seq_mean_token_mean":
        return sum(s / max(n, 1) for s, n in per_row) / len(per_row)
    return sum(s / max_new for s, _ in per_row) / len(per_row)


@pytest.mark.parametrize("estimator,mode,extra", [
    ("gae", "token_mean", []),
    ("grpo", "seq_mean_token_mean", ["ppo.kl_loss_coef=0.1", "ppo.kl_estimator=k3"]),
    ("rloo", "seq_mean_token_sum_norm", ["ppo.tiled_logits=true", "ppo.logits_tile_tokens=3"]),
    ("reinforce_pp", "token_mean", ["ppo.tiled_logits=true", "ppo.logits_tile_tokens=5"]),
])
def test_entropy_bonus_gradient_by_hand(estimator, mode, extra):
    coef = 0.05
    group = [] if estimator == "gae" else ["ppo.samples_per_prompt=2",
                                          "ppo.rollout_batch_size=2"]
    base = _cfg(*UPDATE, *group, f"ppo.advantage_estimator={estimator}",
                f"ppo.loss_aggregation={mode}", "generation.temperature=0.8", *extra)
    bonus = _cfg(*UPDATE, *group, f"ppo.advantage_estimator={estimator}",
                 f"ppo.loss_aggregation={mode}", "generation.temperature=0.8", *extra,
                 f"ppo.entropy_coef={coef}")

    def run(cfg):
        fakes, engines = _engines()
        if not cfg.ppo.uses_critic:
            engines.value = None
        exp = _experience(cfg, engines)
        acc = Accumulator()
        update.ppo_update(exp, engines, update.update_settings(cfg), 1, acc)
        return _grads(fakes.policy.module), acc.reduce(), exp

    with_bonus, m, exp = run(bonus)
    without, m0, _ = run(base)
    assert "loss/entropy" in m and "loss/entropy" not in m0
    assert m["loss/policy"] == pytest.approx(m0["loss/policy"], rel=1e-6)
    model = small_llama(LlamaForCausalLM, pad_token_id=0)  # the same initial weights
    want = _entropy_by_hand(model, exp.rollout, 0.8, mode, max_model_tokens(bonus))
    want.backward()
    assert m["loss/entropy"] == pytest.approx(float(want.detach()), rel=1e-5)
    # FakeEngine does not divide by DeepSpeed's accumulation steps (2), which the update's
    # scale undoes: every term of its gradients is 2x the loss's
    accum = 2
    for n, p in model.named_parameters():
        torch.testing.assert_close(with_bonus[n], without[n] - accum * coef * p.grad,
                                   atol=1e-6, rtol=1e-4)
    assert any(float(p.grad.abs().max()) > 1e-4 for p in model.parameters())


def test_entropy_coef_zero_is_the_default_and_computes_no_entropy_in_the_update():
    """The default run is unchanged: no entropy in the update's forwards (the scoring forward
    measured policy/entropy), no loss/entropy metric."""
    cfg = _cfg(*UPDATE)
    assert cfg.ppo.entropy_coef == 0
    fakes, engines = _engines()
    asked = []
    original = engines.policy.logprobs

    def logprobs(*args, **kwargs):
        asked.append((kwargs.get("with_entropy"), kwargs.get("entropy_grad")))
        return original(*args, **kwargs)

    exp = _experience(cfg, engines)
    engines.policy.logprobs = logprobs
    acc = Accumulator()
    update.ppo_update(exp, engines, update.update_settings(cfg), 1, acc)
    assert asked and set(asked) == {(False, False)}
    assert "loss/entropy" not in acc.reduce()


def test_the_update_trains_with_the_coefficient_it_is_given():
    """ppo.entropy_target's controller hands the update its coefficient: the one given replaces
    ppo.entropy_coef (0: no bonus, no entropy in the update's forwards)."""
    coef = 0.05
    plain = _cfg(*UPDATE)
    bonus = _cfg(*UPDATE, f"ppo.entropy_coef={coef}")

    def run(cfg, **kwargs):
        fakes, engines = _engines()
        exp = _experience(cfg, engines)
        acc = Accumulator()
        update.ppo_update(exp, engines, update.update_settings(cfg), 1, acc, **kwargs)
        return _grads(fakes.policy.module), acc.reduce()

    with_bonus, m = run(bonus)
    given, m_given = run(plain, entropy_coef=coef)
    switched_off, m_off = run(bonus, entropy_coef=0.0)
    without, _ = run(plain)
    assert "loss/entropy" in m_given and "loss/entropy" not in m_off
    assert m_given["loss/entropy"] == m["loss/entropy"]
    for n in with_bonus:
        assert torch.equal(given[n], with_bonus[n]), n
        assert torch.equal(switched_off[n], without[n]), n
    assert any(not torch.equal(with_bonus[n], without[n]) for n in with_bonus)


def test_entropy_floor_gradient_by_hand():
    """ppo.entropy_target_scope=token: the bonus's gradient is that of each token's entropy
    weighted by the constant clip(1 - H_t / entropy_target, 0, 1), at the fixed coefficient
    entropy_coef; policy/entropy_below_target is the share of tokens below the target."""
    coef, mode = 0.05, "token_mean"
    base = _cfg(*UPDATE, f"ppo.loss_aggregation={mode}")
    model = small_llama(LlamaForCausalLM, pad_token_id=0)  # the update's initial weights
    fakes, engines = _engines()
    exp = _experience(base, engines)
    with torch.no_grad():  # every token of the random model is near the vocabulary's log
        high = max(float(_entropy_by_hand(model, exp.rollout.slice([b]), 1.0, mode, 1))
                   for b in range(len(exp)))
    # twice the highest row's mean: every token below it, weights near 1/2, and a weight that
    # took part in the gradient (d/dH of (1 - H/T) H = 1 - 2H/T) would cancel the bonus's
    floor = 2 * high
    cfg = _cfg(*UPDATE, f"ppo.loss_aggregation={mode}", f"ppo.entropy_coef={coef}",
               f"ppo.entropy_target={floor}", "ppo.entropy_target_scope=token")

    def run(c):
        fakes, engines = _engines()
        acc = Accumulator()
        update.ppo_update(_experience(c, engines), engines, update.update_settings(c), 1, acc)
        return _grads(fakes.policy.module), acc.reduce()

    with_floor, m = run(cfg)
    without, m0 = run(base)
    want = _entropy_by_hand(model, exp.rollout, 1.0, mode, max_model_tokens(cfg), floor)
    want.backward()
    assert m["loss/entropy"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert m["policy/entropy_below_target"] == 1.0 and "policy/entropy_below_target" not in m0
    accum = 2  # as above: FakeEngine does not divide by the accumulation steps
    for n, p in model.named_parameters():
        torch.testing.assert_close(with_floor[n], without[n] - accum * coef * p.grad,
                                   atol=1e-6, rtol=1e-4)
