"""Packed micro-batches (ppo.micro_batch_tokens): the index/mask math of ds_ppo.algo.packing by
hand, and packed forwards equal to the padded ones (log-probs, entropies, values, losses and
gradients of an update) on CPU in float32."""
from __future__ import annotations

import os
import types
from dataclasses import fields, replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from ds_ppo.algo import (additive_mask, block_causal_mask, cumulative_lengths, packed_layout,
                         response_predictors, token_budget_batches, unpack)
from ds_ppo.engine.forward import response_logprobs, response_values
from conftest import FakeEngine
from support.rollouts import padded_rollout
from support.stage_calls import score_rollout
from test_stages import _cfg

# float32 on CPU: a packed forward sums the same terms as the padded one, in another order and
# with other matmul shapes (~1e-7 relative); a wrong mask or position moves them by ~1e-1
ATOL = 1e-5
# DS_PPO_TEST_DEVICE=cuda runs the packed-equals-padded forward test on a GPU's kernels (fp32,
# TF32 off; with flash-attention 2 too when it is installed): launch/gpu_checks.sh
DEVICE = os.environ.get("DS_PPO_TEST_DEVICE", "cpu")
ATTNS = ["sdpa", "eager"]
if DEVICE == "cuda":
    try:
        import flash_attn  # noqa: F401

        ATTNS.append("flash_attention_2")
    except ImportError:
        pass

# rows of very different lengths (prompt 1..7 tokens, response 1..9), left/right padded
PROMPTS = [[5, 6, 7], [9], [4, 4, 8, 2, 7, 7, 3], [11, 12], [3, 9, 14, 15, 2]]
RESPONSES = [[8, 9, 10, 11], [12, 13, 2, 4, 5, 6, 7, 8, 9], [13], [14, 15, 16], [17, 18]]


# tiny models: one torch thread (tests/conftest.py, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_budget_batches_first_fit_longest_first():
    lengths = [3, 9, 2, 5, 4, 12]
    # longest first: 12 (alone: longer than the budget), 9, 5 (no room after 9: new), 4 (fits
    # with 5), 3 (fits nowhere), 2 (into the 9's micro-batch, the first it fits in)
    assert token_budget_batches(lengths, 10) == [[5], [1], [3, 4], [0, 2]]
    assert token_budget_batches(lengths, 11) == [[5], [1, 2], [3, 4], [0]]
    assert token_budget_batches(lengths, 100) == [[5, 1, 3, 4, 0, 2]]
    assert token_budget_batches(lengths, 10, rows=[0, 2, 4]) == [[4, 0, 2]]
    assert token_budget_batches([4, 4], 4) == [[0], [1]]  # exactly the budget fits


def test_token_micro_batches_idle_ones_and_their_positions():
    rollout = padded_rollout([[1] * n for n in (3, 1, 5, 2)], [[1] * n for n in (1, 6, 2, 5)],
                              P=5, T=6)  # rows of 4, 7, 7, 7 tokens
    batches = rollout.token_micro_batches(11)
    assert batches == [[1, 0], [2], [3]]  # 7 + 4; the other 7s do not fit with a 7
    assert rollout.token_micro_batches(11, rows=[0, 2]) == [[2, 0]]
    padded = rollout.with_idle(batches, 5)
    assert padded == batches + [[0], [0]]  # two idle repeats of the shortest row (4 tokens)
    assert rollout.positions(batches, packed=True) == (25, 25)  # packed: no padding
    # the idle rows' tokens are computed again; score and ppo_update count them as computed only
    assert rollout.positions(padded[3:], packed=True) == (8, 8)
    assert rollout.positions(batches) == (2 * (3 + 6) + 7 + 7, 25)  # padded to 3 + 6 wide


