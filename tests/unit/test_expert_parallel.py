"""Expert parallelism's config rules (deepspeed.<role>.expert_parallel_size, DeepSpeed AutoEP),
checked up front with the key and the fix; the DeepSpeed config it fills; and the
compatibility shim AutoEP needs with transformers' output-recorder registry. The multi-rank
behaviour is tests/dist/test_moe_dist.py's."""
from __future__ import annotations

import pytest
import torch

from ds_ppo.config import load_config, validate
from ds_ppo.errors import ConfigError

QWEN = ("policy.arch={model_type: qwen3_moe, hidden_size: 32, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, num_experts: 4, "
        "num_experts_per_tok: 2, moe_intermediate_size: 16, vocab_size: 64}")
LLAMA = ("policy.arch={model_type: llama, hidden_size: 32, num_hidden_layers: 2, "
         "num_attention_heads: 4, intermediate_size: 64, vocab_size: 64}")
BATCH = ["ppo.rollout_batch_size=8", "ppo.mini_batch_size=8", "ppo.micro_batch_size=1"]


def _problems(*overrides, world=4, arch=QWEN) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [arch, *BATCH, *overrides]), world)
    return str(e.value)


def test_expert_parallel_checks_name_the_key_and_the_fix():
    msg = _problems("deepspeed.policy.expert_parallel_size=2", world=3)
    assert "deepspeed.policy.expert_parallel_size = 2 must divide the world size 3" in msg
    msg = _problems("deepspeed.policy.expert_parallel_size=3", world=3)
    assert "must divide the policy model's 4 experts per layer; use one of [1, 2, 4]" in msg
    msg = _problems("deepspeed.policy.expert_parallel_size=2", arch=LLAMA)
    assert "the policy model is 'llama'; expert parallelism runs on qwen3_moe, mixtral" in msg
    msg = _problems("deepspeed.policy.expert_parallel_size=2", "policy.lora.r=8",
                    "deepspeed.value.expert_parallel_size=2", "value.lora.r=8")
    assert "does not combine with policy.lora" in msg and "with value.lora" in msg
    msg = _problems("deepspeed.policy.expert_parallel_size=2", "generation.mode=zero3",
                    "deepspeed.sequence_parallel_size=2")
    assert "with generation.mode = zero3" in msg and "with deepspeed.sequence_parallel_size" in msg
    msg = _problems("deepspeed.reference.expert_parallel_size=2")
    assert "deepspeed.reference.expert_parallel_size = 2: expert parallelism is for the " \
           "trained roles" in msg
    # the value model starts from the MoE policy: its experts count
    validate(load_config(None, [QWEN, *BATCH, "deepspeed.policy.expert_parallel_size=2",
                                "deepspeed.value.expert_parallel_size=4"]), 4)


def test_tensor_parallel_generation_of_an_moe_policy_is_checked_up_front():
    """generation.mode=tensor_parallel splits a MoE policy's experts over the group: refused at
    --dry-run in one line when tp_size does not divide them (or the heads); with expert
    parallelism and router replay it is accepted (its replica records the expert choices)."""
    msg = _problems("generation.mode=tensor_parallel", "generation.tp_size=4", world=4,
                    arch=QWEN.replace("num_experts: 4", "num_experts: 6"))
    assert ("generation.mode = 'tensor_parallel' with generation.tp_size = 4: num_experts=6 not "
            "divisible by tp_size=4; set generation.tp_size to a divisor") in msg
    assert len(msg.splitlines()) == 2  # the header and one line
    validate(load_config(None, [QWEN, *BATCH, "generation.mode=tensor_parallel",
                                "generation.tp_size=4", "ppo.router_replay=true",
                                "deepspeed.policy.expert_parallel_size=4"]), 4)
    msg = _problems("ppo.router_replay=true", "generation.mode=zero3")
    assert "generation.mode=gathered (or tensor_parallel)" in msg


