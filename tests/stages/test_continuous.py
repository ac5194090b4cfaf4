"""Continuous batching in our decoding loop (engine/generation/loop.py, generation.continuous) and the
rollout log-probs it returns: row order and greedy equality with HF generate, slot
utilisation on forced lengths, the same samples from the same random stream, and log-probs
equal to the training forward's in float32."""
from __future__ import annotations

import inspect
import math

import torch
from ds_ppo.bench.forced_lengths import ForcedLengths, forced_prompts, lognormal_lengths
from test_decode import EOS, PAD, V, hf_greedy, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from ds_ppo.algo import response_mask
from ds_ppo.config.sections import GenerationConfig
from ds_ppo.containers import Rollout
from ds_ppo.engine.generation.loop import decode
from ds_ppo.engine.forward import response_logprobs


def _prompts(N: int, P: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (N, P), generator=g)
    mask = torch.ones(N, P, dtype=torch.bool)
    for b, n in enumerate(torch.randint(0, P - 1, (N,), generator=g).tolist()):
        mask[b, :n] = False
        ids[b, :n] = PAD
    return ids, mask


def _greedy(model, ids, mask, T, eos_ids, slots, check_every=2):
    return decode(model, ids, mask, max_new_tokens=T, eos_ids=eos_ids, pad_id=PAD,
                  temperature=0.0, suppress_ids=[PAD], stop_check_every=check_every,
                  slots=slots)


def test_continuous_greedy_equals_hf_generate_row_by_row():
    """Fewer slots than prompts: slots are refilled as rows end (rows of several lengths, some
    reaching max_new_tokens), every row equals HF generate's on the whole batch, in order. (The
    eager kernel's masks go through the same slot code: test_decode's static calls.)"""
    model = tiny_llama()
    ids, mask = _prompts(11, 6)
    T = 20
    first = hf_greedy(model, ids, mask, T, [EOS])
    eos_ids = [EOS, *sorted({int(t) for t in first[:, 3:12:4].flatten()})[:6]]
    ref = hf_greedy(model, ids, mask, T, eos_ids)
    lengths = response_mask(ref, eos_ids).sum(-1)
    assert len(set(lengths.tolist())) >= 3 and (lengths == T).any()
    for slots in (3, 1):
        out = _greedy(model, ids, mask, T, eos_ids, slots)
        assert torch.equal(out.response_ids, ref), slots
        assert out.stats.slots == slots and out.stats.refills == 11 - slots
        assert out.stats.rows == 11
        assert (out.logprobs[~response_mask(ref, eos_ids)] == 0).all()


def _utilisation(out, eos_ids) -> float:
    return float(response_mask(out.response_ids, eos_ids).sum()) / out.stats.slot_steps


def test_continuous_batching_keeps_the_slots_busy():
    """Forced lengths (one long response in each group of four, the rest short): one call per
    4 rows idles most slot-steps; 4 refilled slots (then the narrowed tail) count nearly every
    step; same responses."""
    T = 24
    lengths = [T if i % 4 == 0 else 3 for i in range(8)]
    ids, mask = forced_prompts(lengths, 5, V, PAD)
    model = ForcedLengths(tiny_llama(), EOS).eval()
    continuous = decode(model, ids, mask, max_new_tokens=T, eos_ids=[EOS], pad_id=PAD,
                        temperature=1.0, stop_check_every=1, slots=4)
    assert response_mask(continuous.response_ids, [EOS]).sum(-1).tolist() == lengths
    tokens, slot_steps = 0, 0
    for k in range(0, 8, 4):
        part = decode(model, ids[k:k + 4], mask[k:k + 4], max_new_tokens=T, eos_ids=[EOS],
                      pad_id=PAD, temperature=1.0, stop_check_every=1)
        tokens += int(response_mask(part.response_ids, [EOS]).sum())
        slot_steps += part.stats.slot_steps
        assert torch.equal(part.response_ids, continuous.response_ids[k:k + 4, :T])
    static = tokens / slot_steps
    assert static < 0.5 and _utilisation(continuous, [EOS]) >= 0.85, (static, continuous.stats)


def test_default_check_interval_keeps_continuous_slots_busy():
    """generation.stop_check_every's default (decode's too): a row that ends waits for the next
    check, so the interval sets how busy continuous batching keeps its slots. 32 log-normal
    lengths (median 12, max 64) in 8 slots: >= 75% of the slot-steps count a token at the
    default 8 (79.7%; the interval 16 gave 57.3%; docs/RESULTS.md has the 64-prompt table)."""
    check = GenerationConfig().stop_check_every
    assert inspect.signature(decode).parameters["stop_check_every"].default == check
    lengths = lognormal_lengths(32, 12, 64)
    ids, mask = forced_prompts(lengths, 4, 512, PAD)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = ForcedLengths(LlamaForCausalLM(cfg), EOS).eval()
    out = decode(model, ids, mask, max_new_tokens=64, eos_ids=[EOS], pad_id=PAD,
                 temperature=1.0, slots=8)
    assert response_mask(out.response_ids, [EOS]).sum(-1).tolist() == lengths
    assert _utilisation(out, [EOS]) >= 0.75, out.stats


def test_same_random_stream_same_samples():
    """Sampling with refills draws from the global stream in a fixed order: the same seed gives
    the same responses and log-probs (what a resumed run relies on), another seed others."""
    model = tiny_llama(seed=4)
    ids, mask = _prompts(9, 5)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(decode(model, ids, mask, max_new_tokens=12, eos_ids=[EOS, *range(3, 40)],
                           pad_id=PAD, temperature=1.0, suppress_ids=[PAD],
                           stop_check_every=2, slots=3))
    assert runs[0].stats.refills > 0
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert not torch.equal(runs[0].response_ids, runs[2].response_ids)


def _rollout(ids, mask, response, eos_ids) -> Rollout:
    m = response_mask(response, eos_ids)
    n = ids.shape[0]
    return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=response, mask=m,
                   ended=m.all(-1), prompts=[""] * n, responses=[""] * n,
                   prompt_lens=mask.sum(-1).tolist(), response_lens=m.sum(-1).tolist(),
                   extras=[{}] * n)


def test_rollout_logprobs_equal_the_training_forward_in_float32():
    """Sampled at temperature t (continuous, 4 slots for 9 prompts) or greedy: each token's
    rollout log-prob is the training forward's at the same temperature, up to float32
    rounding of the different kernels (cached single-token steps vs one full forward). With
    top-k the rollout's distribution is renormalised over fewer tokens: never less likely."""
    model = tiny_llama(seed=3)
    ids, mask = _prompts(9, 6)
    eos_ids = [EOS, *range(5, 11)]
    for temperature, top_k in ((0.7, 0), (0.0, 0), (0.8, 20)):
        torch.manual_seed(0)
        out = decode(model, ids, mask, max_new_tokens=15, eos_ids=eos_ids, pad_id=PAD,
                     temperature=temperature, top_k=top_k, stop_check_every=3, slots=4)
        rollout = _rollout(ids, mask, out.response_ids, eos_ids)
        with torch.no_grad():
            train, _ = response_logprobs(model, rollout, temperature)
        m = rollout.mask
        assert m.sum() > 50
        if top_k:
            assert (out.logprobs[m] >= train[m] - 1e-5).all()
            assert (out.logprobs[m] > train[m] + 1e-3).any()
        else:
            torch.testing.assert_close(out.logprobs[m], train[m], rtol=0, atol=1e-5)
        assert not math.isnan(float(out.logprobs.sum()))