def test_packed_layout_mask_predictors_and_unpack_by_hand():
    # row 0: prompt [a b] response [c]; row 1: prompt [d] response [e f]; pads elsewhere
    keep = torch.tensor([[False, True, True, True, False],
                         [False, False, True, True, True]])
    layout = packed_layout(keep)
    assert layout.place.tolist() == [[-1, 0, 1, 2, -1], [-1, -1, 3, 4, 5]]
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert layout.row_of.tolist() == [0, 0, 0, 1, 1, 1]
    mask = block_causal_mask(layout.row_of)
    assert mask.shape == (1, 1, 6, 6)
    assert mask[0, 0].long().tolist() == [[1, 0, 0, 0, 0, 0],
                                          [1, 1, 0, 0, 0, 0],
                                          [1, 1, 1, 0, 0, 0],
                                          [0, 0, 0, 1, 0, 0],
                                          [0, 0, 0, 1, 1, 0],
                                          [0, 0, 0, 1, 1, 1]]
    add = additive_mask(mask, torch.float32)
    assert (add[mask] == 0).all() and (add[~mask] == torch.finfo(torch.float32).min).all()
    # P = 3 prompt columns; counted responses: row 0 [c], row 1 [e f]
    response_mask = keep[:, 3:]
    pred = response_predictors(layout.place, 3, response_mask)
    assert pred.tolist() == [1, 3, 4]  # b predicts c; d predicts e; e predicts f
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = unpack(x, response_mask)
    assert out.tolist() == [[1.0, 0.0], [2.0, 3.0]]
    out.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]
    cu = cumulative_lengths([3, 3])  # flash-attention's cu_seqlens of the two rows
    assert cu.tolist() == [0, 3, 6] and cu.dtype == torch.int32


def _llama(cls=LlamaForCausalLM, attn="sdpa", **kw):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **kw)
    config._attn_implementation = attn
    return cls(config).eval()


def _on(device: str, rollout):
    return replace(rollout, **{f.name: getattr(rollout, f.name).to(device)
                               for f in fields(rollout)
                               if isinstance(getattr(rollout, f.name), torch.Tensor)})


@pytest.mark.parametrize("attn", ATTNS)
def test_packed_logprobs_entropy_values_equal_padded(attn):
    """Every row's packed outputs equal its padded ones (state tolerance ATOL, fp32); positions
    outside the mask are 0; the forward is one sequence of the real tokens only. On
    DS_PPO_TEST_DEVICE (default cpu)."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("DS_PPO_TEST_DEVICE=cuda without a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    # flash-attention runs in 16 bits only: compare bf16 against bf16 there, at a 16-bit tolerance
    dtype, atol = (torch.bfloat16, 3e-2) if attn == "flash_attention_2" else (torch.float32, ATOL)
    rollout = _on(DEVICE, padded_rollout(PROMPTS, RESPONSES, P=8, T=10))
    policy = _llama(attn=attn).to(DEVICE, dtype)
    widths = []
    hook = policy.model.embed_tokens.register_forward_hook(
        lambda m, args, out: widths.append(tuple(args[0].shape)))
    with torch.no_grad():
        for temp in (1.0, 0.7):
            lp, ent = response_logprobs(policy, rollout, temp, with_entropy=True)
            plp, pent = response_logprobs(policy, rollout, temp, with_entropy=True, packed=True)
            torch.testing.assert_close(plp, lp.masked_fill(~rollout.mask, 0), atol=atol, rtol=0)
            torch.testing.assert_close(pent, ent.masked_fill(~rollout.mask, 0), atol=atol,
                                       rtol=0)
    hook.remove()
    real = sum(map(len, PROMPTS)) + sum(map(len, RESPONSES))
    assert widths[1] == (1, real)  # packed: one sequence, no padding
    assert (plp[rollout.mask] < 0).all() and (plp[~rollout.mask] == 0).all()
    value = _llama(LlamaForTokenClassification, attn=attn, num_labels=1).to(DEVICE, dtype)
    with torch.no_grad():
        v = response_values(value, rollout)
        pv = response_values(value, rollout, packed=True)
    torch.testing.assert_close(pv, v.masked_fill(~rollout.mask, 0), atol=atol, rtol=0)
    assert pv[rollout.mask].abs().min() > 0


def test_packing_without_the_block_mask_would_leak_between_rows(monkeypatch):
    """The test above can fail: with plain causal attention over the packed sequence (rows see
    the rows before them) the later rows' log-probs move far beyond ATOL."""
    import ds_ppo.engine.forward as forward

    rollout = padded_rollout(PROMPTS, RESPONSES, P=8, T=10)
    policy = _llama()
    with torch.no_grad():
        lp, _ = response_logprobs(policy, rollout, 1.0)
        monkeypatch.setattr(forward, "block_causal_mask", lambda row_of: torch.ones(
            1, 1, len(row_of), len(row_of), dtype=torch.bool).tril())
        leaked, _ = response_logprobs(policy, rollout, 1.0, packed=True)
    assert (leaked - lp).masked_fill(~rollout.mask, 0)[1:].abs().max() > 1e-3


