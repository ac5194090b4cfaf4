"""Long context in the config checks, `ds-ppo plan` and the long-context presets: the
sequence-parallel size is checked up front (world size, heads, attention kernel), the plan
counts tiled logits and per-rank shards of a row, and the 8b-long / 70b-long presets fit."""
from __future__ import annotations

import pytest

from ds_ppo import plan as P
from ds_ppo.config import config_warnings, load_config, validate
from ds_ppo.errors import ConfigError

GiB = 2**30
ARCH = ("policy.arch={model_type: llama, hidden_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 8, num_key_value_heads: 2, intermediate_size: 128, "
        "vocab_size: 32000}")


def _problems(*overrides, world=4) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [ARCH, *overrides]), world)
    return str(e.value)


def test_sequence_parallel_checks_name_the_key_and_the_fix():
    msg = _problems("deepspeed.sequence_parallel_size=3", world=4)
    assert "deepspeed.sequence_parallel_size = 3 must divide the world size 4" in msg
    assert "8 attention heads, not divisible by 3" in msg
    msg = _problems("deepspeed.sequence_parallel_size=4",
                    "policy.attn_implementation=eager",
                    'policy.arch.num_key_value_heads=3', world=4)
    assert "3 KV heads" in msg and "eager" in msg
    # 2 KV heads on 4 ranks: replicated, fine; the batch rules see 2 data-parallel ranks
    cfg = load_config(None, [ARCH, "deepspeed.sequence_parallel_size=4",
                             "ppo.rollout_batch_size=2", "ppo.mini_batch_size=2",
                             "ppo.micro_batch_size=1"])
    validate(cfg, 8)  # 8 ranks / SP 4 = 2 data-parallel ranks of 1 prompt each
    with pytest.raises(ConfigError, match="data-parallel world size 8"):
        validate(cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(
            update={"sequence_parallel_size": 1})}), 8)
    # training runs it (tests/dist/test_engine.py): no warning that it would not
    assert not any("sequence_parallel" in w for w in config_warnings(cfg, 8))


def _phase(plan, name):
    return next(p for p in plan.phases if p.name == name).transient


def test_plan_tiles_logits_and_shards_long_rows():
    long = [ARCH, "generation.max_new_tokens=32704", "data.max_prompt_len=64",
            "ppo.micro_batch_size=1", "ppo.score_micro_batch_size=1",
            "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8"]
    cluster = P.Cluster(1, 8, 80 * GiB)
    untiled = P.plan(load_config(None, [*long, "ppo.tiled_logits=false"]), cluster)
    tiled = P.plan(load_config(None, long), cluster)  # auto: 32767 x 32000 > 2^26
    assert _phase(untiled, "training: policy")["logits"] == 32768 * 32000 * 6
    assert _phase(tiled, "training: policy")["logits (tiled, 1024 positions)"] == \
        1024 * 32000 * 10
    sp = P.plan(load_config(None, [*long, "deepspeed.sequence_parallel_size=4"]), cluster)
    whole = _phase(tiled, "training: policy")["activations"]
    quarter = _phase(sp, "training: policy")["activations"]
    assert quarter == pytest.approx(whole / 4, rel=1e-3)
    assert any("split over 4 ranks (8192 tokens each" in n for n in sp.notes)
    short = P.plan(load_config(None, [*long, "deepspeed.sequence_parallel_size=4",
                                      "deepspeed.sequence_parallel_min_tokens=40000"]), cluster)
    assert _phase(short, "training: policy")["activations"] == whole


@pytest.mark.parametrize("name,nodes,world", [("8b-long", 1, 8), ("70b-long", 8, 64)])
def test_long_context_presets_validate_and_fit(name, nodes, world):
    cfg = load_config(name)
    validate(cfg, world)
    assert cfg.generation.max_new_tokens == 32768
    plan = P.plan(cfg, P.Cluster(nodes, 8, 80 * GiB))
    assert plan.fits, (plan.peak_phase, plan.peak_gpu_bytes / GiB)
    assert not [n for n in plan.notes if "does not validate" in n]
    assert all("logits (tiled" in " ".join(p.transient) for p in plan.phases
               if p.name in ("training: policy", "scoring: policy"))


def test_untiled_logits_that_do_not_fit_name_the_tiling_lever():
    """8b-long untiled: 60.9 GiB per GPU, of which 24.2 GiB logits; tiled 37.9 GiB. On 40 GiB
    GPUs tiling is the biggest lever (offloading the optimizer saves 15 GiB) and fits."""
    plan = P.plan(load_config("8b-long", ["ppo.tiled_logits=false"]), P.Cluster(1, 8, 40 * GiB))
    assert not plan.fits
    assert plan.biggest_lever.lever.overrides == ("ppo.tiled_logits=auto",)
    assert plan.biggest_lever.fits_after


def test_discounted_returns_of_long_responses_scan_in_blocks():
    """reinforce_pp's returns above returns.BLOCKED_ABOVE tokens: the blocked scan (no (T, T)
    float64 matrix: 8 GiB at T = 32768, found by measure_long_context.py at 16k tokens) gives
    the literal recursion's values."""
    import torch

    from ds_ppo.algo import discounted_returns
    from ds_ppo.algo.returns import BLOCKED_ABOVE
    from support.big_tensors import LargestTensor

    T = BLOCKED_ABOVE + 300
    lengths = [T, 700, 0]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    rewards = torch.randn(3, T, generator=torch.Generator().manual_seed(0)) * 0.1
    want = torch.zeros(3, T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            running = float(rewards[b, t]) + 0.999 * running
            want[b, t] = running
    with LargestTensor() as seen:
        got = discounted_returns(rewards, mask, 0.999)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert seen.numel < T * T // 4
