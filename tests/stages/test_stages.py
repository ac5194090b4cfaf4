"""Stage functions without DeepSpeed: generation options, the auto mode choice, reward scores
(penalties, bad reward functions), metric reduction, forward-pass alignment."""
from __future__ import annotations

import math
import re
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_ppo.config import load_config
from ds_ppo.containers import Rollout
from ds_ppo.engine.generation import _generate_kwargs, choose_loop, choose_mode
from ds_ppo.errors import ConfigError
from ds_ppo.data.prompts import truncate_left
from ds_ppo.rewards.encode import rollout_for_reward
from ds_ppo.engine.forward import last_token_index, position_ids, response_logprobs, response_values
from ds_ppo.metrics import Accumulator, std_from_moments
from support.rollouts import padded_rollout
from ds_ppo.rewards.call import load_reward_function
from ds_ppo.rewards.functions import positive_words
from ds_ppo.ppo.scoring import reward_scores, reward_settings
from ds_ppo.ppo.update import minibatch_rows, ppo_update, update_settings
from support.stage_calls import score_rollout
from ds_ppo.bench.stand_ins import small_llama


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_generate_kwargs_sampling_greedy_and_stops():
    g = _cfg("generation.temperature=0.7", "generation.top_p=0.9", "generation.top_k=5",
             "generation.min_new_tokens=2").generation
    kw = _generate_kwargs(g, [2, 9], pad_id=3)
    assert kw["do_sample"] and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["top_k"] == 5 and kw["min_new_tokens"] == 2 and kw["eos_token_id"] == [2, 9]
    assert kw["suppress_tokens"] == [3]  # a sampled pad would read as padding
    greedy = _generate_kwargs(_cfg("generation.temperature=0").generation, [2], pad_id=2)
    assert greedy["do_sample"] is False and "suppress_tokens" not in greedy


def test_decoding_loop_choice():
    llama = LlamaConfig(attn_implementation="sdpa")
    flash = LlamaConfig(attn_implementation="flash_attention_2")
    auto = _cfg().generation
    assert auto.loop == "auto"
    assert choose_loop(auto, "gathered", llama) == "own"
    assert choose_loop(auto, "zero3", llama) == "hf"  # the hooks path needs synced_gpus
    assert choose_loop(auto, "gathered", flash) == "hf"  # not served by ours: HF generate
    for hf_option in ("generation.cache_implementation=static", "generation.compile=true"):
        assert choose_loop(_cfg(hf_option).generation, "gathered", llama) == "hf"
    assert choose_loop(_cfg("generation.loop=hf").generation, "gathered", llama) == "hf"
    own = _cfg("generation.loop=own").generation
    assert choose_loop(own, "gathered", llama) == "own"
    with pytest.raises(ConfigError, match="flash_attention_2.*generation.loop=auto"):
        choose_loop(own, "gathered", flash)