def test_expert_parallel_fills_the_trained_roles_autoep_section():
    from ds_ppo.engine.ds_config import build_ds_config

    cfg = load_config(None, [QWEN, *BATCH, "deepspeed.policy.expert_parallel_size=2"])
    ds = build_ds_config(cfg, "policy", 4, torch.float32, 32)
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    assert "expert_parallel" not in build_ds_config(cfg, "value", 4, torch.float32, 32)


def test_autoep_compat_lets_deepspeed_read_the_registry_as_a_dict(monkeypatch):
    """DeepSpeed AutoEP reads transformers' output-recorder registry with a class name and a
    default (which transformers 5.25's lookup refuses); transformers' own lookup by model is
    unchanged."""
    from transformers.utils import output_capturing as oc

    from ds_ppo.engine import moe
    from ds_ppo.bench.stand_ins import small_moe

    monkeypatch.setattr(oc._CanRecordRegistry, "get", oc._CanRecordRegistry.get)
    registry, model = oc._CAN_RECORD_REGISTRY, small_moe()
    own = registry.get(model.model)
    moe.autoep_compat()
    moe.autoep_compat()  # applied once
    assert registry.get("no such class", "default") == "default"
    assert registry.get(model.model) == own


def test_an_expert_parallel_checkpoint_resumes_at_any_expert_parallel_size(tmp_path):
    """A checkpoint records its roles built with AutoEP's layers and their sizes: a resume
    builds those roles with AutoEP whatever its size (1 included: the checkpoint's parameter
    names are AutoEP's), through the universal checkpoint where a size changed or a role saved
    without expert parallelism runs with it."""
    import json

    from ds_ppo.engine.checkpoint import expert_parallel_resume
    from ds_ppo.engine.ds_config import build_ds_config

    def saved(ep: dict):
        (tmp_path / "trainer_state.json").write_text(json.dumps(
            {"world_size": 2, "expert_parallel": ep}))
        return tmp_path

    assert expert_parallel_resume(saved({}), {}) == (frozenset(), False)
    assert expert_parallel_resume(saved({"policy": 2}), {"policy": 2}) == ({"policy"}, False)
    assert expert_parallel_resume(saved({"policy": 2, "value": 2}), {}) == (
        {"policy", "value"}, True)
    assert expert_parallel_resume(saved({"policy": 1}), {"policy": 4}) == ({"policy"}, True)
    assert expert_parallel_resume(saved({"policy": 1}), {}) == ({"policy"}, False)
    # saved without expert parallelism: through the universal copy under AutoEP's names
    assert expert_parallel_resume(saved({"policy": 2}), {"policy": 2, "value": 2}) == (
        {"policy", "value"}, True)
    assert expert_parallel_resume(saved({}), {"policy": 2}) == ({"policy"}, True)
    cfg = load_config(None, [QWEN, *BATCH])  # expert_parallel_size 1
    from ds_ppo.config.model_checks import expert_parallel_problems

    sp = load_config(None, [QWEN, *BATCH, "deepspeed.sequence_parallel_size=2"])
    assert expert_parallel_problems(sp, 4) == []
    assert expert_parallel_problems(sp, 4, frozenset({"policy"})) == [
        "the policy resumed from an expert-parallel checkpoint (AutoEP's layers, N = 1) does "
        "not combine with deepspeed.sequence_parallel_size > 1: drop one (expert parallelism: "
        "start a new run from the checkpoint's export, its hf directory)"]
    assert "expert_parallel" not in build_ds_config(cfg, "policy", 1, torch.float32, 32)
    assert build_ds_config(cfg, "policy", 1, torch.float32, 32, True, autoep=True)[
        "expert_parallel"] == {"enabled": True, "autoep_size": 1}


