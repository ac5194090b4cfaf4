"""Our decoding loop (ds_ppo.engine.generation.loop, generation.loop=own) against HF generate on tiny
random Llama models, and its capture-safety (no host sync inside a decoding step)."""
from __future__ import annotations

import functools
import signal

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

from ds_ppo.algo import response_mask
from ds_ppo.engine.generation.loop import decode
from ds_ppo.engine.generation.choice import own_loop_unsupported as unsupported

V, PAD, EOS = 300, 0, 1


def tiny_llama(attn: str = "sdpa", device: str = "cpu", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation=attn)
    with torch.device(device):
        return LlamaForCausalLM(cfg).eval()


def left_padded(B: int = 5, P: int = 7, pads=(0, 2, 3, 0, 6), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    for b, n in enumerate(pads):
        mask[b, :n] = False
        ids[b, :n] = PAD
    return ids, mask


def hf_greedy(model, ids, mask, T, eos_ids, min_new=0):
    out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=T,
                         min_new_tokens=min_new, do_sample=False, eos_token_id=eos_ids,
                         pad_token_id=PAD, suppress_tokens=[PAD])
    return out[:, ids.shape[1]:]


def _pair(out):
    """A decode call's (response ids, stats)."""
    return out.response_ids, out.stats


def ours_greedy(model, ids, mask, T, eos_ids, min_new=0, check_every=16):
    return _pair(decode(model, ids, mask, max_new_tokens=T, eos_ids=eos_ids, pad_id=PAD,
                  min_new_tokens=min_new, temperature=0.0, suppress_ids=[PAD],
                  stop_check_every=check_every))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("min_new", [0, 10])
def test_greedy_equals_hf_generate(attn, min_new):
    model = tiny_llama(attn)
    ids, mask = left_padded()
    T = 20
    # a stop token that row 0 produces at its 5th step (so that row ends early; min_new=10
    # must then push its EOS later)
    stop = int(hf_greedy(model, ids, mask, T, [EOS])[0, 4])
    ref = hf_greedy(model, ids, mask, T, [EOS, stop], min_new)
    out, stats = ours_greedy(model, ids, mask, T, [EOS, stop], min_new)
    assert out.shape == ref.shape and torch.equal(out, ref), (out, ref)
    assert stats.steps == T and not stats.graph  # CPU: no CUDA graph
    ended = response_mask(out, [EOS, stop]).sum(-1)
    if min_new == 0:
        assert ended[0] == 5  # row 0 really ended early, the others did not all
    else:
        assert (ended >= min_new + 1).all() or (ended == T).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_eager_steps_attend_only_to_the_columns_written(attn):
    """Without a CUDA graph, decoding step k attends to the P + k + 1 cache columns written so
    far (the first prefill to its P), not to all P + T: the same greedy tokens as HF generate
    at a cost per step that grows as HF's dynamic cache does."""
    model = tiny_llama(attn)
    ids, mask = left_padded()
    P, T = ids.shape[1], 12
    widths = []
    inner = model.forward

    @functools.wraps(inner)
    def watched(*args, **kwargs):
        widths.append((kwargs["input_ids"].shape[1], kwargs["attention_mask"].shape[-1]))
        return inner(*args, **kwargs)

    model.forward = watched
    out, stats = ours_greedy(model, ids, mask, T, [EOS], check_every=1000)
    model.forward = inner
    assert widths == [(P, P)] + [(1, P + k + 1) for k in range(T - 1)]
    assert torch.equal(out, hf_greedy(model, ids, mask, T, [EOS]))