def test_auto_mode_falls_back_to_tensor_parallel_then_zero3(monkeypatch):
    from ds_ppo.engine import generation
    from ds_ppo.engine.generation import _param_bytes

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    full = _param_bytes(model, torch.float32)
    shard = _param_bytes(model, torch.float32, tp_size=2)
    # by hand, fp32: per layer q 64x64, k and v 32x64, o 64x64, gate/up/down 128x64 = 36,864
    # linear weights, 2 layers; norms 2 x 2 x 64 + 64; embeddings and head 2 x 50 x 64
    assert full == 4 * (2 * 36_864 + 320 + 6_400)
    assert shard == 4 * (36_864 + 320 + 6_400)  # linear layers halved, the rest whole
    import psutil

    free = psutil.virtual_memory().available
    monkeypatch.setattr(generation.dist, "local_world_size", lambda: 2)

    def mode(fraction, *extra):
        g = _cfg("generation.mode=auto", f"generation.replica_memory_fraction={fraction}",
                 *extra).generation
        return choose_mode(g, model, torch.float32, torch.device("cpu"))

    between = (full + shard) / 2 / free  # the shard fits, the whole replica does not
    assert mode(min(1.0, 2 * full / free)) == "gathered"
    assert mode(between) == "tensor_parallel"
    assert mode(between, "generation.tp_size=1") == "zero3"
    assert mode(shard / 4 / free) == "zero3"
    # with 4 ranks each keeps one of the 2 KV heads: k and v halved, q, o and the MLP quartered
    assert _param_bytes(model, torch.float32, tp_size=4) == 4 * (
        2 * (2 * 64 * 64 // 4 + 2 * 32 * 64 // 2 + 3 * 128 * 64 // 4) + 320 + 6_400)
    with pytest.raises(ConfigError, match="num_attention_heads=4 not divisible by tp_size=8"):
        choose_mode(_cfg("generation.mode=tensor_parallel", "generation.tp_size=8").generation,
                    model, torch.float32, torch.device("cpu"))


def test_tensor_parallel_refuses_unchecked_layouts(monkeypatch):
    from transformers import Olmo2Config, Phi3Config, Phi3ForCausalLM

    from ds_ppo.config.tensor_parallel_shapes import unshardable
    from ds_ppo.engine.generation.choice import decoder_linears

    llama = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    assert unshardable(llama, 2) is None
    assert unshardable(llama, 4) is None  # 2 KV heads over 4 ranks: one KV head per rank
    assert "num_attention_heads=4 not divisible by tp_size=8" in unshardable(llama, 8)
    assert "num_key_value_heads=2" in unshardable(LlamaConfig(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96), 3)
    from transformers import MixtralConfig, Qwen3MoeConfig

    moe = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                         intermediate_size=96, moe_intermediate_size=32)
    assert unshardable(moe, 2) is None
    assert unshardable(moe, 4) == "num_experts=6 not divisible by tp_size=4"
    assert "intermediate_size=6 " in unshardable(  # a dense MLP layer beside the MoE ones
        Qwen3MoeConfig(num_attention_heads=4, num_experts=8, intermediate_size=6,
                       mlp_only_layers=[0]), 4)
    assert unshardable(MixtralConfig(num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=8, intermediate_size=6), 4) is None
    # an expert-parallel (AutoEP) layer's router linear is not in the replica: not counted
    ep_layer = torch.nn.Module()
    ep_layer._is_autoep_layer, ep_layer.gate = True, torch.nn.Linear(2, 2)
    layer = torch.nn.Module()
    layer.mlp, layer.q_proj = ep_layer, torch.nn.Linear(2, 2)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    assert decoder_linears(model) == {"q_proj"}
    assert "olmo2" in unshardable(Olmo2Config(), 2)  # normalises q across all heads
    phi3 = Phi3Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    with torch.device("meta"):
        model = Phi3ForCausalLM(phi3)
    assert "phi3" in unshardable(phi3, 2, decoder_linears(model))
    # were phi3 on the checked list, the module check would still name its fused layers
    import ds_ppo.config.tensor_parallel_shapes as tpm

    monkeypatch.setattr(tpm, "MODEL_TYPES", tpm.MODEL_TYPES + ("phi3",))
    assert "qkv_proj" in unshardable(phi3, 2, decoder_linears(model))


def test_tensor_parallel_shards_by_hand():
    from ds_ppo.engine.generation.tensor_parallel import TPGroup, RowParallelLinear, shard_modules, shard_of

    tp = TPGroup(group=None, size=2, rank=1, first=0)
    w = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(shard_of("model.layers.0.self_attn.q_proj.weight", w, tp), w[2:])
    assert torch.equal(shard_of("model.layers.0.mlp.up_proj.bias", torch.arange(4.0), tp),
                       torch.tensor([2.0, 3.0]))
    assert torch.equal(shard_of("model.layers.0.self_attn.o_proj.weight", w, tp), w[:, 3:])
    assert torch.equal(shard_of("model.layers.0.mlp.down_proj.bias", torch.arange(4.0), tp),
                       torch.arange(4.0))  # added once, after the sum
    assert torch.equal(shard_of("model.embed_tokens.weight", w, tp), w)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64,
                                             intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
    shard_modules(model, tp)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.shape == (2 * 16, 64) and attn.k_proj.weight.shape == (16, 64)
    assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.weight.shape == (64, 32)
    assert mlp.gate_proj.weight.shape == (64, 64) and mlp.down_proj.weight.shape == (64, 64)
    # fewer KV heads than ranks: 4 ranks, 2 KV heads of 16, ranks 2 and 3 hold the second
    tp4 = TPGroup(group=None, size=4, rank=3, first=0)
    kw = torch.arange(32.0)[:, None]
    assert torch.equal(shard_of("model.layers.0.self_attn.v_proj.weight", kw, tp4, 2), kw[16:])
    assert torch.equal(shard_of("model.layers.0.self_attn.q_proj.weight", kw, tp4, 2), kw[24:])
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64,
                                             intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
    shard_modules(model, tp4)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (16, 64) and attn.k_proj.weight.shape == (16, 64)
    assert attn.num_key_value_groups == 1  # one query head per rank, on its one KV head
    # a mixture-of-experts layer: experts split by expert, the router whole
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    ew = torch.arange(4.0)[:, None, None].expand(4, 6, 3)
    assert torch.equal(shard_of("model.layers.0.mlp.experts.gate_up_proj", ew, tp), ew[2:])
    assert torch.equal(shard_of("model.layers.0.mlp.experts.down_proj", ew, tp), ew[2:])
    assert torch.equal(shard_of("model.layers.0.mlp.gate.weight", w, tp), w)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, moe_intermediate_size=8))
    shard_modules(model, tp)
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape == (2, 16, 64) and block.experts.num_experts == 2
    assert block.gate.weight.shape == (4, 64) and block.gate.num_experts == 4
    assert model.lm_head.weight.shape == (50, 64)


def test_auto_mode_chooses_by_memory():
    model = torch.nn.Linear(1000, 1000)  # 1M params: 2 MB in bf16
    g = _cfg("generation.mode=auto").generation
    assert choose_mode(g, model, torch.bfloat16, torch.device("cpu")) == "gathered"
    huge = types.SimpleNamespace(ds_numel=10**15, ds_shape=(10**15,), numel=lambda: 0)  # ZeRO-3
    big = types.SimpleNamespace(named_parameters=lambda: iter([("w", huge)]),
                                named_modules=lambda: iter([]))
    assert choose_mode(g, big, torch.bfloat16, torch.device("cpu")) == "zero3"
    assert choose_mode(_cfg("generation.mode=zero3").generation, model, torch.bfloat16,
                       torch.device("cpu")) == "zero3"


def _rollout(responses, ended):
    B = len(responses)
    return Rollout(prompt_ids=torch.ones(B, 2, dtype=torch.long),
                   prompt_mask=torch.ones(B, 2, dtype=torch.bool),
                   response_ids=torch.ones(B, 3, dtype=torch.long),
                   mask=torch.ones(B, 3, dtype=torch.bool),
                   ended=torch.tensor(ended), prompts=["p"] * B, responses=responses,
                   prompt_lens=[2] * B, response_lens=[3] * B, extras=[{}] * B)


def test_reward_function_scores_and_missing_eos_penalty():
    cfg = _cfg("reward.missing_eos_penalty=0.5")
    engines = types.SimpleNamespace(reward_fn=positive_words)
    scores, cut = reward_scores(_rollout([" good day", " a bad day"], [True, False]), engines,
                                reward_settings(cfg), None)
    assert cut is None
    assert scores.tolist() == pytest.approx([0.5, 0.0 - 0.5])