def test_generation_without_a_replica_is_refused_for_an_expert_parallel_policy(monkeypatch):
    """generation.mode auto falls back to generating through the ZeRO-3 hooks when no replica
    fits; an expert-parallel policy (AutoEP layers) stops there with the levers instead."""
    from ds_ppo.config import GenerationConfig
    from ds_ppo.engine import generation
    from ds_ppo.bench.stand_ins import small_moe

    model, cfg = small_moe(), GenerationConfig(mode="auto")
    monkeypatch.setattr(generation, "_least_free_bytes", lambda device: 1.0)
    assert generation.choose_mode(cfg, model, torch.float32, torch.device("cpu")) == "zero3"
    monkeypatch.setattr(generation, "ep_layers", lambda m: {"model.layers.0.mlp": m})
    with pytest.raises(ConfigError, match="chose zero3 .* does not combine with an "
                       "expert-parallel policy .*deepspeed.policy.expert_parallel_size > 1, "
                       "or a resumed checkpoint saved with it"):
        generation.choose_mode(cfg, model, torch.float32, torch.device("cpu"))


def test_an_expert_parallel_checkpoint_without_hf_weights_is_not_exported(tmp_path):
    """An offline export of a role that ran expert parallelism needs the checkpoint's
    Hugging Face copy: DeepSpeed's shards hold AutoEP's layers, which ZeRO consolidation does
    not turn back into the model's layout. Checked before any weight is read."""
    import json

    from ds_ppo.engine.checkpoint.hf_export import source_problem
    from ds_ppo.engine.checkpoint.files import TAG

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "policy" / TAG).mkdir(parents=True)
    (tmp_path / "policy" / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "trainer_state.json").write_text(json.dumps({"expert_parallel": {}}))
    assert source_problem(tmp_path, False, {}, False) is None
    (tmp_path / "trainer_state.json").write_text(json.dumps({"expert_parallel": {"policy": 2}}))
    where, what = source_problem(tmp_path, False, {}, False)
    assert where == tmp_path / "hf" and "ran expert parallelism" in what
    assert "checkpoint.save_hf_weights=true" in what


def test_a_hugging_face_moe_block_maps_to_autoep_names_and_layout():
    """A universal checkpoint's flat Hugging Face tensors under AutoEP's names, the inverse of
    `ep_weights` (which concatenates w1 and w3 into gate_up_proj): the router's weight renamed,
    the fused gate_up_proj (E, 2F, H) split into its gate rows (w1) and up rows (w3),
    down_proj (E, H, F) as w2; a `gate.weight` beside no experts and the other parameters keep
    their names."""
    from ds_ppo.engine.moe import autoep_tensors

    E, F, H = 2, 3, 4
    shapes = {"m.l.mlp.gate.weight": (E, H), "m.l.mlp.experts.gate_up_proj": (E, 2 * F, H),
              "m.l.mlp.experts.down_proj": (E, H, F), "m.d.mlp.gate.weight": (8, H)}
    gate_up = torch.arange(E * 2 * F * H, dtype=torch.float32)
    (w1, a), (w3, b) = autoep_tensors("m.l.mlp.experts.gate_up_proj", gate_up, shapes)
    assert (w1, w3) == ("m.l.mlp.experts.w1", "m.l.mlp.experts.w3")
    assert a.shape == b.shape == (E, F, H)
    assert a[1, 0, 0] == 2 * F * H and b[0, 0, 0] == F * H  # expert 1's gate row, expert 0's up
    assert torch.equal(torch.cat([a, b], dim=1).reshape(-1), gate_up)
    [(w2, c)] = autoep_tensors("m.l.mlp.experts.down_proj", torch.ones(E * H * F), shapes)
    assert w2 == "m.l.mlp.experts.w2" and c.shape == (E, H, F)
    router = torch.ones(E * H)
    assert autoep_tensors("m.l.mlp.gate.weight", router, shapes) == [
        ("m.l.mlp.router.gate.weight", router)]
    assert autoep_tensors("m.d.mlp.gate.weight", torch.ones(8 * H), shapes) is None
    assert autoep_tensors("m.l.self_attn.q_proj.weight", torch.ones(4), shapes) is None