def test_all_rows_ending_stops_the_loop_and_trims_like_hf():
    model = tiny_llama()
    ids, mask = left_padded(B=3, pads=(0, 1, 2))
    first = hf_greedy(model, ids, mask, 30, [EOS])
    # every row's 3rd..6th token as a stop token: all rows end within a few steps
    stops = sorted({int(t) for t in first[:, 2:6].flatten()})
    ref = hf_greedy(model, ids, mask, 30, [EOS, *stops])
    assert ref.shape[1] < 30
    out, stats = ours_greedy(model, ids, mask, 30, [EOS, *stops], check_every=4)
    assert torch.equal(out, ref)
    assert stats.steps < 30  # the loop stopped early (at a multiple of check_every)
    assert stats.steps % 4 == 0 and stats.steps >= ref.shape[1]


def test_sampling_respects_filters_pad_and_min_new_tokens():
    model = tiny_llama()
    ids, mask = left_padded(B=16, pads=[0, 3] * 8)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)  # as generate's
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits[:, -1]
    eos_ids = [int(i) for i in logits.argmax(-1)[:2]]  # likely tokens, so EOS is tempting
    torch.manual_seed(3)
    out, _ = _pair(decode(model, ids, mask, max_new_tokens=12, eos_ids=eos_ids, pad_id=PAD,
                    min_new_tokens=4, temperature=0.8, top_k=5, suppress_ids=[PAD]))
    m = response_mask(out, eos_ids)
    assert (m.sum(-1) >= 5).all() or (m.sum(-1) == out.shape[1]).all()
    assert not torch.isin(out[:, :4], torch.tensor(eos_ids)).any()  # blocked before 4 tokens
    assert (out[m] != PAD).all()  # pad suppressed inside responses
    assert (out[~m] == PAD).all()  # and written after each row's EOS
    # the first token is one of the prefill's top-5 once pad and EOS (min_new_tokens) are out
    allowed = logits.index_fill(-1, torch.tensor([PAD, *eos_ids]), float("-inf"))
    assert (out[:, :1] == allowed.topk(5, -1).indices).any(-1).all()
    assert len(torch.unique(out[:, 0])) > 1  # sampled, not greedy


def test_first_token_distribution_matches_the_model():
    # one prompt repeated: the first sampled token must follow softmax(logits / temperature)
    model = tiny_llama(seed=2)
    ids, mask = left_padded(B=1, P=5, pads=(0,))
    n = 4000
    logits = model(input_ids=ids).logits[0, -1].double()
    probs = torch.softmax(logits / 0.5, -1)
    torch.manual_seed(0)
    out, _ = _pair(decode(model, ids.expand(n, -1), mask.expand(n, -1), max_new_tokens=1, eos_ids=[EOS],
                    pad_id=PAD, temperature=0.5, suppress_ids=[]))
    freq = torch.bincount(out[:, 0], minlength=V).double() / n
    top = probs.topk(3).indices
    # binomial standard error <= 0.008 at n = 4000; 5 sigma
    assert (freq[top] - probs[top]).abs().max() < 0.04, (freq[top], probs[top])