def test_reward_function_must_return_one_finite_score_each():
    from ds_ppo.errors import RewardFunctionError

    cfg = _cfg()
    two = _rollout(["a", "b"], [True, True])
    for fn, message in [
            (lambda p, r: [1.0], "returned 1 scores for 2 responses"),
            (lambda p, r: [1.0, float("nan")], r"score 1 is nan \(non-finite\)"),
            (lambda p, r: ["0.5", 1.0], r"score 0 is '0.5' \(str\)"),
            (lambda p, r: [None, None], r"score 0 is None \(NoneType\); score 1 is None"),
            (lambda p, r: None, "returned NoneType None; it must return a list of 2 floats"),
            (lambda p, r: "0.5 0.5", "returned str '0.5 0.5'"),
            (lambda p, r: [[1.0], [2.0]], r"score 0 is \[1.0\] \(list\)"),
            (lambda p, r: 1 / 0, r"raised ZeroDivisionError: division by zero at .*test_stages"),
    ]:
        with pytest.raises(RewardFunctionError, match=r"reward.function = 'ds_ppo.rewards:"
                           r"positive_words' (returned|raised)") as info:
            reward_scores(two, types.SimpleNamespace(reward_fn=fn), reward_settings(cfg), None)
        assert re.search(message, str(info.value)), (message, str(info.value))
        assert info.value.exit_code == 2
    import numpy as np

    ok = [lambda p, r: (1, 0.5), lambda p, r: [True, np.float32(0.5)],
          lambda p, r: torch.tensor([1.0, 0.5]), lambda p, r: [torch.tensor(1.0), 0.5]]
    for fn in ok:
        scores, _ = reward_scores(two, types.SimpleNamespace(reward_fn=fn), reward_settings(cfg), None)
        assert scores.tolist() == [1.0, 0.5]


def test_reward_function_that_hangs_is_stopped_after_timeout():
    """A call still running after reward.timeout_s raises RewardTimeout in the caller's thread;
    the hung call is left in a daemon thread."""
    import threading
    import time

    from ds_ppo.errors import RewardTimeout

    release = threading.Event()

    def hangs(prompts, responses):
        release.wait(60)
        return [0.0] * len(prompts)

    cfg = _cfg("reward.timeout_s=0.5")
    t0 = time.perf_counter()
    with pytest.raises(RewardTimeout, match=r"did not return within reward.timeout_s = 0.5 s"):
        reward_scores(_rollout(["a", "b"], [True, True]), types.SimpleNamespace(reward_fn=hangs),
                      reward_settings(cfg), None)
    assert time.perf_counter() - t0 < 10
    hung = [t for t in threading.enumerate() if t.name.startswith("reward.function")]
    assert hung and all(t.daemon for t in hung)
    release.set()
    # null: the function runs in the calling thread (signal-based code inside it works)
    where = []
    cfg = _cfg("reward.timeout_s=null")
    reward_scores(_rollout(["a"], [True]), types.SimpleNamespace(
        reward_fn=lambda p, r: where.append(threading.current_thread()) or [1.0]),
        reward_settings(cfg), None)
    assert where == [threading.main_thread()]


def test_reward_function_worker_has_the_callers_grad_mode_and_cuda_device(monkeypatch):
    """Grad mode and the current CUDA device are per thread: the worker thread that runs a
    reward.function under reward.timeout_s gets the caller's (scoring runs under no_grad; a
    rank's GPU is its current device, a new thread's would be cuda:0 on every rank). The CUDA
    runtime's per-thread device is simulated: this test runs on CPU."""
    import threading

    per_thread = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(per_thread, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: setattr(per_thread, "device", int(d)))
    torch.cuda.set_device(3)  # this rank's GPU, as init_distributed sets it
    seen = []

    def records(prompts, responses):
        seen.append((threading.current_thread() is threading.main_thread(),
                     torch.is_grad_enabled(), torch.cuda.current_device()))
        return [1.0] * len(prompts)

    engines = types.SimpleNamespace(reward_fn=records)
    with torch.no_grad():
        reward_scores(_rollout(["a"], [True]), engines, reward_settings(_cfg("reward.timeout_s=5")),
                      None)
    reward_scores(_rollout(["a"], [True]), engines, reward_settings(_cfg("reward.timeout_s=5")),
                      None)
    assert seen == [(False, False, 3), (False, True, 3)]


def exact_match(prompts, responses, answer, *, weight=1.0):
    return [weight * float(r.strip() == a) for r, a in zip(responses, answer)]


def with_kwargs(prompts, responses, **columns):
    return [float(len(columns))] * len(prompts)


def test_reward_function_gets_the_dataset_columns():
    cfg = _cfg("data.path=p.jsonl", "data.reward_keys=[answer]")
    rollout = _rollout([" 4", " 5"], [True, True])
    rollout.extras = [{"answer": "4"}, {"answer": "6"}]
    scores, _ = reward_scores(rollout, types.SimpleNamespace(reward_fn=exact_match),
                              reward_settings(cfg), None)
    assert scores.tolist() == [1.0, 0.0]
    from ds_ppo.errors import ConfigError

    spec = f"{__name__}:exact_match"
    assert load_reward_function(spec, ["answer"]) is exact_match
    with pytest.raises(ConfigError, match="takes no keyword argument solution"):
        load_reward_function(spec, ["answer", "solution"])
    with pytest.raises(ConfigError, match="takes no keyword argument answer"):
        load_reward_function("ds_ppo.rewards:positive_words", ["answer"])
    assert load_reward_function(f"{__name__}:with_kwargs", ["a", "b"]) is with_kwargs


