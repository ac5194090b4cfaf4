"""One sampled distribution: the trainer's log-probs are those of the distribution the sampler
drew from (`Rollout.sampling`, `ds_ppo.algo.distribution.shape_logits`), for every sampling
setting, packed or tiled forwards, and multi-turn episodes: on CPU in float32 the sampler's
log-probs equal the trainer's to rounding (the decoding step and the whole-sequence forward
reduce in different orders), while the plain softmax misses them by the blocked pad's mass and
more."""
from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch
from test_continuous import _prompts
from test_decode import EOS, PAD, tiny_llama

from ds_ppo.config import load_config
from ds_ppo.containers import Rollout
from ds_ppo.engine.forward import response_logprobs
from ds_ppo.engine.batch_invariant import batch_invariant
from ds_ppo.engine.generation import generate

# env.function=onpolicy_envs:... finds this module
sys.modules.setdefault("onpolicy_envs", sys.modules[__name__])

ROUNDING = 1e-5  # float32, the decoding step against the whole-sequence forward


def _gap(rollout: Rollout, trained: torch.Tensor) -> float:
    """The largest |sampler - trainer| log-prob over the counted tokens."""
    m = rollout.mask
    return float((rollout.rollout_logprobs[m] - trained[m].detach()).abs().max())


def _sampled(engine, cfg, eos_ids, dtype: torch.dtype = torch.float32) -> Rollout:
    """9 prompts' responses from `generate` (seed 0, a replica in `dtype`) as a Rollout
    carrying the sampler's log-probs and shape."""
    ids, mask = _prompts(9, 6)
    torch.manual_seed(0)
    gen = generate(engine, ids, mask, cfg, "gathered", eos_ids, PAD, dtype)
    m = gen.mask
    return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=gen.response_ids, mask=m,
                   ended=gen.ended, prompts=[""] * 9,
                   responses=["x" * n for n in m.sum(-1).tolist()],
                   prompt_lens=mask.sum(-1).tolist(), response_lens=m.sum(-1).tolist(),
                   extras=[{}] * 9, rollout_logprobs=gen.logprobs, sampling=gen.sampling)


SETTINGS = {
    "default": [],
    "temperature": ["generation.temperature=0.7"],
    "greedy": ["generation.temperature=0"],
    "top_k": ["generation.top_k=5"],
    "top_p": ["generation.top_p=0.8"],
    "min_new_tokens": ["generation.min_new_tokens=4"],
    "stop_tokens": ["stop"],  # EOS and five more tokens end a response
    "all_at_once": ["generation.temperature=0.8", "generation.top_k=20", "generation.top_p=0.9",
                    "generation.min_new_tokens=3", "stop", "generation.batch_size=3"],
}


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("setting", SETTINGS)
def test_sampler_logprobs_equal_the_trainers_for_every_sampling_setting(setting, exact):
    """`generate` (what the trainer calls; own loop, 9 prompts) samples; the training forward,
    plain, packed and tiled, gives the same log-probs for the same tokens to float32 rounding,
    and its entropy is finite (blocked tokens add nothing). Without the rollout's shape (the
    plain softmax) the gap is the pad's mass at least. With batch-invariant kernels
    (generation.batch_invariant) the gap is exactly 0."""
    overrides = [o for o in SETTINGS[setting] if o != "stop"]
    eos_ids = [EOS, *range(5, 10)] if "stop" in SETTINGS[setting] else [EOS]
    cfg = load_config(None, ["generation.max_new_tokens=12", "generation.stop_check_every=3",
                             *overrides]).generation
    model = tiny_llama(seed=3)
    engine = types.SimpleNamespace(module=model, empty_partition_cache=lambda: None)
    with batch_invariant(exact):
        _check_setting(model, engine, cfg, eos_ids, exact)