class _HostTraffic(TorchDispatchMode):
    """Records ops that take a CPU tensor with data (would be a host-to-device copy inside a
    CUDA graph capture; 0-dim scalars are passed by value and are fine)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
               for t in leaves):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_decoding_step_is_capture_safe_on_meta_tensors():
    """On the meta device any host sync (.item(), bool(tensor), data-dependent shapes) raises, so
    a full decode there shows the loop's steps contain none; a dispatch mode around each decoding
    forward shows they touch no CPU tensor. This is what CUDA graph capture needs."""
    model = tiny_llama(device="meta")
    ids, mask = (t.to("meta") for t in left_padded())
    forwards = []
    inner = model.forward

    @functools.wraps(inner)
    def watched(*args, **kwargs):
        if kwargs["input_ids"].shape[1] != 1:  # the prefill runs outside the graph
            return inner(*args, **kwargs)
        with _HostTraffic() as traffic:
            result = inner(*args, **kwargs)
        forwards.append(traffic.seen)
        return result

    model.forward = watched
    for temperature in (0.0, 0.7):
        out, stats = _pair(decode(model, ids, mask, max_new_tokens=6, eos_ids=[EOS, 7], pad_id=PAD,
                            min_new_tokens=2, temperature=temperature, top_k=5, top_p=0.9,
                            suppress_ids=[PAD], stop_check_every=1000, trim=False))
        assert out.device.type == "meta" and stats.steps == 6
    assert len(forwards) == 10 and not any(forwards), forwards
    # the detectors work: a sync raises on meta, a CPU tensor is recorded
    with pytest.raises(Exception):
        bool(torch.zeros(2, device="meta").sum())
    with _HostTraffic() as traffic:
        torch.ones(3).to("meta")
    assert traffic.seen


def _sigterm_at_third_forward(model) -> list:
    """`model`'s forwards, counted in the returned list; the third makes SIGTERM's request."""
    from ds_ppo import abandon

    forwards, forward = [], model.forward

    def counted(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 3:
            abandon.request(signal.SIGTERM)
        return forward(*args, **kwargs)

    model.forward = counted
    return forwards


def test_sigterm_gives_a_decode_up_between_two_steps():
    """The request is read before each step (a host flag, no device sync): the third forward's
    request stops the loop before a fourth."""
    from ds_ppo import abandon

    model = tiny_llama()
    ids, mask = left_padded()
    forwards = _sigterm_at_third_forward(model)
    try:
        with pytest.raises(abandon.Abandoned) as e:
            decode(model, ids, mask, max_new_tokens=40, eos_ids=[], pad_id=PAD,
                   temperature=0.0, cuda_graph=False)
    finally:
        abandon.clear()
    assert e.value.phase == "generation" and len(forwards) == 3


def test_sigterm_ends_hf_generate_at_the_next_step():
    """generation.loop = hf (and mode zero3): a stopping criterion ends every row once the
    request is made, then the decode is given up."""
    from ds_ppo import abandon
    from ds_ppo.config import load_config
    from ds_ppo.engine.generation import _hf_generate

    model = tiny_llama()
    ids, mask = left_padded()
    cfg = load_config(None, ["generation.temperature=0", "generation.max_new_tokens=40",
                             "generation.loop=hf"]).generation
    forwards = _sigterm_at_third_forward(model)
    run = _hf_generate(model, cfg, [], PAD, False, None)
    try:
        with pytest.raises(abandon.Abandoned) as e:
            run(ids, mask)
    finally:
        abandon.clear()
    assert e.value.phase == "generation" and len(forwards) == 3
    assert run(ids, mask)[0].shape[1] == 40  # no request: every token


def test_unsupported_models_are_named():
    assert unsupported(tiny_llama().config) is None
    assert "flash_attention_2" in unsupported(
        LlamaConfig(attn_implementation="flash_attention_2"))
    assert "sliding" in unsupported(MistralConfig(sliding_window=64))
    assert unsupported(MistralConfig(sliding_window=None)) is None


class _ReplayedStep:
    """Stands in for a CUDA graph on CPU: replay() runs the captured step function again, which
    is what a graph does when the step only reads and writes persistent buffers."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def test_graph_schedule_warmup_capture_replay(monkeypatch):
    import ds_ppo.engine.generation.loop as dec

    model = tiny_llama()
    ids, mask = left_padded()
    T = 12
    ref, _ = ours_greedy(model, ids, mask, T, [EOS])  # eager
    calls = {"side": 0, "captured": []}
    monkeypatch.setattr(dec, "_graphs_available", lambda device: True)
    monkeypatch.setattr(dec, "_on_side_stream",
                        lambda fn, device: (calls.__setitem__("side", calls["side"] + 1), fn()))

    def capture(fn, device):
        graph = _ReplayedStep(fn)
        calls["captured"].append(graph)
        return graph, None

    monkeypatch.setattr(dec, "_capture", capture)
    out, stats = _pair(decode(model, ids, mask, max_new_tokens=T, eos_ids=[EOS], pad_id=PAD,
                        temperature=0.0, suppress_ids=[PAD], cuda_graph=True))
    assert torch.equal(out, ref)
    # 1 token from the prefill, 2 eager warm-up steps, then every step a replay
    assert calls["side"] == dec.WARMUP_STEPS and len(calls["captured"]) == 1
    assert calls["captured"][0].replays == T - 1 - dec.WARMUP_STEPS
    assert stats.graph and stats.graph_error is None
    # generation.cuda_graph=false: no capture
    decode(model, ids, mask, max_new_tokens=T, eos_ids=[EOS], pad_id=PAD, temperature=0.0,
           cuda_graph=False)
    assert len(calls["captured"]) == 1