def chat_aware(prompts, responses, messages):
    return [float(len(m)) if m is not None else -1.0 for m in messages]


def old_style(prompts, responses, **columns):
    assert "messages" not in columns  # a function that does not name it never gets it
    return [0.5] * len(prompts)


def test_a_reward_function_that_names_messages_gets_each_prompts_chat():
    """`messages`: each prompt's chat (None for a plain-text one), only for a function that
    names the parameter; it needs no data.reward_keys entry, and reward.stream's calls get it
    too."""
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
             None]
    rollout = _rollout([" hello", " bye"], [True, True])
    rollout.messages = chats
    cfg = _cfg("reward.stream=false")
    assert load_reward_function(f"{__name__}:chat_aware") is chat_aware  # no reward_keys needed
    scores, _ = reward_scores(rollout, types.SimpleNamespace(reward_fn=chat_aware),
                              reward_settings(cfg), None)
    assert scores.tolist() == [2.0, -1.0]
    scores, _ = reward_scores(rollout, types.SimpleNamespace(reward_fn=old_style),
                              reward_settings(cfg), None)
    assert scores.tolist() == [0.5, 0.5]
    rollout.messages = None  # a dataset without chats: one None per row
    scores, _ = reward_scores(rollout, types.SimpleNamespace(reward_fn=chat_aware),
                              reward_settings(cfg), None)
    assert scores.tolist() == [-1.0, -1.0]
    from ds_ppo.ppo.reward_stream import RewardStream, _pool
    from ds_ppo.ppo.scoring import reward_call_settings

    rollout.messages = chats
    stream = RewardStream(chat_aware, reward_call_settings(_cfg()), _pool(2))
    stream.add([1], ["p"], [" bye"], [{}], [None])
    stream.add([0], ["p"], [" hello"], [{}], [chats[0]])
    assert stream.result(rollout).scores == [2.0, -1.0]


def test_positive_words_and_loading():
    assert positive_words(["x"] * 3, ["good great bad", "", "Happy!"]) == pytest.approx(
        [2 / 3, 0.0, 1.0])
    assert load_reward_function("ds_ppo.rewards:positive_words") is positive_words
    from ds_ppo.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot import"):
        load_reward_function("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="no callable"):
        load_reward_function("ds_ppo.rewards:nope")


def test_accumulator_reduces_mean_max_sum_replicated():
    acc = Accumulator()
    acc.add_mean("a", 6.0, 3.0)
    acc.add_mean("a", 4.0, 1.0)
    acc.add_max("t", 1.0)
    acc.add_max("t", 3.0)
    acc.add_sum("n", 2.0)
    acc.add_sum("n", 5.0)
    acc.add_replicated("r", 1.0)
    acc.add_replicated("r", 3.0)
    assert acc.reduce() == {"a": 2.5, "t": 3.0, "n": 7.0, "r": 2.0}
    assert std_from_moments(2.0, 5.0) == pytest.approx(1.0)
    acc = Accumulator()
    acc.add_mean("empty", 0.0, 0.0)
    assert math.isnan(acc.reduce()["empty"])


PROMPTS = [[5, 6, 7], [9, 3], [4, 4, 8, 2]]
RESPONSES = [[8, 9, 10, 11], [12], [13, 14]]


def test_response_logprobs_equal_unpadded_and_skip_unused_columns():
    """Each row's response log-probs equal those of its unpadded sequence, whatever the other
    rows' lengths; the forward only sees the columns some row needs; logits only for responses."""
    model = small_llama()
    rollout = padded_rollout(PROMPTS, RESPONSES, P=6, T=7)
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: widths.append(args[0].shape[1]))
    with torch.no_grad():
        lp, ent = response_logprobs(model, rollout, 1.0, with_entropy=True)
    hook.remove()
    assert widths == [4 + 4]  # longest prompt + longest response, not 6 + 7
    assert lp.shape == ent.shape == (3, 7)
    for b, (pr, rs) in enumerate(zip(PROMPTS, RESPONSES)):
        with torch.no_grad():
            logits = model(torch.tensor([pr + rs])).logits[0, len(pr) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rs)[:, None])[:, 0]
        torch.testing.assert_close(lp[b, :len(rs)], ref, atol=1e-5, rtol=1e-5)
        assert (ent[b, :len(rs)] > 0).all()
    assert (lp[:, 4:] == 0).all() and (ent[:, 4:] == 0).all()  # the columns not computed
    assert position_ids(torch.tensor([[0, 0, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2]]
    assert last_token_index(torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])).tolist() == [2, 3]


def test_response_values_equal_unpadded():
    torch.manual_seed(0)
    model = small_llama()
    model.lm_head = torch.nn.Linear(16, 1)  # a per-token value head
    rollout = padded_rollout(PROMPTS, RESPONSES, P=5, T=6)
    with torch.no_grad():
        values = response_values(model, rollout)
        assert values.shape == (3, 6)
        for b, (pr, rs) in enumerate(zip(PROMPTS, RESPONSES)):
            ref = model(torch.tensor([pr + rs])).logits[0, len(pr) - 1:-1, 0]
            torch.testing.assert_close(values[b, :len(rs)], ref, atol=1e-5, rtol=1e-5)
        assert (values[:, 4:] == 0).all()


def test_micro_batches_group_similar_lengths():
    rollout = padded_rollout([[1]] * 5, [[1] * n for n in (1, 6, 2, 5, 6)], P=1, T=6)
    assert rollout.micro_batches(2) == [[1, 4], [3, 2], [0]]  # ties keep their order
    assert rollout.micro_batches(2, rows=[0, 2, 3]) == [[3, 2], [0]]
    sub = rollout.slice([3, 0])
    assert sub.response_lens == [5, 1] and sub.mask.sum(1).tolist() == [5, 1]
    ids, am, keep = sub.model_inputs()
    assert keep == 5 and ids.shape == am.shape == (2, 6)