def _check_setting(model, engine, cfg, eos_ids, exact):
    rollout = _sampled(engine, cfg, eos_ids)
    m = rollout.mask
    if cfg.min_new_tokens:
        assert min(rollout.response_lens) >= cfg.min_new_tokens  # EOS was blocked
    temp = cfg.temperature
    with torch.no_grad():
        for kw in ({}, {"packed": True}, {"tiled": True, "tile_tokens": 7}):
            trained, entropy = response_logprobs(model, rollout, temp, with_entropy=True, **kw)
            assert _gap(rollout, trained) <= (0.0 if exact else ROUNDING), kw
            assert torch.isfinite(entropy[m]).all() and (entropy[m] >= 0).all()
        plain = response_logprobs(model, replace(rollout, sampling=None), temp)[0]
    assert _gap(rollout, plain) > 1e-4


def _trained_lora(model):
    """`model` with LoRA adapters (r 4, the output head too) as training leaves them: B != 0,
    so the adapters change every adapted layer's output."""
    from ds_ppo.engine.lora import add_adapters

    lora = load_config(None, ["policy.lora.r=4"]).policy.lora
    model = add_adapters(model, lora, seed=0, output_head=True).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.mark.parametrize("case", ["bf16", "lora", "bf16_lora"])
def test_batch_invariant_is_exact_in_bf16_and_with_lora(case, tmp_path):
    """generation.batch_invariant: the gap is exactly 0, plain, packed and tiled, for a bf16
    policy loaded as the trainer loads it (HF keeps its rotary frequencies in float32; the
    replica must too, not round them to bf16), for a LoRA policy with trained adapters (the
    replica holds the merged weights; the trainer's LoRA layers compute with the same merge),
    and for both; in the update's forward too (training mode, gradients on)."""
    from transformers import LlamaForCausalLM

    model, dtype = tiny_llama(seed=3), torch.float32
    if case.startswith("bf16"):
        model.save_pretrained(tmp_path)
        dtype = torch.bfloat16
        model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    if case.endswith("lora"):
        model = _trained_lora(model)
    engine = types.SimpleNamespace(module=model, empty_partition_cache=lambda: None)
    cfg = load_config(None, ["generation.max_new_tokens=12"]).generation
    with batch_invariant():
        rollout = _sampled(engine, cfg, [EOS], dtype)
        with torch.no_grad():
            for kw in ({}, {"packed": True}, {"tiled": True, "tile_tokens": 7}):
                trained = response_logprobs(model, rollout, cfg.temperature, **kw)[0]
                assert _gap(rollout, trained) == 0.0, kw
        # the update's forward (training mode, gradients on) too: at the sampled weights the
        # PPO ratio is exactly 1, also with ppo.old_logprobs=rollout (no scoring forward)
        model.train()
        for kw in ({}, {"packed": True}):
            trained = response_logprobs(model, rollout, cfg.temperature, **kw)[0]
            assert trained.requires_grad and _gap(rollout, trained) == 0.0, kw