def test_failed_capture_decodes_eagerly_and_is_not_retried(monkeypatch, caplog):
    import ds_ppo.engine.generation.loop as dec

    attempts = []

    def failing(fn, device):
        attempts.append(1)
        dec._CAPTURE_FAILED = "RuntimeError: operation not permitted when stream is capturing"
        return None, dec._CAPTURE_FAILED

    monkeypatch.setattr(dec, "_CAPTURE_FAILED", None)
    monkeypatch.setattr(dec, "_graphs_available", lambda device: True)
    monkeypatch.setattr(dec, "_on_side_stream", lambda fn, device: fn())
    monkeypatch.setattr(dec, "_capture", failing)
    model = tiny_llama()
    ids, mask = left_padded()
    ref, _ = ours_greedy(model, ids, mask, 10, [EOS])
    for _ in range(2):
        out, stats = _pair(decode(model, ids, mask, max_new_tokens=10, eos_ids=[EOS], pad_id=PAD,
                            temperature=0.0, suppress_ids=[PAD]))
        assert torch.equal(out, ref) and not stats.graph
        assert "not permitted" in stats.graph_error
    assert len(attempts) == 1


def test_grouped_decode_attention_equals_hf_sdpa():
    """One query token with grouped-query heads: folding the G query heads of a KV head into
    SDPA's query axis gives HF's sdpa result without repeating K/V."""
    import types

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ds_ppo.engine.generation.loop import grouped_sdpa_attention

    torch.manual_seed(0)
    B, H, KVH, L, D = 3, 8, 2, 10, 16
    module = types.SimpleNamespace(num_key_value_groups=H // KVH, is_causal=True)
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KVH, L, D), torch.randn(B, KVH, L, D)
    mask = torch.rand(B, 1, 1, L) > 0.4
    mask[..., 0] = True
    ours, _ = grouped_sdpa_attention(module, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == ref.shape == (B, 1, H, D)
    torch.testing.assert_close(ours, ref)
    # the fold matters: a wrong head order would not match
    swapped, _ = grouped_sdpa_attention(module, q.flip(1), k, v, mask, scaling=0.3)
    assert not torch.allclose(swapped.flip(2), ref)
    # several query tokens (the prefill): HF's sdpa itself
    q4 = torch.randn(B, H, 4, D)
    m4 = torch.ones(B, 1, 4, L, dtype=torch.bool)
    torch.testing.assert_close(grouped_sdpa_attention(module, q4, k, v, m4)[0],
                               sdpa_attention_forward(module, q4, k, v, m4)[0])


def test_sdpa_models_decode_through_the_grouped_function_and_get_their_config_back():
    import ds_ppo.engine.generation.loop as dec

    model = tiny_llama("sdpa")
    seen = []
    inner = model.model.forward

    @functools.wraps(inner)
    def spy(*args, **kwargs):
        seen.append(model.config._attn_implementation)
        return inner(*args, **kwargs)

    model.model.forward = spy
    ids, mask = left_padded()
    ours_greedy(model, ids, mask, 4, [EOS])
    assert seen == [dec.GROUPED_SDPA] * 4  # prefill + 3 steps
    assert model.config._attn_implementation == "sdpa"


def test_generate_with_own_loop_equals_hf_loop_in_chunks_and_keeps_the_replica():
    """ds_ppo.engine.generation.generate (what the trainer calls) on a plain model: the own loop
    and HF generate give the same greedy responses, also with a ragged last chunk
    (generation.batch_size); a kept replica is reused."""
    import types

    from ds_ppo.config import load_config
    from ds_ppo.engine.generation import _prompt_chunks, generate

    model = tiny_llama()
    engine = types.SimpleNamespace(module=model, empty_partition_cache=lambda: None)
    ids, mask = left_padded()
    first = hf_greedy(model, ids, mask, 12, [EOS])
    eos_ids = [EOS, int(first[1, 3])]  # row 1 ends at its 4th token
    base = load_config(None, ["generation.temperature=0", "generation.max_new_tokens=12",
                              "generation.batch_size=2"]).generation
    runs = {}
    # own: continuous batching (2 slots, one call) and one call per 2 rows (continuous=false)
    for loop, continuous, calls in (("own", "auto", 1), ("own", False, 3), ("hf", "auto", 0)):
        cfg = base.model_copy(update={"loop": loop, "keep_replica": True,
                                      "continuous": continuous})
        gen = generate(engine, ids, mask, cfg, "gathered", eos_ids, PAD, torch.float32)
        again = generate(engine, ids, mask, cfg, "gathered", eos_ids, PAD, torch.float32,
                         kept_replica=gen.replica)
        assert again.replica is gen.replica and torch.equal(again.response_ids, gen.response_ids)
        assert gen.loop == loop and len(gen.decode_stats) == calls
        assert (gen.logprobs is None) == (loop == "hf")
        if continuous == "auto" and loop == "own":
            assert gen.decode_stats[0].slots == 2 and gen.decode_stats[0].refills == 3
            runs["continuous"] = gen
        else:
            runs[loop] = gen
    assert torch.equal(runs["continuous"].response_ids, runs["own"].response_ids)
    torch.testing.assert_close(runs["continuous"].logprobs, runs["own"].logprobs)
    assert torch.equal(runs["own"].response_ids, runs["hf"].response_ids)
    assert torch.equal(runs["own"].mask, runs["hf"].mask)
    assert runs["own"].mask[1].sum() == 4 and runs["own"].ended[1]
    # the chunks take the prompts longest first, without the columns all their rows pad; the
    # responses come back in prompt order, as one call on the whole batch gives them
    assert _prompt_chunks(mask, 2) == [([0, 3], 0), ([1, 2], 2), ([4], 6)]
    whole = generate(engine, ids, mask, base.model_copy(update={"batch_size": None}), "gathered",
                     eos_ids, PAD, torch.float32)
    assert torch.equal(whole.response_ids, runs["own"].response_ids)


def test_generation_out_of_memory_retries_in_halves(monkeypatch, caplog):
    """Gathered mode: a generate call that runs out of device memory is retried on each half
    of its prompts (no collectives there, so one rank may do it alone); the responses are
    those of one call. Modes with collectives in the decode re-raise."""
    import types

    import ds_ppo.engine.generation as gen_mod
    from ds_ppo.config import load_config

    model = tiny_llama()
    engine = types.SimpleNamespace(module=model, empty_partition_cache=lambda: None)
    ids, mask = left_padded()
    cfg = load_config(None, ["generation.temperature=0", "generation.max_new_tokens=6",
                             "generation.loop=own"]).generation
    expected = gen_mod.generate(engine, ids, mask, cfg, "gathered", [EOS], PAD, torch.float32)
    real, calls = gen_mod._own_decode, []

    def small_memory(*args):
        run = real(*args)

        def limited(rows, rows_mask):
            calls.append(rows.shape[0])
            if rows.shape[0] > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return run(rows, rows_mask)
        return limited

    monkeypatch.setattr(gen_mod, "_own_decode", small_memory)
    with caplog.at_level("WARNING", logger="ds_ppo"):
        got = gen_mod.generate(engine, ids, mask, cfg, "gathered", [EOS], PAD, torch.float32)
    assert calls == [5, 2, 3, 1, 2]  # 5 -> 2 + 3, 3 -> 1 + 2
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.mask, expected.mask)
    assert "out of device memory for 5 prompts" in caplog.text
    with pytest.raises(torch.OutOfMemoryError):
        gen_mod._run_or_split(small_memory(model, cfg, [EOS], PAD), ids, mask, splittable=False)