def test_positions_count_what_the_micro_batch_forwards_compute():
    """Rollout.positions (the padding/* metrics): the positions of the micro-batches'
    model_inputs and their real tokens, from host lengths."""
    prompts = [[2] * n for n in (3, 1, 5, 2, 4)]
    responses = [[1] * n for n in (1, 6, 2, 5, 6)]
    rollout = padded_rollout(prompts, responses, P=7, T=9)
    batches = rollout.micro_batches(2)
    inputs = [rollout.slice(rows).model_inputs() for rows in batches]
    assert rollout.positions(batches) == (sum(ids.numel() for ids, _, _ in inputs),
                                          sum(int(am.sum()) for _, am, _ in inputs))
    assert batches == [[4, 1], [2, 3], [0]]
    assert rollout.positions(batches) == (2 * (4 + 6) + 2 * (5 + 5) + 1 * (3 + 1), 35)
    assert rollout.positions([list(range(5))]) == (5 * (5 + 6), 35)  # one micro-batch
    assert rollout.positions([[0]]) == (4, 4)  # a row alone computes no padding


def test_reward_inputs_cut_each_row_like_encode_for_reward():
    """Same tokenizer: each row keeps its last max_len real tokens (and a leading BOS), however
    long the other rows' responses are; a row within max_len is whole."""
    bos = 1
    prompts = [[bos, 5, 6, 7, 8], [bos, 9, 3], [4, 4, 8, 2, 6]]
    responses = [[10, 11], [12, 13, 14, 15, 16, 17], [13, 14]]
    rollout = padded_rollout(prompts, responses, P=6, T=8)
    ids, am, cut = rollout_for_reward(rollout, max_len=6, bos_id=bos)
    assert cut.tolist() == [True, True, True]
    rows = [[t for t, m in zip(r, k) if m] for r, k in zip(ids.tolist(), am.tolist())]
    expected = [truncate_left(p + r, 6, keep_first=p[0] == bos)
                for p, r in zip(prompts, responses)]
    assert rows == expected
    assert rows[0] == [bos, 6, 7, 8, 10, 11] and rows[2] == [4, 8, 2, 6, 13, 14]
    assert ids.shape[1] == 6 and am[:, :1].all()  # right-padded, no column beyond max_len
    whole, _, cut = rollout_for_reward(rollout, max_len=100, bos_id=bos)
    assert not cut.any()
    assert [r[:len(p) + len(s)] for r, p, s in zip(whole.tolist(), prompts, responses)] == \
        [p + s for p, s in zip(prompts, responses)]


def _tiny_reward_model():
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1)).eval()


def test_scoring_returns_rows_in_rollout_order():
    """Micro-batches run longest-first; the scores (and which inputs were cut to max_len) come
    back in the rollout's row order."""
    from ds_ppo.engine.role_objects import RewardRole
    from ds_ppo.engine.forward import LastTokenScorer

    rm = _tiny_reward_model()
    rollout = padded_rollout(PROMPTS, RESPONSES, P=4, T=4)
    engines = types.SimpleNamespace(reward_fn=None, reward=RewardRole(LastTokenScorer(rm)))
    cfg = _cfg("ppo.micro_batch_size=1")
    with torch.no_grad():
        got, cut = reward_scores(rollout, engines, reward_settings(cfg),
                                 lambda r: rollout_for_reward(r, 6, None))
        assert cut.tolist() == [True, False, False]  # 7, 3 and 6 tokens; max_len 6
        for b, (pr, rs) in enumerate(zip(PROMPTS, RESPONSES)):
            hidden = rm.model(torch.tensor([(pr + rs)[-6:]])).last_hidden_state[0, -1]
            torch.testing.assert_close(got[b], rm.score(hidden)[0], atol=1e-5, rtol=1e-5)