def test_batch_invariant_lora_on_conv1d_layers_computes_as_the_replica():
    """GPT-2's projections are Conv1D layers (one addmm each; peft's fan_in_fan_out): with
    LoRA adapters and generation.batch_invariant, the trainer's forward, with gradients on or
    off, gives the logits of the replica (the plain model holding the merged weights) bit for
    bit, and its adapter gradients are peft's own to float32 rounding."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_ppo.engine.generation import build_replica
    from ds_ppo.engine.lora import add_adapters

    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=64, attn_implementation="sdpa", resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))
    lora = load_config(None, ["policy.lora.r=4"]).policy.lora
    model = add_adapters(model, lora, seed=0).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ids = torch.randint(3, 300, (4, 15), generator=g)
    replica = build_replica(model, torch.float32, torch.device("cpu"))
    peft = copy.deepcopy(model).train()
    (peft(input_ids=ids).logits.logsumexp(-1).sum()).backward()
    with batch_invariant():
        with torch.no_grad():
            want = replica(input_ids=ids).logits
            assert torch.equal(model(input_ids=ids).logits, want)
        model.train()
        logits = model(input_ids=ids).logits
        assert torch.equal(logits, want)
        logits.logsumexp(-1).sum().backward()
    for p, q in zip(model.parameters(), peft.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-4 * q.grad.norm())


def test_batch_invariant_lora_gradients_are_as_accurate_as_peft():
    """generation.batch_invariant with LoRA: the update's adapter gradients, through the merged
    weight (`lora.merged_linear`), are as close to float64's (peft's own forward in float64) as
    peft's own float32 forward is, measured against each gradient's norm. (Elementwise, both
    miss float64 by up to a few percent, on elements near 0 that cancel.)"""
    import copy

    from ds_ppo.engine import lora

    model = _trained_lora(tiny_llama(seed=3)).train()
    g = torch.Generator().manual_seed(7)
    ids, up = torch.randint(3, 300, (6, 20), generator=g), torch.randn(6, 19, generator=g)
    merged = [0]

    def counted(layer, x):
        out = real(layer, x)
        merged[0] += out is not None
        return out
    real, lora.merged_linear = lora.merged_linear, counted

    def grads(dtype, invariant):
        m = copy.deepcopy(model).to(dtype)
        with batch_invariant(invariant):
            logits = m(input_ids=ids).logits[:, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            (lp * up.to(dtype)).sum().backward()
        return [p.grad.double() for p in m.parameters() if p.requires_grad]
    try:
        exact = grads(torch.float64, False)
        peft = grads(torch.float32, False)
        assert merged[0] == 0
        ours = grads(torch.float32, True)
    finally:
        lora.merged_linear = real
    assert merged[0] == 15  # every adapted layer (14 of the blocks, the output head)

    def error(got):  # per adapter tensor, relative to its gradient's norm
        return [float((a - e).norm() / e.norm()) for a, e in zip(got, exact)]
    assert len(exact) == 30 and max(error(peft)) < 1e-4
    assert max(error(ours)) < max(3 * max(error(peft)), 1e-5)
    assert sum(error(ours)) < 3 * sum(error(peft))


def answer_ok(prompt, actions, **keys):
    """An environment that answers every turn with an observation, three turns long."""
    return {"observation": " ok", "reward": 0.1, "done": len(actions) == 3}


@pytest.mark.parametrize("chat,exact", [(False, False), (True, False), (True, True)])
def test_episode_logprobs_equal_the_trainers(chat, exact, tmp_path):
    """Multi-turn episodes (real sampling, min_new_tokens counted per turn, top-p): the
    episode carries each turn's sampler log-probs (0 on observations) and turn starts, and
    the training forward over the whole episode gives the same log-probs to float32 rounding.
    Counting min_new_tokens from the response's start instead (no turn starts) would not."""
    from ds_ppo.data.prompts import PromptSet
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.envs.runner import EnvRunner
    from ds_ppo.ppo.episodes import episode_settings, make_episodes
    from ds_ppo.bench.stand_ins import small_llama

    tok = load_tokenizer("builtin:tiny", tmp_path)
    cfg = load_config(None, ["reward.function=null", "generation.max_new_tokens=6",
                             "generation.min_new_tokens=3", "generation.top_p=0.99",
                             "generation.temperature=0.9", "env.max_turns=3",
                             "env.function=onpolicy_envs:answer_ok"])
    texts = ["what is 3 + 4 ?", "what is 2 + 2 ?", "say hi"]
    if chat:
        messages = [[{"role": "user", "content": t}] for t in texts]
        prompt_ids = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False).input_ids for c in messages]
    else:
        prompt_ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
        messages = None
    prompts = PromptSet(input_ids=prompt_ids, texts=texts, extras=[{}] * 3, messages=messages)
    model = small_llama(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    engines = types.SimpleNamespace(
        policy=types.SimpleNamespace(module=model, empty_partition_cache=lambda: None),
        device=torch.device("cpu"), dtype=torch.float32, replica=None)
    torch.manual_seed(0)
    with batch_invariant(exact):
        rollout, generated, stats = make_episodes(prompts, [0, 1, 2], engines,
                                                  episode_settings(cfg), tok, "gathered", [tok.eos_token_id],
                                                  EnvRunner(cfg.env, []))
        with torch.no_grad():
            for packed in (False, True):
                trained, _ = response_logprobs(model, rollout, 0.9, packed=packed)
                assert _gap(rollout, trained) <= (0.0 if exact else ROUNDING)
    assert stats.turns > 3 and stats.observations > 0  # several turns with observations
    assert rollout.turn_starts.sum() == stats.turns
    assert (rollout.rollout_logprobs[~rollout.mask] == 0).all()
    assert torch.equal(generated.logprobs, rollout.rollout_logprobs)
    with torch.no_grad():
        rollout.turn_starts = None  # min_new_tokens counted from the episode's start
        assert _gap(rollout, response_logprobs(model, rollout, 0.9)[0]) > 1e-4


def test_batch_invariant_old_logprobs_from_the_rollout_give_the_same_update_bit_for_bit():
    """generation.batch_invariant: the sampler's log-probs are the scoring forward's to the
    last bit (rollout/logprob_abs_diff_max and rollout/kl_k3 are 0, so require_exact passes),
    and PPO with ppo.old_logprobs=rollout (no scoring forward of the policy) takes the same
    update as with training, weight for weight, bit for bit, with top-k, top-p and
    min_new_tokens sampling."""
    import copy

    from test_stages import _CountingEngine, _SteppingEngine
    from transformers import LlamaConfig, LlamaForTokenClassification

    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, ValueRole
    from ds_ppo.metrics import Accumulator
    from ds_ppo.ppo.advantages import add_advantages, advantage_settings
    from ds_ppo.ppo.correction import correction_settings, rollout_correction
    from ds_ppo.ppo.update import ppo_update, update_settings
    from support.stage_calls import score_rollout

    overrides = ["generation.max_new_tokens=10", "generation.temperature=0.8",
                 "generation.top_k=30", "generation.top_p=0.9", "generation.min_new_tokens=2",
                 "generation.batch_invariant=true", "ppo.micro_batch_size=3",
                 "ppo.mini_batch_size=9", "ppo.rollout_batch_size=9", "ppo.ppo_epochs=2"]
    model = tiny_llama(seed=3)
    runs = {}
    with batch_invariant():
        rollout = _sampled(types.SimpleNamespace(module=model, empty_partition_cache=lambda: None),
                           load_config(None, overrides).generation, [EOS])
        for mode in ("training", "rollout"):
            torch.manual_seed(2)
            value = LlamaForTokenClassification(LlamaConfig(
                vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, num_labels=1))
            policy = _SteppingEngine(copy.deepcopy(model), accum=3)
            engines = types.SimpleNamespace(
                policy=PolicyRole(policy), reference=ReferenceRole(_CountingEngine(model)),
                value=ValueRole(_SteppingEngine(value, accum=3)), reward=None, teacher=None,
                reward_fn=lambda prompts, responses, **kw: [float(len(r)) for r in responses])
            cfg = load_config(None, [*overrides, f"ppo.old_logprobs={mode}",
                                     f"generation.require_exact={mode == 'training'}"])
            acc = Accumulator()
            exp = rollout_correction(score_rollout(rollout, engines, cfg), correction_settings(cfg),
                                     acc)
            ppo_update(add_advantages(exp, advantage_settings(cfg, 0.1)), engines,
                       update_settings(cfg), 1, acc)
            runs[mode] = (exp, acc.reduce(), [p.detach().clone() for p in policy.parameters()])
    (exp_t, m_t, w_t), (exp_r, _, w_r) = runs["training"], runs["rollout"]
    assert m_t["rollout/logprob_abs_diff_max"] == 0.0 and m_t["rollout/kl_k3"] == 0.0
    assert torch.equal(exp_t.old_logprobs, exp_r.old_logprobs)
    assert any(not torch.equal(a, p) for a, p in zip(w_t, model.parameters()))  # it trained
    for a, b in zip(w_t, w_r):
        assert torch.equal(a, b)