ROWS = 8  # two mini-batches of 4 rows, two epochs
UPDATE = ["ppo.rollout_batch_size=8", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
          "ppo.ppo_epochs=2", "ppo.samples_per_prompt=1", "ppo.advantage_estimator=gae",
          "ppo.kl_loss_coef=0.1"]


def _scored_and_updated(extra, monkeypatch=None, more_steps=0, old_noise=0.0, reward_fn=None):
    """Scoring and a PPO update of one rollout with fresh fp32 models: (experience, metrics,
    gradients of every parameter summed over the update, the engines). The fake engines never
    step, so every ratio is 1; `old_noise` > 0 adds that much fixed noise (nats) to the old
    log-probs, so that the ratios spread and the clips act. `reward_fn`: the scores (default:
    each response's length in characters)."""
    from ds_ppo.ppo import advantages, scoring, update
    from ds_ppo.metrics import Accumulator

    if more_steps:  # another rank has more micro-batches: this one runs idle ones (the
        # micro-batch counts are >= 1; the reward function's error code, 0, stays as it is)
        monkeypatch.setattr(scoring.dist, "all_reduce_max",
                            lambda t: t + more_steps if (t > 0).all() else t.clone())
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 50, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 8, (ROWS,), generator=g)]
    responses = [torch.randint(3, 50, (int(n),), generator=g).tolist()
                 for n in torch.randint(1, 10, (ROWS,), generator=g)]
    rollout = padded_rollout(prompts, responses, P=8, T=10)
    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, ValueRole

    cfg = _cfg(*UPDATE, *extra)
    fakes = dict(policy=FakeEngine(_llama()), reference=FakeEngine(_llama()),
                 value=FakeEngine(_llama(LlamaForTokenClassification, num_labels=1,
                                      classifier_dropout=0.0)))
    engines = types.SimpleNamespace(  # a critic-free estimator: no value role
        policy=PolicyRole(fakes["policy"]), reference=ReferenceRole(fakes["reference"]),
        value=ValueRole(fakes["value"]) if cfg.ppo.uses_critic else None,
        reward_fn=reward_fn or (lambda prompts, responses: [float(len(r)) for r in responses]),
        reward=None, teacher=None)
    with torch.no_grad():
        exp = advantages.add_advantages(score_rollout(rollout, engines, cfg),
                                             advantages.advantage_settings(cfg, 0.1))
    if old_noise:
        noise = torch.randn(exp.old_logprobs.shape, generator=torch.Generator().manual_seed(5))
        exp = replace(exp, old_logprobs=exp.old_logprobs + old_noise * noise)
    acc = Accumulator()
    update.ppo_update(exp, engines, update.update_settings(cfg), 1, acc)
    grads = {f"{role}.{n}": p.grad.clone() for role in ("policy", "value")
             for n, p in fakes[role].named_parameters() if p.grad is not None}
    return exp, acc.reduce(), grads, types.SimpleNamespace(**fakes)


@pytest.fixture(scope="module")
def padded():
    return _scored_and_updated([])