class _CountingEngine(torch.nn.Module):
    """Stands in for a DeepSpeedEngine: counts calls of its forward and, like DeepSpeed, passes
    other attributes through to the wrapped module (so a bypass still runs, uncounted)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def get_global_grad_norm(self):
        return None


def test_every_role_forward_goes_through_its_engine():
    """Scoring and the update call each model role through its engine's own forward (ZeRO-3
    resets its parameter-fetch trace in the root module's hooks; attribute forwarding skips
    them). The reward engine wraps LastTokenScorer, as init_engines builds it."""
    from transformers import LlamaForTokenClassification

    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, RewardRole, ValueRole
    from ds_ppo.engine.forward import LastTokenScorer
    from ds_ppo.ppo.advantages import add_advantages, advantage_settings

    value = LlamaForTokenClassification(LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1))
    fakes = dict(
        policy=_CountingEngine(small_llama()), reference=_CountingEngine(small_llama()),
        value=_CountingEngine(value), reward=_CountingEngine(LastTokenScorer(_tiny_reward_model())))
    engines = types.SimpleNamespace(
        policy=PolicyRole(fakes["policy"]), reference=ReferenceRole(fakes["reference"]),
        value=ValueRole(fakes["value"]), reward=RewardRole(fakes["reward"]), reward_fn=None,
        teacher=None)
    rollout = padded_rollout(PROMPTS, RESPONSES, P=4, T=4)
    cfg = _cfg("ppo.micro_batch_size=2", "ppo.mini_batch_size=2", "ppo.rollout_batch_size=2",
               "ppo.ppo_epochs=1")
    exp = score_rollout(rollout, engines, cfg, lambda r: rollout_for_reward(r, 64, None))
    roles = ("policy", "reference", "value", "reward")
    assert {role: fakes[role].calls for role in roles} == dict.fromkeys(
        roles, 2)  # 3 rows in micro-batches of 2
    assert exp.scores.shape == (3,)
    # the update: one mini-batch of 2 rows, one micro-batch, one forward of policy and value
    ppo_update(add_advantages(exp, advantage_settings(cfg, 0.1)), engines, update_settings(cfg), 1,
               Accumulator())
    assert {role: fakes[role].calls for role in roles} == {
        "policy": 3, "reference": 2, "value": 3, "reward": 2}


class _RoleInterface:
    """A role reduced to its public methods: no engine, no module, not callable. Stages that
    reach past the role (call the engine, read its optimizer) fail on it."""

    def __init__(self, role):
        for name in dir(type(role)):
            if not name.startswith("_") and name not in ("engine", "module"):
                setattr(self, name, getattr(role, name))


def test_scoring_and_the_update_use_only_the_role_methods():
    """engine/role_objects.py is the whole seam between the stages and the engines: scoring and
    the update run on roles that expose nothing else, and they step each trained role once per
    micro-batch and read its lr and gradient norm through it."""
    from transformers import LlamaForTokenClassification

    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, RewardRole, ValueRole
    from ds_ppo.engine.forward import LastTokenScorer
    from ds_ppo.ppo.advantages import add_advantages, advantage_settings

    value = LlamaForTokenClassification(LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1))
    fakes = dict(policy=_CountingEngine(small_llama()), value=_CountingEngine(value))
    steps = {"policy": 0, "value": 0}
    for role, fake in fakes.items():
        fake.step = lambda role=role: steps.__setitem__(role, steps[role] + 1)
        fake.optimizer = None
    engines = types.SimpleNamespace(
        policy=_RoleInterface(PolicyRole(fakes["policy"])),
        reference=_RoleInterface(ReferenceRole(_CountingEngine(small_llama()))),
        value=_RoleInterface(ValueRole(fakes["value"])),
        reward=_RoleInterface(RewardRole(_CountingEngine(LastTokenScorer(_tiny_reward_model())))),
        reward_fn=None, teacher=None)
    rollout = padded_rollout(PROMPTS, RESPONSES, P=4, T=4)
    cfg = _cfg("ppo.micro_batch_size=1", "ppo.mini_batch_size=2", "ppo.rollout_batch_size=2",
               "ppo.ppo_epochs=1")
    exp = score_rollout(rollout, engines, cfg, lambda r: rollout_for_reward(r, 64, None))
    acc = Accumulator()
    ppo_update(add_advantages(exp, advantage_settings(cfg, 0.1)), engines, update_settings(cfg), 1,
               acc)
    assert steps == {"policy": 2, "value": 2}  # one mini-batch of 2 rows, micro-batches of 1
    assert math.isnan(engines.policy.lr())  # the stand-in engine has no optimizer
    assert "policy/grad_norm" not in acc.reduce()  # DeepSpeed computed none


class _SteppingEngine(_CountingEngine):
    """A _CountingEngine that trains: SGD on every `accum`-th step() (DeepSpeed's gradient
    accumulation boundary)."""

    def __init__(self, module, accum: int):
        super().__init__(module)
        self.accum, self.micro_steps = accum, 0
        self.sgd = torch.optim.SGD(module.parameters(), lr=0.5)
        self.optimizer = None  # no DeepSpeed optimizer: the role's lr() is NaN

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accum == 0:
            self.sgd.step()
            self.sgd.zero_grad()


def test_old_logprobs_from_the_rollout_skip_the_policy_forward():
    """ppo.old_logprobs=rollout: scoring runs no policy forward and takes the sampler's
    log-probs (here the policy's own, as our loop gives them in float32), so the update is the
    same as with a scoring forward; policy/entropy comes from the first epoch's forwards (all
    before its one optimizer step, so equal to scoring's; epoch 2, after the step, would move
    it)."""
    from transformers import LlamaForTokenClassification

    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, ValueRole
    from ds_ppo.ppo.advantages import add_advantages, advantage_settings
    from ds_ppo.ppo.correction import correction_settings, rollout_correction
    from ds_ppo.algo.kl import FixedKLController
    from ds_ppo.ppo.iteration_report import iteration_metrics

    rollout = padded_rollout([*PROMPTS, [7, 3]], [*RESPONSES, [20, 21, 22]], P=4, T=4)
    with torch.no_grad():
        sampled, _ = response_logprobs(small_llama(), rollout, 0.7)
    rollout.rollout_logprobs = sampled.masked_fill(~rollout.mask, 0.0)
    runs = {}
    for mode in ("training", "rollout"):
        torch.manual_seed(2)
        value = LlamaForTokenClassification(LlamaConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_labels=1))
        policy = _SteppingEngine(small_llama(), accum=2)
        engines = types.SimpleNamespace(
            policy=PolicyRole(policy), reference=ReferenceRole(_CountingEngine(small_llama())),
            value=ValueRole(_SteppingEngine(value, accum=2)), reward=None, teacher=None,
            reward_fn=lambda prompts, responses, **kw: [float(len(r)) for r in responses])
        cfg = _cfg("ppo.micro_batch_size=2", "ppo.mini_batch_size=4", "ppo.rollout_batch_size=4",
                   "ppo.ppo_epochs=2", "generation.temperature=0.7", f"ppo.old_logprobs={mode}")
        acc = Accumulator()
        exp = rollout_correction(score_rollout(rollout, engines, cfg), correction_settings(cfg),
                                 acc)
        scoring_calls = policy.calls
        exp = add_advantages(exp, advantage_settings(cfg, 0.1))
        ppo_update(exp, engines, update_settings(cfg), 1, acc)
        for phase in ("generation", "scoring", "update"):
            acc.add_max(f"time/{phase}_s", 1.0)
        # what train() logs: the report's rollout statistics, then every rank's reduction
        metrics = iteration_metrics(acc, exp, engines, FixedKLController(0.1), 0.0)
        runs[mode] = (scoring_calls, exp, metrics, [p.detach().clone()
                                                    for p in policy.parameters()])
    (calls_t, exp_t, m_t, w_t), (calls_r, exp_r, m_r, w_r) = runs["training"], runs["rollout"]
    assert (calls_t, calls_r) == (2, 0)  # 4 rows in micro-batches of 2
    assert policy.calls == 4  # the update: 2 epochs x 2 micro-batches
    torch.testing.assert_close(exp_r.old_logprobs, exp_t.old_logprobs, rtol=0, atol=1e-6)
    assert exp_r.entropy is None and "rollout/kl_k3" in m_t and "rollout/kl_k3" not in m_r
    mask = rollout.mask
    scored_entropy = float((exp_t.entropy * mask).sum() / mask.sum())
    assert m_t["policy/entropy"] == pytest.approx(scored_entropy, rel=1e-6)  # the report's
    assert m_r["policy/entropy"] == pytest.approx(scored_entropy, rel=1e-5)  # the update's
    for name in ("loss/policy", "loss/value", "policy/approx_kl", "policy/clip_frac",
                 "kl/token_mean", "score/mean"):
        assert m_r[name] == pytest.approx(m_t[name], rel=1e-5, abs=1e-7), name
    assert m_t["policy/approx_kl"] > 1e-6  # the second epoch ran on stepped weights
    for a, b in zip(w_r, w_t):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a rollout without the sampler's log-probs (generation.loop=auto chose HF generate)
    rollout.rollout_logprobs = None
    with pytest.raises(ConfigError, match="ppo.old_logprobs = 'rollout' needs the rollout"):
        score_rollout(rollout, engines, cfg)


def test_param_chunks_bound_each_gather():
    from ds_ppo.engine.generation import _param_chunks

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 30),
                                torch.nn.Linear(30, 2))  # 110, 330, 62 elements
    chunks = list(_param_chunks(model, limit=150))
    sizes = [sum(p.numel() for _, ps, _ in c for p in ps) for c in chunks]
    assert [n for c in chunks for n, _, _ in c] == [n for n, _ in model.named_parameters()]
    assert sizes == [110, 300, 30 + 62]  # a too-large parameter stands alone
    assert len(list(_param_chunks(model, limit=10**9))) == 1


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_schedule_warmup_then_decay(kind):
    from ds_ppo.config import optimizer_steps
    from ds_ppo.engine.roles import _lr_schedule

    cfg = _cfg("policy.lr=1.0", "policy.warmup_steps=2", f"policy.schedule={kind}",
               "policy.min_lr_ratio=0.1", "iterations=3", "ppo.rollout_batch_size=32",
               "ppo.mini_batch_size=16", "ppo.ppo_epochs=2")
    total = optimizer_steps(cfg)
    assert total == 3 * 2 * 2
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.policy.lr)
    sched = _lr_schedule(opt, cfg.policy, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:2] == pytest.approx([0.5, 1.0])  # warm-up
    if kind == "constant":
        assert lrs[2:] == pytest.approx([1.0] * (total - 2))
    else:
        assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # non-increasing after warm-up
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # min_lr_ratio at the end
        mid = lrs[2 + (total - 2) // 2]
        assert 0.1 < mid < 1.0


def test_cpu_metric_sums_go_through_the_gpu_with_nccl(monkeypatch):
    """NCCL takes only CUDA tensors: metric sums built on the CPU must be moved for the
    collective (gloo, the CPU backend of the tests, would hide the problem)."""
    from ds_ppo.engine import dist

    monkeypatch.setattr(dist.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert dist.collective_device(torch.zeros(2)) == torch.device("cuda", 3)
    assert dist.collective_device(torch.zeros(2, device="meta")) == torch.device("meta")
    monkeypatch.setattr(dist.dist, "get_backend", lambda group=None: "gloo")
    assert dist.collective_device(torch.zeros(2)) == torch.device("cpu")


@pytest.mark.parametrize("env,expected", [
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"LOCAL_SIZE": "8", "SLURM_NTASKS_PER_NODE": "1"}, 8),  # deepspeed's launcher inside srun
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 8),
    ({"MPI_LOCALNRANKS": "2"}, 2),
    ({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8),
    ({}, 1),  # no launcher variables, no GPU: the world size (1 without a process group)
])
def test_local_world_size_from_launcher_variables(monkeypatch, env, expected):
    from ds_ppo.engine import dist

    for var in dist._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert dist.local_world_size() == expected


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_minibatches_hold_the_same_samples_at_any_world_size(epoch):
    """Global sample g of the rollout sits on rank r at row i as the sampler lays it out (slot
    r*m + i % m of mini-batch i // m); every epoch's mini-batches must be the same sets of g."""
    M, n_mini = 8, 4  # global mini-batch size, mini-batches per rollout

    def composition(world):
        m = M // world
        minibatches = [set() for _ in range(n_mini)]
        for r in range(world):
            for j, rows in enumerate(minibatch_rows(n_mini * m, m, r, epoch, seed=3, iteration=5)):
                assert len(rows) == m
                minibatches[j] |= {(i // m) * M + r * m + i % m for i in rows}
        return minibatches

    one = composition(1)
    assert sorted(g for mb in one for g in mb) == list(range(M * n_mini))  # each sample once
    assert composition(2) == one and composition(4) == one and composition(8) == one
    as_sampled = [set(range(j * M, (j + 1) * M)) for j in range(n_mini)]
    assert (one == as_sampled) == (epoch == 0)  # later epochs re-mix the mini-batches
    for seed in (2**40, -5):  # any seed the config takes
        assert sorted(sum(minibatch_rows(n_mini * M, M, 0, epoch, seed, 5), [])) == \
            list(range(n_mini * M))
    other_epoch = minibatch_rows(n_mini * M, M, 0, epoch + 1, seed=3, iteration=5)
    assert [set(r) for r in other_epoch] != [set(r) for r in
                                              minibatch_rows(n_mini * M, M, 0, epoch, 3, 5)]


def test_divergence_check_losses_always_grad_norms_unless_fp16():
    from ds_ppo.errors import Diverged
    from ds_ppo.ppo.train_job import GRAD_NORMS, LOSSES, PPOJob
    from ds_ppo.run.driver import stop_if_diverged

    def _stop_if_diverged(metrics, iteration, last, grad_norms=True):
        watched = LOSSES + (GRAD_NORMS if grad_norms else ())
        stop_if_diverged(metrics, watched, f"iteration {iteration}", last, PPOJob.diverged_fix)

    healthy = {"loss/policy": 0.1, "loss/value": 0.2, "policy/grad_norm": 1.0,
               "value/explained_variance": math.nan}  # NaN there is normal
    _stop_if_diverged(healthy, 3, None)
    skipped_fp16_step = {**healthy, "policy/grad_norm": math.inf}
    _stop_if_diverged(skipped_fp16_step, 3, None, grad_norms=False)
    with pytest.raises(Diverged, match=r"iteration 3: policy/grad_norm = inf.*this iteration's "
                                       r"weights are not saved; the last "
                                       r"checkpoint, ck/iter_000002, was saved before it"):
        _stop_if_diverged(skipped_fp16_step, 3, "ck/iter_000002")
    with pytest.raises(Diverged, match=r"loss/value = nan.*no checkpoint was saved before it"):
        _stop_if_diverged({**healthy, "loss/value": math.nan}, 1, None, grad_norms=False)


def test_samples_table_rows_carry_the_reward_columns():
    from ds_ppo.ppo.iteration_report import sample_row as _sample_row

    assert _sample_row("p", "r", 1, {"answer": "4", "score": 3}) == {
        "prompt": "p", "response": "r", "score": 1.0, "answer": "4", "data/score": 3}


def test_trained_roles_load_without_dropout(tmp_path):
    """policy/value.disable_dropout (default true): every dropout probability of the config is 0
    before the model is built, so old and new log-probs come from the same network."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from ds_ppo.engine.roles import _model_config

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, resid_pdrop=0.1,
                               embd_pdrop=0.2, attn_pdrop=0.3)).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, attention_dropout=0.4).save_pretrained(tmp_path / "llama")
    cfg = _cfg()
    assert cfg.policy.disable_dropout and cfg.value.disable_dropout

    def dropouts(path, disable):
        config, _ = _model_config(str(path), disable)
        model = AutoModelForCausalLM.from_pretrained(path, config=config)
        return sorted({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)})

    assert dropouts(tmp_path / "gpt2", False) == [0.1, 0.2, 0.3]  # the checkpoint's own
    assert dropouts(tmp_path / "gpt2", True) == [0.0]
    assert _model_config(str(tmp_path / "llama"), False)[0].attention_dropout == 0.4
    assert _model_config(str(tmp_path / "llama"), True)[0].attention_dropout == 0.0
    assert _model_config(str(tmp_path / "llama"), True, num_labels=1)[0].num_labels == 1


def test_temperature_and_filters_in_sampling_and_scoring():
    """Generation samples from softmax(filter(logits / T)) and scoring's log-probs are those of
    the same distribution, top-k / top-p included (the rollout carries its LogitShape); the
    reference's (truncate=False) are of the tempered softmax without the filters."""
    from ds_ppo.algo import LogitShape, filter_logits
    from ds_ppo.engine.generation import _generate_kwargs

    model = small_llama()
    rollout = padded_rollout(PROMPTS[:1], RESPONSES[:1], P=3, T=4)
    ids = torch.tensor([PROMPTS[0] + RESPONSES[0]])
    labels = torch.tensor(RESPONSES[0])[:, None]
    with torch.no_grad():
        logits = model(ids).logits[0, 2:-1]  # (4, V): the positions predicting the response
        for temp, top_k, top_p in ((0.5, 0, 1.0), (1.0, 0, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0),
                                   (0.8, 0, 0.6), (1.3, 10, 0.9)):
            rollout.sampling = LogitShape(temperature=temp, top_k=top_k, top_p=top_p)
            kept = filter_logits(logits, temp, top_k, top_p)
            kept = kept.scatter(-1, labels, (logits / temp).gather(-1, labels))  # sampled: kept
            sampled = torch.log_softmax(kept, -1).gather(-1, labels)[:, 0]
            scored = response_logprobs(model, rollout, temp)[0][0]
            torch.testing.assert_close(scored, sampled, atol=1e-6, rtol=1e-6)
            full = torch.log_softmax(logits / temp, -1).gather(-1, labels)[:, 0]
            reference = response_logprobs(model, rollout, temp, truncate=False)[0][0]
            torch.testing.assert_close(reference, full, atol=1e-6, rtol=1e-6)
            if top_k or top_p < 1:
                assert (scored > reference + 1e-4).all()  # renormalised over fewer tokens
    assert _generate_kwargs(_cfg("generation.temperature=0.5").generation, [2], 0)["temperature"] \
        == 0.5  # HF generate
