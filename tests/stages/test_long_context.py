"""Long responses: tiled log-probs (ppo.tiled_logits) through the real forward, scoring and update
code equal the untiled ones (fp32), and never create a (B, T, V) tensor; a LoRA reference keeps
its adapters off for the tiled head too."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_ppo.engine.forward import AUTO_TILE_ELEMENTS, response_logprobs, tile_logits
from conftest import FakeEngine
from support.big_tensors import LargestTensor
from ds_ppo.bench.stand_ins import small_llama
from test_packing import ATOL, PROMPTS, RESPONSES, _llama, _scored_and_updated
from support.rollouts import padded_rollout


# tiny models: one torch thread (tests/conftest.py, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_auto_tiles_above_the_measured_size():
    assert tile_logits("auto", AUTO_TILE_ELEMENTS // 32000 + 1, 32000)
    assert not tile_logits("auto", AUTO_TILE_ELEMENTS // 32000, 32000)
    assert tile_logits("auto", 4096, 128256)  # a 4k response of Llama 3's vocabulary
    assert tile_logits(True, 1, 50) and not tile_logits(False, 10**6, 10**6)


@pytest.mark.parametrize("packed", [False, True])
def test_tiled_forward_equals_untiled_with_gradients(packed):
    rollout = padded_rollout(PROMPTS, RESPONSES, P=8, T=10)
    policy = _llama()
    outs = {}
    for tiled in (False, True):
        lp, ent = response_logprobs(policy, rollout, 0.7, with_entropy=True, packed=packed,
                                    tiled=tiled, tile_tokens=3)
        (lp * rollout.mask).sum().backward()
        outs[tiled] = lp.detach(), ent, {n: p.grad.clone() for n, p in policy.named_parameters()}
        policy.zero_grad()
    (lp0, ent0, g0), (lp1, ent1, g1) = outs[False], outs[True]
    torch.testing.assert_close(lp1, lp0, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=ATOL, rtol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4)
    assert g1["lm_head.weight"].abs().sum() > 0


def test_tiled_update_creates_no_logits_sized_tensor():
    """One row of 80 response tokens, V = 500: the untiled forward and backward create a tensor
    of T*V elements (the check can fail), the tiled ones nothing larger than the head's weight
    gradient (V x H; one tile's logits, 8 x V, and the activations are smaller)."""
    T, V, H = 80, 500, 32
    rollout = padded_rollout([[5, 6, 7]], [list(range(3, 3 + T))], P=3, T=T)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2))
    for tiled in (False, True):
        with LargestTensor() as seen:
            lp, _ = response_logprobs(policy, rollout, 1.0, with_entropy=True, tiled=tiled,
                                      tile_tokens=8)
            lp.sum().backward()
        if tiled:
            assert seen.numel <= V * H < T * V
        else:
            assert seen.numel >= T * V


@pytest.fixture(scope="module")
def untiled():
    return _scored_and_updated(["ppo.tiled_logits=false"])


@pytest.mark.parametrize("extra", [["ppo.logits_tile_tokens=3"],
                                   ["ppo.logits_tile_tokens=5", "ppo.micro_batch_tokens=12"]])
def test_tiled_scoring_and_update_equal_untiled(untiled, extra):
    """The scored experience, the update's losses and its gradient (two epochs, policy and value)
    with tiled logits equal the untiled ones; also packed."""
    exp, metrics, grads, _ = untiled
    texp, tmetrics, tgrads, _ = _scored_and_updated(["ppo.tiled_logits=true", *extra])
    for name in ("old_logprobs", "ref_logprobs", "entropy", "advantages"):
        torch.testing.assert_close(getattr(texp, name), getattr(exp, name), atol=ATOL, rtol=0)
    for k in ("loss/policy", "loss/kl", "policy/approx_kl", "policy/ratio_mean"):
        assert tmetrics[k] == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), k
    for name, g in grads.items():
        torch.testing.assert_close(tgrads[name], g, atol=1e-5, rtol=1e-4)