@pytest.mark.parametrize("tied", [True, False])
def test_replica_equals_the_model_with_tied_or_untied_embeddings(tied):
    """build_replica on a plain model: the same logits. With tied embeddings the output head
    must be the embedding matrix again (a regression: it stayed uninitialised)."""
    from ds_ppo.engine.generation import build_replica

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=tied)).eval()
    replica = build_replica(model, torch.float32, torch.device("cpu"))
    shared = replica.lm_head.weight.data_ptr() == replica.model.embed_tokens.weight.data_ptr()
    assert shared == tied
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(replica(input_ids=ids).logits, model(input_ids=ids).logits)


def test_compiled_step_gives_the_eager_steps_tokens_in_fp32():
    """generation.compile_step: the decoding step's forward compiled by inductor (CPU here,
    static shapes) gives the eager loop's greedy tokens, with continuous batching's refills and
    narrower batches too, and the same sampled tokens from the same seed."""
    import ds_ppo.engine.generation.loop as dec

    model = tiny_llama("sdpa")
    ids, mask = left_padded()
    eager, _ = ours_greedy(model, ids, mask, 12, [EOS], check_every=4)
    calls, steps = [], []
    original = dec.compiled_step

    def counting(m):
        fn = original(m)
        calls.append(fn)

        def step(**kwargs):
            steps.append(kwargs["input_ids"].shape[0])
            return fn(**kwargs)
        return step

    dec.compiled_step, saved = counting, dec.compiled_step
    try:
        compiled = decode(model, ids, mask, max_new_tokens=12, eos_ids=[EOS], pad_id=PAD,
                          temperature=0.0, suppress_ids=[PAD], stop_check_every=4,
                          compile_step=True)
        refilled = decode(model, ids, mask, max_new_tokens=12, eos_ids=[EOS], pad_id=PAD,
                          temperature=0.0, suppress_ids=[PAD], stop_check_every=4,
                          compile_step=True, slots=2)
        sampled = []
        for on in (False, True):
            torch.manual_seed(5)
            sampled.append(decode(model, ids, mask, max_new_tokens=12, eos_ids=[EOS],
                                  pad_id=PAD, temperature=1.0, suppress_ids=[PAD],
                                  compile_step=on).response_ids)
    finally:
        dec.compiled_step = saved
    assert calls and calls[0] is calls[-1]  # one compiled forward per model, reused
    assert steps.count(5) >= 2 * 11 and 2 in steps  # every decoding step ran it (5 or 2 slots)
    assert "_ds_ppo_compiled_step" not in dict(model.named_modules())  # not a submodule
    assert torch.equal(compiled.response_ids, eager), (compiled.response_ids, eager)
    assert torch.equal(refilled.response_ids, eager) and refilled.stats.refills > 0
    assert torch.equal(sampled[0], sampled[1])


def test_compile_step_is_checked_at_validation():
    from ds_ppo.config import load_config, validate
    from ds_ppo.errors import ConfigError

    with pytest.raises(ConfigError, match="compile_step needs generation.keep_replica=true"):
        validate(load_config(None, ["generation.compile_step=true"]), 1)
    with pytest.raises(ConfigError, match="generation.compile_step compiles our decoding loop"):
        validate(load_config(None, ["generation.compile_step=true", "generation.loop=hf",
                                    "generation.keep_replica=true"]), 1)
    validate(load_config(None, ["generation.compile_step=true", "generation.keep_replica=true"]), 1)
