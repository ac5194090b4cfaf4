"""The RLHF recipe's extras without DeepSpeed: a critic started from a
reward model's export, the critic warm-up, the policy's EMA (engine/ema.py) and PPO-ptx (its
rows, its stream, and its gradient by hand)."""
from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import (AutoConfig, GPT2Config, GPT2ForSequenceClassification,
                          LlamaForCausalLM, LlamaForSequenceClassification,
                          LlamaForTokenClassification)

from conftest import FakeEngine
from ds_ppo.data.ptx import PtxRows, PtxStream, lm_rollout, load_ptx
from ds_ppo.engine.ema import ParamEMA, _fill
from ds_ppo.engine.forward import LastTokenScorer, response_values
from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, ValueRole
from ds_ppo.engine.roles import load_value_model
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo import advantages, update
from ds_ppo.bench.stand_ins import small_llama
from support.rollouts import padded_rollout
from support.stage_calls import score_rollout
from test_stages import _cfg


# tiny models: one torch thread (tests/conftest.py, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _small(cls, **kw):
    return small_llama(cls, pad_token_id=0, **kw)


# ------------------------------------------------------------------ critic from the RM
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_value_model_from_a_reward_model_export_starts_with_its_scores(arch, tmp_path):
    """value.path = an AutoModelForSequenceClassification export (num_labels 1): the value
    model's per-token value at a sequence's last token is the reward model's score of that
    sequence, before any training. Llama's token-classification head is `score` like the
    reward model's; GPT-2's is `classifier`, which the export's `score` is renamed into
    (without the rename it would be a new random head)."""
    torch.manual_seed(0)
    if arch == "llama":
        rm = _small(LlamaForSequenceClassification, num_labels=1)
    else:
        rm = GPT2ForSequenceClassification(GPT2Config(
            vocab_size=50, n_embd=16, n_layer=1, n_head=2, num_labels=1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)).eval()
    rm.save_pretrained(tmp_path / "rm")
    config = AutoConfig.from_pretrained(tmp_path / "rm", num_labels=1)
    config.classifier_dropout, config.token_classification_bias = 0.0, False  # as _init_value
    value = load_value_model(str(tmp_path / "rm"), config, dtype=torch.float32).eval()
    rollout = padded_rollout([[5, 6, 7], [9, 3]], [[8, 9, 10, 11], [12, 13]], P=4, T=5)
    with torch.no_grad():
        values = response_values(value, rollout)  # value before each response token
        for b, n in enumerate(rollout.response_lens):
            # the value before the last token = the RM's score of the row without that token
            short = rollout.slice([b])
            short.mask = short.mask.clone()
            short.mask[0, n - 1] = False
            ids, am = short.input_ids, short.attention_mask
            score = LastTokenScorer(rm)(ids, am)
            torch.testing.assert_close(values[b, n - 1], score[0], atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------- EMA
def test_ema_follows_each_step_swaps_in_and_restores_exactly(tmp_path):
    model = _small(LlamaForCausalLM)
    ema = ParamEMA(model, decay=0.75)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = []
    for k in range(2):  # two "optimizer steps"
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ema.update()
    w2 = steps[-1]
    expected = {n: 0.75 ** 2 * w0[n] + 0.75 * 0.25 * steps[0][n] + 0.25 * w2[n] for n in w0}
    with ema.swapped_in():
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[n], atol=1e-6, rtol=1e-6)
    for n, p in model.named_parameters():  # the weights are back, bit for bit
        assert torch.equal(p.detach(), w2[n]), n
    dist = sum(float((expected[n] - w2[n]).double().pow(2).sum()) for n in w0) ** 0.5
    assert ema.distance() == pytest.approx(dist, rel=1e-5)
    # a checkpoint's round trip is exact; a fresh EMA loaded from it equals this one
    (tmp_path / "ema").mkdir()
    ema.save(tmp_path / "ema")
    other = ParamEMA(model, decay=0.75)
    assert other.distance() == 0.0
    other.load(tmp_path / "ema", same_world=True)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, other.shadow))