def test_lora_reference_keeps_adapters_off_for_the_tiled_head():
    """lora.AdaptersOff: the tiled head runs inside the adapters-off context (the output head
    has an adapter, as a random-init policy.arch gets): equal to the untiled reference, unlike
    the policy with its adapters on."""
    from peft import LoraConfig, get_peft_model

    from ds_ppo.engine.lora import AdaptersOff

    base = small_llama()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # adapters that change the output
    reference = AdaptersOff(FakeEngine(model))
    rollout = padded_rollout(PROMPTS, RESPONSES, P=8, T=10)
    with torch.no_grad():
        want, _ = response_logprobs(reference, rollout, 1.0)
        got, _ = response_logprobs(reference, rollout, 1.0, tiled=True, tile_tokens=4)
        on, _ = response_logprobs(FakeEngine(model), rollout, 1.0, tiled=True, tile_tokens=4)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert (on - want)[rollout.mask].abs().max() > 1e-2


def test_tiled_mlp_equals_plain_mlp_in_the_update_only():
    """policy.tiled_mlp: a row of 83 tokens (hidden 32: 3 slices) gives the same log-probs and
    gradients through DeepSpeed's TiledMLP; scoring (no grad) keeps the plain MLP."""
    from ds_ppo.engine.tiled_mlp import tile_mlps

    rollout = padded_rollout([[5, 6, 7]], [[3 + i % 40 for i in range(80)]], P=3, T=80)
    outs = []
    for tiled in (False, True):
        policy = _llama().train()
        calls = []
        if tiled:
            assert tile_mlps(policy) == 2
            policy.model.layers[0].mlp.gate_proj.register_forward_hook(
                lambda m, args, out: calls.append(args[0].shape[-2]))
        lp, _ = response_logprobs(policy, rollout, 1.0)
        (lp * rollout.mask).sum().backward()
        outs.append((lp.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
        if tiled:
            assert calls == [28, 28, 27] * 2  # forward slices, then recomputed in backward
            calls.clear()
            with torch.no_grad():
                response_logprobs(policy, rollout, 1.0)
            assert calls == [83]  # scoring: the plain MLP
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=ATOL, rtol=0)
    for name, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], g, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="no gated MLP"):
        tile_mlps(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("packed", [False, True])
def test_a_tiled_teacher_equals_the_untiled_one_with_its_top1_matches(packed):
    """A distillation teacher's log-probs of the samples and its top-1 matches, through the
    real forward: tiled (head on slices of positions) as untiled, padded and packed; and the
    log-probs are the reference's (the same softmax, without top-k / top-p)."""
    from ds_ppo.engine.forward import teacher_logprobs

    rollout = padded_rollout(PROMPTS, RESPONSES, P=8, T=10)
    with torch.no_grad():
        teacher = _llama()
        lp0, top0 = teacher_logprobs(teacher, rollout, 0.7, packed=packed, tiled=False)
        lp1, top1 = teacher_logprobs(teacher, rollout, 0.7, packed=packed, tiled=True,
                                     tile_tokens=3)
        ref, _ = response_logprobs(teacher, rollout, 0.7, packed=packed, truncate=False)
    torch.testing.assert_close(lp1, lp0, atol=ATOL, rtol=0)
    torch.testing.assert_close(lp0, ref, atol=ATOL, rtol=0)
    assert torch.equal(top1, top0)
    # top-1: the sample is the argmax of the teacher's logits at the position before it
    from ds_ppo.engine.forward import position_ids

    ids, am, keep = rollout.model_inputs()
    L = ids.shape[1]
    with torch.no_grad():
        logits = teacher(input_ids=ids, attention_mask=am, position_ids=position_ids(am)).logits
    expected = (logits[:, L - keep - 1:L - 1].argmax(-1) == ids[:, L - keep:])
    mask = rollout.mask[:, :keep]
    assert torch.equal(top0[:, :keep].bool() & mask, expected & mask)
    assert (top0[~rollout.mask] == 0).all()
    # each row's first response token made the teacher's argmax after its prompt: matched
    rollout.response_ids[:, 0] = logits[:, L - keep - 1].argmax(-1)
    with torch.no_grad():
        _, top = teacher_logprobs(teacher, rollout, 0.7, packed=packed, tiled=True,
                                  tile_tokens=3)
    assert (top[:, 0] == 1).all()