@pytest.mark.parametrize("budget, more_steps", [(12, 0), (1000, 0), (30, 2)])
def test_packed_scoring_and_update_equal_padded(padded, budget, more_steps, monkeypatch):
    """ppo.micro_batch_tokens: the scored experience, the update's losses and statistics and
    its gradient (summed over both epochs) equal those of row micro-batches; a budget below the
    longest row (12: several rows alone), one micro-batch per mini-batch, and a middle one with
    another rank having 2 more micro-batches per mini-batch, so this one runs idle (zero-weight)
    ones: nothing changes but the forwards counted and where the step falls."""
    exp, metrics, grads, _ = padded
    pexp, pmetrics, pgrads, engines = _scored_and_updated(
        [f"ppo.micro_batch_tokens={budget}"], monkeypatch, more_steps)
    for name in ("old_logprobs", "ref_logprobs", "old_values", "entropy", "advantages",
                 "returns"):
        torch.testing.assert_close(getattr(pexp, name), getattr(exp, name), atol=ATOL, rtol=0)
    for k in ("loss/policy", "loss/value", "loss/kl", "policy/approx_kl", "policy/clip_frac",
              "policy/ratio_mean", "value/vf_clip_frac", "value/values_mean"):
        assert pmetrics[k] == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), k
    for name, g in grads.items():
        torch.testing.assert_close(pgrads[name], g, atol=1e-5, rtol=1e-4)
    assert metrics["padding/update_positions_per_token"] > 1  # rows of different lengths
    if more_steps == 0:
        assert pmetrics["padding/update_positions_per_token"] == 1.0  # packed: no padding
        assert pexp.scoring_positions[0] == pexp.scoring_positions[1]
    else:
        assert pmetrics["padding/update_positions_per_token"] > 1  # idle micro-batches
        assert pexp.scoring_positions[0] > pexp.scoring_positions[1]
    # the optimizer step is placed on each mini-batch's last micro-batch: once per mini-batch
    boundaries = engines.policy.boundaries
    assert boundaries[-1] and sum(boundaries) == 2 * 2  # 2 epochs x 2 mini-batches
    assert engines.value.boundaries == boundaries
    steps = len(boundaries)  # micro-batches of the update, idle ones included
    assert steps >= 4 * (1 + more_steps) and (budget < 1000 or steps == 4 * (1 + more_steps))
    # policy and value: scoring + update; reference: scoring only
    assert engines.policy.calls == engines.value.calls == engines.reference.calls + steps


def test_flash_path_passes_the_rows_bounds_and_no_mask():
    """With a flash-attention implementation the packed forward passes no mask and the rows'
    bounds as flash-attention's varlen kwargs (cu_seq_lens_*, max_length_*). On CPU a stand-in
    kernel, registered under a flash-like name, attends causally within each row by those
    bounds alone; the log-probs then equal the padded ones."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def varlen(module, query, key, value, attention_mask, cu_seq_lens_q=None,
               cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
        assert attention_mask is None and query.shape[0] == 1
        assert torch.equal(cu_seq_lens_q, cu_seq_lens_k) and max_length_q == max_length_k
        seen.append((cu_seq_lens_q.tolist(), max_length_q))
        bounds = cu_seq_lens_q.tolist()
        outs = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e],
                                       value[:, :, s:e], None, **kwargs)[0]
                for s, e in zip(bounds, bounds[1:])]
        return torch.cat(outs, dim=1), None

    AttentionInterface.register("flash_varlen_cpu_test", varlen)
    rollout = padded_rollout(PROMPTS, RESPONSES, P=8, T=10)
    policy = _llama()
    with torch.no_grad():
        lp, _ = response_logprobs(policy, rollout, 1.0)
        policy.config._attn_implementation = "flash_varlen_cpu_test"
        # through a role wrapper around an engine, as lora.AdaptersOff wraps the policy's
        plp, _ = response_logprobs(_Wrapper(FakeEngine(policy)), rollout, 1.0, packed=True)
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    assert seen[0] == ([sum(lengths[:i]) for i in range(len(lengths) + 1)], max(lengths))
    torch.testing.assert_close(plp, lp.masked_fill(~rollout.mask, 0), atol=ATOL, rtol=0)


class _Wrapper:
    """A role wrapper (like lora.AdaptersOff): `.engine`, called with keyword inputs."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, **inputs):
        return self.engine(**inputs)


def test_unknown_attention_implementation_leaves_the_rows_to_transformers():
    """A model whose attention implementation cannot be read gets no mask, only the restarting
    position ids, from which transformers builds the block-diagonal mask itself."""
    rollout = padded_rollout(PROMPTS, RESPONSES, P=8, T=10)
    policy = _llama()
    masks = []
    hook = policy.model.register_forward_pre_hook(
        lambda m, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    with torch.no_grad():
        lp, _ = response_logprobs(policy, rollout, 1.0)
        plp, _ = response_logprobs(lambda **inputs: policy(**inputs), rollout, 1.0, packed=True)
    hook.remove()
    assert masks[1] is None
    torch.testing.assert_close(plp, lp.masked_fill(~rollout.mask, 0), atol=ATOL, rtol=0)