def test_ema_pieces_are_recut_for_another_world_size():
    """A ZeRO-3 parameter of 10 elements saved by 2 ranks (partitions of 5) loads into 3 ranks'
    partitions of 4 (the last padded): each gets its slice of the flattened parameter."""
    full = torch.arange(10, dtype=torch.float32)
    pieces = [(0, full[:5].clone()), (5, full[5:].clone())]
    for rank, want in enumerate(([0, 1, 2, 3], [4, 5, 6, 7], [8, 9])):
        target = torch.full((4,), -1.0)
        _fill(target, 4 * rank, 10, pieces)
        assert target[:len(want)].tolist() == want
        assert (target[len(want):] == -1).all()  # padding beyond the parameter: untouched
    whole = torch.zeros(2, 5)  # stage 0-2: the whole parameter from the same pieces
    _fill(whole, 0, 10, pieces)
    assert torch.equal(whole.view(-1), full)


# ------------------------------------------------------------------------------- ptx
def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class _Tok:
    """A whitespace tokenizer: word -> its length + 3; BOS 1 in front, EOS 2."""

    eos_token_id, pad_token_id = 2, 0

    def __call__(self, texts, add_special_tokens=True):
        head = [1] if add_special_tokens else []
        return {"input_ids": [head + [len(w) + 3 for w in t.split()] for t in texts]}


def test_ptx_rows_text_and_prompt_completion(tmp_path):
    tok = _Tok()
    rows = load_ptx(_write_rows(tmp_path / "t.jsonl", [{"text": "a bb ccc"}, {"text": "dddd"}]),
                    "auto", "prompt", 3, tok)
    # text: the first token is context, the rest carries the loss (cut to max_len 3)
    assert rows.prompt_ids == [[1], [1]] and rows.target_ids == [[4, 5], [7]]
    rows = load_ptx(_write_rows(tmp_path / "p.jsonl", [
        {"prompt": "a bb ccc", "completion": "dddd ee"}]), "auto", "prompt", 5, tok)
    # prompt + completion: the completion and EOS carry the loss, the prompt keeps its end
    assert rows.prompt_ids == [[5, 6]] and rows.target_ids == [[7, 5, 2]]
    from ds_ppo.errors import DataError

    with pytest.raises(DataError, match="line 2.*'completion'"):
        load_ptx(_write_rows(tmp_path / "bad.jsonl", [
            {"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 3}]),
            "auto", "prompt", 5, tok)
    with pytest.raises(DataError, match="rows need a `text` column"):
        load_ptx(_write_rows(tmp_path / "other.jsonl", [{"x": "a"}]), "auto", "prompt", 5, tok)


def test_ptx_stream_same_rows_per_step_at_any_world_size():
    rows = PtxRows([[1]] * 13, [[4, 5]] * 13)
    one = PtxStream(rows, 4, 3, 0, 1, seed=7, pad_id=0)
    two = [PtxStream(rows, 4, 3, r, 2, seed=7, pad_id=0) for r in range(2)]
    for it in (1, 2, 5):
        for step in range(3):
            joint = sorted(two[0].minibatch(it, step) + two[1].minibatch(it, step))
            assert sorted(one.minibatch(it, step)) == joint and len(joint) == 4
    assert one.minibatch(1, 0) != one.minibatch(1, 1)


UPDATE = ["ppo.rollout_batch_size=4", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
          "ppo.ppo_epochs=1"]


def _engines(ema=None):
    fakes = types.SimpleNamespace(
        policy=FakeEngine(_small(LlamaForCausalLM)), reference=FakeEngine(_small(LlamaForCausalLM)),
        value=FakeEngine(_small(LlamaForTokenClassification, num_labels=1,
                                classifier_dropout=0.0)))
    engines = types.SimpleNamespace(
        policy=PolicyRole(fakes.policy, ema), reference=ReferenceRole(fakes.reference),
        value=ValueRole(fakes.value), reward=None, teacher=None, device=torch.device("cpu"),
        reward_fn=lambda prompts, responses: [float(len(r)) for r in responses])
    return fakes, engines


def _experience(cfg, engines):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 50, (int(n),), generator=g).tolist() for n in (2, 5, 3, 1)]
    responses = [torch.randint(3, 50, (int(n),), generator=g).tolist() for n in (4, 1, 6, 3)]
    with torch.no_grad():
        exp = score_rollout(padded_rollout(prompts, responses, P=6, T=7), engines, cfg)
        return advantages.add_advantages(exp, advantages.advantage_settings(cfg, 0.1))


def _grads(module):
    return {n: (p.grad.clone() if p.grad is not None else None)
            for n, p in module.named_parameters()}


def test_ptx_gradient_is_policy_gradient_plus_coef_times_lm_gradient():
    """One optimizer step with ppo.ptx_coef = c: the policy's accumulated gradient equals the
    PPO loss's gradient plus c x the gradient of the token-mean NLL over the step's ptx rows,
    computed here by hand from the model's logits (InstructGPT eq. 2)."""
    coef = 0.3
    g = torch.Generator().manual_seed(5)
    rows = PtxRows([[1]] * 6 + [[1, 7, 8]] * 2,
                   [torch.randint(3, 50, (int(n),), generator=g).tolist()
                    for n in (3, 6, 1, 2, 5, 4, 2, 7)])
    stream = PtxStream(rows, 4, 1, 0, 1, seed=1, pad_id=0)
    base_cfg = _cfg(*UPDATE)
    fakes, engines = _engines()
    exp = _experience(base_cfg, engines)
    acc = Accumulator()
    ptx_cfg = _cfg(*UPDATE, f"ppo.ptx_coef={coef}", "data.ptx_path=x.jsonl")
    update.ppo_update(exp, engines, update.update_settings(ptx_cfg), 1, acc, stream)
    with_ptx, m = _grads(fakes.policy.module), acc.reduce()
    # the optimizer step is placed after the ptx micro-batches: 2 PPO + 2 ptx, then one step
    assert fakes.policy.boundaries == [False, False, False, True]

    fakes2, engines2 = _engines()
    update.ppo_update(exp, engines2, update.update_settings(base_cfg), 1, Accumulator())
    ppo_only = _grads(fakes2.policy.module)
    model = _small(LlamaForCausalLM)  # the same initial weights, by hand
    picked = stream.minibatch(1, 0)
    nll, tokens = 0.0, 0
    for i in picked:
        ids = torch.tensor([rows.prompt_ids[i] + rows.target_ids[i]])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        P, T = len(rows.prompt_ids[i]), len(rows.target_ids[i])
        nll = nll - logp[P - 1:].gather(-1, ids[0, P:, None]).sum()
        tokens += T
    (nll / tokens).backward()
    assert m["loss/ptx"] == pytest.approx(float(nll.detach() / tokens), rel=1e-5)
    # FakeEngine does not divide each micro-batch's loss by DeepSpeed's accumulation steps
    # (2), which the update's scale undoes: every term of its gradients is 2x the loss's
    accum = 2
    for n, p in model.named_parameters():
        torch.testing.assert_close(with_ptx[n], ppo_only[n] + accum * coef * p.grad,
                                   atol=1e-6, rtol=1e-4)
    assert any(float(p.grad.abs().max()) > 1e-4 for p in model.parameters())


def test_critic_warmup_trains_the_value_model_only():
    cfg = _cfg(*UPDATE, "ppo.critic_warmup_iterations=1", "iterations=5")
    steps = []
    ema = types.SimpleNamespace(update=lambda: steps.append(1))
    for iteration, warm in ((1, True), (2, False)):
        fakes, engines = _engines(ema)
        acc = Accumulator()
        update.ppo_update(_experience(cfg, engines), engines, update.update_settings(cfg),
                          iteration, acc)
        m = acc.reduce()
        policy_grads = [g for g in _grads(fakes.policy.module).values() if g is not None]
        assert m["value/warmup"] == float(warm)
        assert ("loss/policy" in m) is not warm and "loss/value" in m
        assert (not policy_grads) is warm  # in the warm-up no backward reaches the policy
        assert any(g is not None and g.abs().max() > 0 for g in _grads(fakes.value.module).values())
        assert len(steps) == (0 if warm else 1)  # the EMA follows policy steps only
    assert "value/warmup" not in _metrics_without_warmup()


def _metrics_without_warmup():
    cfg = _cfg(*UPDATE)
    _, engines = _engines()
    acc = Accumulator()
    update.ppo_update(_experience(cfg, engines), engines, update.update_settings(cfg), 1, acc)
    return acc.reduce()


def test_lm_rollout_layout():
    r = lm_rollout([[1], [1, 7, 8]], [[4, 5, 6], [9]], 0, torch.device("cpu"))
    assert r.prompt_ids.tolist() == [[0, 0, 1], [1, 7, 8]]
    assert r.response_ids.tolist() == [[4, 5, 6], [9, 0, 0]]
    assert r.mask.tolist() == [[True] * 3, [True, False, False]]
    assert r.response_lens == [3, 1] and r.prompt_lens == [1, 3]
