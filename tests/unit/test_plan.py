"""`ds-ppo plan`, the presets and the DeepSpeed templates.

The model-state numbers are checked against DeepSpeed's own estimators, the activation and
KV-cache formulas against hand-worked values, and the verdicts against the 70B preset on the
cluster it is laid out for and on one it does not fit.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ds_ppo import plan as P
from ds_ppo.config import load_config, validate
from ds_ppo.engine.ds_templates import auto_keys, default_template, load_template, templates_dir
from ds_ppo.errors import ConfigError
from ds_ppo.engine.generation.choice import unshardable

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
SMALL_ARCH = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 1000}


def small_config(tmp_path: Path, **sections) -> Path:
    data = {"policy": {"arch": SMALL_ARCH}, "reward": {"function": "ds_ppo.rewards:positive_words"},
            "ppo": {"rollout_batch_size": 8, "mini_batch_size": 4, "micro_batch_size": 2},
            "data": {"max_prompt_len": 32}, "generation": {"max_new_tokens": 16},
            # fixed stages: these tests read the other terms on clusters of any memory
            "deepspeed": {role: {"zero_stage": 3} for role in ("policy", "value", "reference",
                                                               "reward")}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def plan_args(config, nodes=1, gpus=1, gpu_mem=80.0, cpu_mem=None, as_json=False, overrides=()):
    return argparse.Namespace(config=str(config), nodes=nodes, gpus_per_node=gpus,
                              gpu_mem_gib=gpu_mem, cpu_mem_gib=cpu_mem, json=as_json,
                              overrides=list(overrides))


@pytest.fixture(scope="module")
def plan_70b_8x8():
    return P.plan(load_config("70b"), P.Cluster(8, 8, 80 * GiB))


# ------------------------------------------------------------------ DeepSpeed's formulas
@pytest.mark.parametrize("offload_optimizer,offload_param", [(False, False), (True, False),
                                                             (True, True)])
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_states_equal_deepspeed_estimator(offload_optimizer, offload_param, zero_init):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cases = [(70_553_706_496, 1_050_673_152, 8, 8), (8_030_261_248, 525_336_576, 8, 1),
             (1_235_814_400, 262_668_288, 1, 1), (123_456_789, 9_876_543, 4, 3)]
    for params, largest, gpus, nodes in cases:
        ours = P.zero3_train_states(params, largest, gpus, nodes, offload_optimizer, offload_param,
                                    zero_init=zero_init)
        cpu, gpu, largest_mem = estimate_zero3_model_states_mem_needs(
            params, largest, num_gpus_per_node=gpus, num_nodes=nodes,
            cpu_offload=offload_optimizer, cpu_offload_params=offload_param, zero_init=zero_init,
            additional_buffer_factor=1.5)
        assert (ours.cpu_bytes_per_node, ours.gpu_bytes_per_rank, ours.gather_bytes) == \
            (cpu, gpu, largest_mem)


@pytest.mark.parametrize("offload", [False, True])
def test_zero2_states_equal_deepspeed_estimator(offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for params, gpus, nodes in [(8_030_261_248, 8, 1), (1_235_814_400, 1, 1), (7_000_000, 4, 2)]:
        ours = P.train_states(params, 0, gpus, nodes, 2, offload, False)
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
        assert (ours.cpu_bytes_per_node, ours.gpu_bytes_per_rank) == (cpu, gpu)


def test_preset_70b_trained_roles_match_deepspeed(plan_70b_8x8):
    """The per-rank numbers the plan reports for the 70B run are DeepSpeed's."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cfg = load_config("70b")
    for role in ("policy", "value"):
        rp, d = plan_70b_8x8.roles[role], getattr(cfg.deepspeed, role)
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            rp.shape.params, rp.shape.largest_layer_params, 8, 8,
            cpu_offload=d.offload_optimizer, cpu_offload_params=d.offload_param)
        assert rp.states.gpu_bytes_per_rank == gpu
        assert rp.states.cpu_bytes_per_node == cpu


def test_meta_counts_equal_deepspeed_count_of_a_real_model():
    """Counting on the meta device gives what DeepSpeed's model_to_params gives on real weights
    (tied embeddings counted once)."""
    import torch
    from deepspeed.runtime.zero.stage3 import model_to_params
    from transformers import AutoConfig, AutoModelForCausalLM

    for tied in (False, True):
        arch = {**SMALL_ARCH, "tie_word_embeddings": tied}
        hf = AutoConfig.for_model(**arch)
        shape = P.model_shape(hf, "causal", "arch")
        torch.manual_seed(0)
        real = AutoModelForCausalLM.from_config(hf)
        assert (shape.params, shape.largest_layer_params) == model_to_params(real)


def test_llama3_70b_shape():
    hf = P._hf_config(None, load_config("70b").policy.arch)
    shape = P.model_shape(hf, "causal", "arch")
    assert shape.params == 70_553_706_496  # Meta-Llama-3-70B
    assert shape.largest_layer_params == 128256 * 8192  # the embedding (= lm_head)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (80, 8, 128)


# --------------------------------------------------------------------- hand-worked terms
def _shape(**kw):
    base = dict(model_class="X", params=0, largest_layer_params=0, hidden=8192, layers=80,
                heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256, source="")
    return P.ModelShape(**{**base, **kw})


def test_kv_cache_hand_worked():
    # 2 (K, V) * 80 layers * 8 kv heads * 128 * 2 bytes = 327,680 bytes per token
    assert P.kv_cache_bytes(_shape(), tokens=1536, batch=8) == 327_680 * 1536 * 8


def test_activation_formulas_hand_worked():
    s, b, h, kv, i = 10, 3, 8, 4, 20
    shape = _shape(hidden=h, heads=2, kv_heads=2, head_dim=2, intermediate=i, layers=5, vocab=7)
    layer = s * b * (16 * h + 4 * kv + 8 * i)  # = 30 * 304
    assert P.layer_activation_bytes(shape, s, b, eager=False) == layer == 9120
    assert P.layer_activation_bytes(shape, s, b, eager=True) == layer + 4 * 2 * s * s * b
    assert P.train_activation_bytes(shape, s, b, False, False) == 5 * layer
    assert P.train_activation_bytes(shape, s, b, True, False) == 5 * 2 * s * b * h + layer
    assert P.logits_bytes(shape, s, b) == b * s * 7 * 6


def test_prefill_activations_hand_worked():
    """One layer's working set of a no-grad prefill, not the training layer's saved tensors."""
    s, b, h, kv, i = 10, 3, 8, 4, 20
    shape = _shape(hidden=h, heads=2, kv_heads=2, head_dim=2, intermediate=i, layers=5, vocab=7)
    # per token: max(norm 10h = 80, attention 6h + (6h + 6kv) = 120, MLP 4h + 6i = 152)
    assert P.prefill_activation_bytes(shape, s, b, eager=False) == s * b * 152
    # tp 2: max(80, 48 + 72 // 2 = 84, 32 + 120 // 2 = 92)
    assert P.prefill_activation_bytes(shape, s, b, eager=False, tp=2) == s * b * 92
    assert (P.prefill_activation_bytes(shape, s, b, eager=True, tp=2)
            == s * b * 92 + 4 * 1 * s * s * b)
    # Llama-3-70B, 16 prompts of 1024 tokens over 8 GPUs: the fp32 RMSNorm (10h per token)
    # dominates, 1.25 GiB where the training layer formula says 5.56
    big = _shape()
    assert P.prefill_activation_bytes(big, 1024, 16, False, tp=8) == 1024 * 16 * 10 * 8192
    assert P.layer_activation_bytes(big, 1024, 16, False) > 5.5 * GiB


def test_inference_states():
    st = P.inference_states(1000, 100, 8, 2, 3, offload_param=True)
    assert (st.gpu_bytes_per_rank, st.resident_bytes, st.cpu_bytes_per_node) == (200, 0, 1500)
    st = P.inference_states(1600, 100, 8, 2, 3, offload_param=False)
    assert (st.gpu_bytes_per_rank, st.resident_bytes) == (200 + 200, 200)
    assert P.inference_states(1000, 100, 8, 2, 0, False).gpu_bytes_per_rank == 2000


# ------------------------------------------------------------------------------- verdicts
def test_70b_fits_on_8_nodes(plan_70b_8x8):
    p = plan_70b_8x8
    assert p.cluster.world_size == 64
    assert p.fits and p.peak_gpu_bytes <= 80 * GiB
    # a 141 GB replica cannot fit one GPU: the preset splits it over the 8 GPUs of a node
    assert p.generation_mode == "tensor_parallel"
    gen = p.phases[0]
    shard = next(v for k, v in gen.transient.items() if k.startswith("16-bit policy replica"))
    assert shard == 2 * P.tp_shard_params(p.roles["policy"].shape, 8)
    assert 19 * GiB < shard < 21 * GiB  # SCALING.md: 19.9 GiB
    assert p.peak_gpu_bytes == max(ph.total(p.resident_bytes) for ph in p.phases)
    assert p.biggest_lever is None


def test_70b_generation_batch_is_sized_by_the_plan(plan_70b_8x8):
    """The preset's generation.batch_size is the largest power of two whose plan fits."""
    cfg = load_config("70b")
    batch = cfg.generation.batch_size
    gen = plan_70b_8x8.phases[0]
    assert gen.transient["prefill activations (one layer)"] == P.prefill_activation_bytes(
        plan_70b_8x8.roles["policy"].shape, 1024, batch, False, tp=8)
    assert batch >= 64 and plan_70b_8x8.fits
    doubled = P.plan(load_config("70b", [f"generation.batch_size={2 * batch}"]),
                     P.Cluster(8, 8, 80 * GiB))
    assert not doubled.fits and doubled.peak_phase.startswith("generation")


def test_scale_out_advice_respects_batch_divisibility():
    """Memory alone fits 7 nodes of 8 GPUs, but 1024 prompts do not split over 56 ranks: the
    advice is the next node count whose world size the batch sizes divide."""
    cfg = load_config("70b")
    assert P.compute_plan(cfg, P.resolve_shapes(cfg), P.Cluster(7, 8, 80 * GiB)).fits
    with pytest.raises(ConfigError):
        validate(cfg, 7 * 8)
    p = P.plan(cfg, P.Cluster(1, 8, 80 * GiB))
    assert p.min_nodes == 8
    validate(cfg, p.min_nodes * 8)


def test_70b_does_not_fit_on_one_node_and_names_a_lever(capsys):
    assert P.main(plan_args("70b", nodes=1, gpus=8)) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "Biggest lever: offload the" in out
    assert "deepspeed.policy.offload_optimizer=true" in out
    p = P.plan(load_config("70b"), P.Cluster(1, 8, 80 * GiB))
    assert not p.fits and p.min_nodes is not None and 1 < p.min_nodes <= 8
    assert p.biggest_lever.saves_bytes > 100 * GiB
    # the greedy path ends in a config that fits on the GPUs
    assert p.lever_path[-1].fits_after


def test_lever_overrides_are_valid_and_make_it_fit():
    p = P.plan(load_config("70b"), P.Cluster(1, 8, 80 * GiB))
    overrides = [o for e in p.lever_path for o in e.lever.overrides]
    fixed = P.plan(load_config("70b", overrides), P.Cluster(1, 8, 80 * GiB))
    assert fixed.fits


def test_cpu_budget_counts(plan_70b_8x8):
    tight = P.plan(load_config("70b"), P.Cluster(8, 8, 80 * GiB, cpu_mem_bytes=10 * GiB))
    assert tight.fits_gpu and tight.fits_cpu is False and not tight.fits
    assert plan_70b_8x8.fits_cpu is None  # unchecked without --cpu-mem-gib


def test_checkpointing_and_generation_mode_move_the_peak(tmp_path):
    cfg_path = small_config(tmp_path)
    base = P.plan(load_config(cfg_path), P.Cluster(1, 1, 80 * GiB))
    ckpt = P.plan(load_config(cfg_path, ["policy.gradient_checkpointing=true"]),
                  P.Cluster(1, 1, 80 * GiB))
    act = lambda p: next(v for ph in p.phases if ph.name == "training: policy"  # noqa: E731
                         for k, v in ph.transient.items() if k.startswith("activations"))
    assert act(ckpt) < act(base)
    one_gpu = P.Cluster(1, 1, 80 * GiB)
    gathered = P.plan(load_config(cfg_path, ["generation.mode=gathered"]), one_gpu)
    zero3 = P.plan(load_config(cfg_path, ["generation.mode=zero3"]), one_gpu)
    assert gathered.generation_mode == "gathered" and zero3.generation_mode == "zero3"
    gen = lambda p: p.phases[0].total(p.resident_bytes)  # noqa: E731
    replica = 2 * gathered.roles["policy"].shape.params
    assert gen(gathered) - gen(zero3) == replica


def test_packed_micro_batches_are_planned_by_their_token_budget(tmp_path, capsys):
    """ppo.micro_batch_tokens: the policy/reference/value forwards of scoring and training hold
    one sequence of max(budget, longest row) tokens, not micro_batch_size rows; the lever halves the budget (never below the longest row)."""
    cfg_path = small_config(tmp_path)  # rows of 32 + 16 = 48 tokens, micro-batches of 2 rows
    gpu = P.Cluster(1, 1, 80 * GiB)
    rows = P.plan(load_config(cfg_path), gpu)
    packed = P.plan(load_config(cfg_path, ["ppo.micro_batch_tokens=200"]), gpu)
    shape = rows.roles["policy"].shape

    def transient(p, phase, prefix):
        return next(v for ph in p.phases if ph.name == phase
                    for k, v in ph.transient.items() if k.startswith(prefix))

    assert transient(packed, "training: policy", "activations") == \
        P.train_activation_bytes(shape, 200, 1, False, False)
    assert transient(rows, "training: policy", "activations") == \
        P.train_activation_bytes(shape, 48, 2, False, False)
    assert transient(packed, "scoring: policy", "logits") == P.logits_bytes(shape, 200, 1)
    # a budget below the longest row: each row runs alone, as one 48-token sequence
    small = P.plan(load_config(cfg_path, ["ppo.micro_batch_tokens=10"]), gpu)
    assert transient(small, "training: value", "activations") == \
        P.train_activation_bytes(small.roles["value"].shape, 48, 1, False, False)
    levers = [o for lv in P.candidate_levers(load_config(cfg_path, ["ppo.micro_batch_tokens=200"]),
                                       packed) for o in lv.overrides]
    assert "ppo.micro_batch_tokens=100" in levers
    assert not any(o.startswith("ppo.micro_batch_size") for o in levers)
    assert "packed micro-batches of 200 tokens" in P.format_plan(packed, "t")
    assert P.to_json(packed)["batch_per_rank"]["micro_batch_tokens"] == 200


def test_tensor_parallel_shard_by_hand_and_auto_order(tmp_path):
    cfg_path = small_config(tmp_path)
    shape = P.plan(load_config(cfg_path), P.Cluster(1, 2, 80 * GiB)).roles["policy"].shape
    # SMALL_ARCH per layer: q 64x64, k and v 64x32, o 64x64 (attention: 64*16*(2*4+2*2)
    # = 12,288), gate/up/down 3x64x128 = 24,576; 2 layers = 73,728 split parameters
    assert shape.params - P.tp_shard_params(shape, 2) == 73_728 // 2
    hf = P._hf_config(None, SMALL_ARCH)
    assert unshardable(hf, 2) is None and "tp_size=8" in unshardable(hf, 8)  # 4 heads
    replica, shard = 2 * shape.params, 2 * P.tp_shard_params(shape, 2)

    def mode_at(gpu_bytes, gpus=2, *extra):
        cfg = load_config(cfg_path, ["generation.mode=auto", *extra])
        base = P.plan(cfg, P.Cluster(1, gpus, 80 * GiB))
        # free memory for the replica = gpu - resident - overhead; fraction 0.5
        gpu = base.resident_bytes + P.RUNTIME_OVERHEAD_BYTES + 2 * gpu_bytes
        return P.plan(cfg, P.Cluster(1, gpus, gpu)).generation_mode

    assert mode_at(replica) == "gathered"
    assert mode_at((replica + shard) // 2) == "tensor_parallel"
    assert mode_at((replica + shard) // 2, 1) == "zero3"  # one GPU: nothing to split over
    assert mode_at(shard - 1) == "zero3"


@pytest.mark.parametrize("model_type,splits", [("llama", True), ("phi3", False)])
def test_plan_and_engine_choose_the_same_generation(tmp_path, monkeypatch, model_type, splits):
    """`ds-ppo plan` and the engine resolve generation.mode by one function. phi3 divides as
    SMALL_ARCH does (4 heads, 2 KV heads, width 128 over 2 GPUs) but tensor_parallel refuses it
    (fused qkv_proj / gate_up_proj, not a checked family): the plan neither picks tensor_parallel
    where the engine picks zero3, nor offers it as a lever, nor plans it when it is asked for."""
    import torch
    from transformers import AutoModelForCausalLM

    from ds_ppo.engine import generation

    arch = {**SMALL_ARCH, "model_type": model_type, "pad_token_id": 0}
    cfg_path = small_config(tmp_path, policy={"arch": arch})
    cfg = load_config(cfg_path, ["generation.mode=auto"])
    shape = P.plan(cfg, P.Cluster(1, 2, 80 * GiB)).roles["policy"].shape
    replica, shard = 2 * shape.params, 2 * P.tp_shard_params(shape, 2)
    free = replica + shard  # x fraction 0.5: the shard fits, the whole replica does not
    base = P.plan(cfg, P.Cluster(1, 2, 80 * GiB))
    cluster = P.Cluster(1, 2, base.resident_bytes + P.RUNTIME_OVERHEAD_BYTES + free)
    planned = P.plan(cfg, cluster)

    model = AutoModelForCausalLM.from_config(P._hf_config(None, arch))  # the plan's HF config
    monkeypatch.setattr(generation.dist, "local_world_size", lambda: 2)
    monkeypatch.setattr(generation, "_least_free_bytes", lambda device: float(free))

    def engine_mode(c):
        return generation.choose_mode(c.generation, model, torch.bfloat16, torch.device("cpu"))

    assert generation._param_bytes(model, torch.bfloat16) == replica  # same memory, both sides
    mode = engine_mode(cfg)
    assert planned.generation_mode == mode == ("tensor_parallel" if splits else "zero3")
    assert planned.generation_loop == generation.choose_loop(cfg.generation, mode, model.config)
    gathered = load_config(cfg_path, ["generation.mode=gathered"])
    tight = P.plan(gathered, P.Cluster(1, 2, int(0.001 * GiB)))
    levers = [o for lever in P.candidate_levers(gathered, tight) for o in lever.overrides]
    assert ("generation.mode=tensor_parallel" in levers) == splits
    assert any("tensor_parallel (tp_size 2) is no option" in n for n in tight.notes) != splits
    asked = load_config(cfg_path, ["generation.mode=tensor_parallel"])
    if splits:
        assert P.plan(asked, cluster).generation_mode == engine_mode(asked) == "tensor_parallel"
    else:
        with pytest.raises(ConfigError, match="model_type 'phi3'") as refused:
            engine_mode(asked)
        with pytest.raises(ConfigError) as planned_refusal:
            P.plan(asked, cluster)
        assert str(planned_refusal.value) == str(refused.value)


def test_tiny_gpu_names_a_lever_from_the_config(tmp_path):
    """On a GPU too small for the replica, auto picks zero3; when nothing fits the verdict names
    the lever that saves most."""
    cfg = load_config(small_config(tmp_path))
    p = P.plan(cfg, P.Cluster(1, 1, int(0.001 * GiB)))
    assert not p.fits
    assert p.biggest_lever is not None and p.biggest_lever.saves_bytes > 0
    assert P._with_overrides(cfg, p.biggest_lever.lever.overrides) is not None


# ---------------------------------------------------------------------- shapes from disk
def test_plan_reads_config_json_from_path_without_weights(tmp_path, capsys):
    from transformers import AutoConfig

    policy_dir, reward_dir = tmp_path / "policy", tmp_path / "reward"
    AutoConfig.for_model(**SMALL_ARCH).save_pretrained(policy_dir)
    AutoConfig.for_model(**{**SMALL_ARCH, "hidden_size": 32}).save_pretrained(reward_dir)
    assert sorted(p.name for p in policy_dir.iterdir()) == ["config.json"]
    cfg_path = small_config(tmp_path, policy={"path": str(policy_dir), "arch": None},
                            reward={"function": None, "model": str(reward_dir)})
    assert P.main(plan_args(cfg_path, as_json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    roles = out["roles"]
    assert roles["policy"]["shape_source"] == f"path {policy_dir}"
    assert roles["reward"]["shape_source"] == f"path {reward_dir}"
    assert roles["value"]["shape_source"] == f"path {reward_dir}"  # value starts from the reward
    assert roles["reward"]["params"] < roles["policy"]["params"]
    assert not out["notes"] or all("assuming" not in n for n in out["notes"])


def test_unreadable_reward_model_assumes_policy_shape(tmp_path):
    cfg = load_config(small_config(tmp_path, reward={"function": None,
                                                     "model": str(tmp_path / "nowhere")}))
    shapes = P.resolve_shapes(cfg)
    assert shapes.shapes["reward"].hidden == SMALL_ARCH["hidden_size"]
    assert any("assuming the policy's shape" in n for n in shapes.notes)


def test_unreadable_policy_is_a_user_error(tmp_path):
    cfg = load_config(small_config(tmp_path, policy={"arch": None,
                                                     "path": str(tmp_path / "nowhere")}))
    with pytest.raises(ConfigError, match="policy.arch"):
        P.resolve_shapes(cfg)


def test_cli_json_object_and_no_deepspeed_import(tmp_path):
    """`ds-ppo plan --json` prints one object with the promised keys, and plan never imports
    deepspeed."""
    cfg_path = small_config(tmp_path)
    code = ("import json, sys\nfrom ds_ppo.cli import main\n"
            f"rc = main(['plan', '--config', {str(cfg_path)!r}, '--nodes', '2', "
            "'--gpus-per-node', '4', '--gpu-mem-gib', '24', '--json'])\n"
            "assert 'deepspeed' not in sys.modules, 'plan imported deepspeed'\nsys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["world_size"] == 8 and isinstance(out["fits"], bool)
    assert isinstance(out["peak_gpu_bytes"], int)
    assert set(out["roles"]) == {"policy", "value", "reference", "reward"}
    for role in out["roles"].values():
        for key in ("params", "gpu_bytes_per_rank", "cpu_bytes_per_node"):
            assert isinstance(role[key], int)
    assert out["roles"]["reward"]["params"] == 0  # a reward function has no model


# ------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name,world_size", [("1b", 1), ("8b", 8), ("70b", 64),
                                             ("70b-lora", 8)])
def test_presets_validate_for_their_world_size(name, world_size):
    cfg = load_config(name)
    validate(cfg, world_size)
    assert cfg.policy.arch is not None and cfg.reward.model is not None
    assert "replace arch with path" in (REPO / "ds_ppo" / "presets" / f"{name}.yaml").read_text()


@pytest.mark.parametrize("name,nodes,gpus", [("1b", 1, 1), ("8b", 1, 8)])
def test_smaller_presets_fit_their_cluster(name, nodes, gpus):
    assert P.plan(load_config(name), P.Cluster(nodes, gpus, 80 * GiB)).fits


def test_launch_preset_links_point_at_presets():
    for name in ("1b", "8b", "70b", "70b-lora"):
        link = REPO / "launch" / f"{name}.yaml"
        assert link.resolve() == (REPO / "ds_ppo" / "presets" / f"{name}.yaml").resolve()


# ---------------------------------------------------------------------------- templates
BATCH_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "gradient_clipping", "bf16.enabled", "fp16.enabled"}


def test_templates_dir_is_the_repo_ds_configs():
    assert templates_dir() == REPO / "ds_configs"


def test_default_template_choice():
    name = lambda *a: default_template(*a).name  # noqa: E731
    assert name("policy", 3, False, False) == "zero3_train.json"
    assert name("value", 3, True, False) == "zero3_train_offload_optimizer.json"
    assert name("policy", 3, True, True) == "zero3_train_offload_all.json"
    assert name("policy", 2, False, False) == "zero2_train.json"
    assert name("reference", 3, False, True) == "zero3_inference_offload_param.json"
    assert name("reward", 3, False, False) == "zero3_inference.json"
    assert name("reward", 2, True, False) == "zero0_inference.json"
    with pytest.raises(ConfigError, match="zero_stage"):
        default_template("policy", 1, True, False)
    with pytest.raises(ConfigError, match="offload_param needs zero_stage 3"):
        default_template("reference", 2, False, True)


def _fill(ds: dict) -> dict:
    ds = json.loads(json.dumps(ds))
    ds.update(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
              gradient_clipping=1.0, bf16={"enabled": True}, fp16={"enabled": False})
    zero = ds["zero_optimization"]
    for key in [k for k, v in zero.items() if v == "auto"]:
        zero[key] = 1_000_000
    return ds


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_template_contents_and_deepspeed_accepts_them(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = load_template(path)
    assert BATCH_KEYS <= set(auto_keys(ds))
    assert "optimizer" not in ds and "scheduler" not in ds  # the engine passes its own
    assert ds["zero_allow_untested_optimizer"] is True
    zero = ds["zero_optimization"]
    stage = int(path.name[4])
    assert zero["stage"] == stage
    for key in ("offload_optimizer", "offload_param"):
        assert (key in zero) == (key in path.name or "offload_all" in path.name)
    if stage == 3 and "train" in path.name:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    parsed = DeepSpeedConfig(_fill(ds))
    assert parsed.zero_optimization_stage == stage
    assert not auto_keys(_fill(ds))


def test_readme_lists_every_template():
    readme = (REPO / "ds_configs" / "README.md").read_text()
    for path in (REPO / "ds_configs").glob("*.json"):
        assert path.name in readme, path.name


def test_every_role_and_stage_has_a_template():
    for role, stage, opt, par in itertools.product(("policy", "value", "reference", "reward"),
                                                   (0, 1, 2, 3), (False, True), (False, True)):
        if par and stage != 3 or (opt and stage < 2 and role in ("policy", "value")):
            continue
        assert default_template(role, stage, opt, par).is_file()


def test_critic_free_plan_drops_the_value_role(tmp_path):
    cluster = P.Cluster(1, 1, 80 * GiB)
    path = small_config(tmp_path)
    with_critic = P.plan(load_config(path), cluster)
    grpo = P.plan(load_config(path, ["ppo.advantage_estimator=grpo",
                                     "ppo.samples_per_prompt=2"]), cluster)
    assert "value" in with_critic.roles and "value" not in grpo.roles
    assert set(P.to_json(grpo)["roles"]) == {"policy", "reference", "reward"}
    assert not any("value" in ph.name for ph in grpo.phases)
    saved = with_critic.roles["value"].states.resident_bytes
    assert saved > 0 and grpo.resident_bytes == with_critic.resident_bytes - saved
    assert any("no value model" in n for n in grpo.notes)
    assert "value" not in P.format_plan(grpo, "small").split("Peak per GPU")[0]


# ---------------------------------------------------------------------------------- LoRA
def test_lora_adapter_count_matches_peft():
    """lora_params counts what peft builds: r x (in + out) per adapted projection."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    arch = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    cfg = load_config(None, ["policy.lora.r=4", f"policy.arch={json.dumps(arch)}"])
    shape = P.model_shape(P._hf_config(None, cfg.policy.arch), "causal", "arch")
    for targets in ("all-linear", ["q_proj", "down_proj"]):
        fields = {k: v for k, v in arch.items() if k != "model_type"}
        model = get_peft_model(LlamaForCausalLM(LlamaConfig(**fields)),
                               LoraConfig(r=4, target_modules=targets))
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lora = cfg.policy.lora.model_copy(update={"target_modules": targets})
        assert P.lora_params(shape, lora) == n, targets
    # the tiny default's random-init untied policy: the engine adapts its output head too
    # (policy.lora.output_head auto), and the plan counts what that peft model trains
    from ds_ppo.engine.lora import add_adapters, adapts_output_head, trainable

    tiny = load_config(None, ["policy.lora.r=8"])
    model = LlamaForCausalLM(P._hf_config(None, tiny.policy.arch))
    head = adapts_output_head(tiny.policy.lora, True, model)
    trained = sum(p.numel() for p in trainable(add_adapters(model, tiny.policy.lora, 0,
                                                            output_head=head)))
    tiny_shape = P.model_shape(P._hf_config(None, tiny.policy.arch), "causal", "arch")
    assert head and P.lora_params(tiny_shape, tiny.policy.lora, output_head=True) == trained
    plan = P.compute_plan(tiny, P.resolve_shapes(tiny), P.Cluster(1, 1, 80 * GiB))
    assert any("and the output head" in n for n in plan.notes)


def test_lora_base_copy_is_what_the_schedule_replica_keeps():
    """An off-policy schedule's replica of a LoRA policy keeps the adapted layers' frozen
    weights (engine/generation build_replica's bases); the plan counts them beside it, on the
    ranks that hold the replica."""
    import torch
    from transformers import LlamaForCausalLM

    from ds_ppo.engine.generation import build_replica
    from ds_ppo.engine.lora import add_adapters
    from ds_ppo.plan.phases import LORA_BASE_COPY
    from ds_ppo.plan.shapes import lora_base_params

    off = ["policy.lora.r=8", "ppo.schedule=one_step_off", "ppo.rollout_correction=tis"]
    tiny = load_config(None, off)
    model = add_adapters(LlamaForCausalLM(P._hf_config(None, tiny.policy.arch)),
                         tiny.policy.lora, 0, output_head=True)
    bases: dict = {}
    build_replica(model, torch.float32, torch.device("cpu"), bases=bases)
    shape = P.model_shape(P._hf_config(None, tiny.policy.arch), "causal", "arch")
    kept = lora_base_params(shape, tiny.policy.lora, output_head=True)
    assert kept == sum(w.numel() for w in bases.values())
    colocated = P.compute_plan(tiny, P.resolve_shapes(tiny), P.Cluster(1, 1, 80 * GiB))
    assert all(ph.transient[LORA_BASE_COPY] == 2 * kept for ph in colocated.phases[1:])
    split = load_config(None, [*off, "ppo.placement=split", "ppo.generation_ranks=1"])
    p = P.compute_plan(split, P.resolve_shapes(split), P.Cluster(1, 2, 80 * GiB))
    assert [LORA_BASE_COPY in ph.transient for ph in p.phases] == \
        [ph.generation_ranks for ph in p.phases]
    sync = load_config(None, ["policy.lora.r=8"])
    assert not any(LORA_BASE_COPY in ph.transient for ph in
                   P.compute_plan(sync, P.resolve_shapes(sync), P.Cluster(1, 1, 80 * GiB)).phases)


def test_70b_lora_fits_one_node_where_full_70b_does_not():
    one_node = P.Cluster(1, 8, 80 * GiB)
    lora = P.plan(load_config("70b-lora"), one_node)
    assert lora.fits and lora.generation_mode == "tensor_parallel"
    assert lora.roles["reference"].shape is None  # the policy's base, no reference role
    full = P.plan(load_config("70b", ["ppo.rollout_batch_size=128", "ppo.mini_batch_size=32"]),
                  one_node)
    assert not full.fits
    # the trained roles keep only the frozen 16-bit base resident (+ small adapter states)
    base = 2 * lora.roles["policy"].shape.params / 8
    assert base < lora.roles["policy"].states.resident_bytes < 1.05 * base
    assert lora.roles["policy"].states.resident_bytes < \
        full.roles["policy"].states.resident_bytes / 5


def test_policy_ema_is_counted_per_rank_partition():
    """policy.ema_decay: 4 bytes per policy parameter divided by the ZeRO-3 group, on the GPU
    beside the partitions, or in CPU memory with the policy's parameters offloaded."""
    cluster = P.Cluster(1, 8, 80 * GiB)

    def policy_states(*overrides):
        cfg = load_config("8b", list(overrides))
        p = P.compute_plan(cfg, P.resolve_shapes(cfg), cluster)
        return p.roles["policy"].states, p

    base, _ = policy_states()
    ema, plan = policy_states("policy.ema_decay=0.992")
    params = plan.roles["policy"].shape.params
    assert ema.gpu_bytes_per_rank - base.gpu_bytes_per_rank == 4 * params // 8
    assert ema.cpu_bytes_per_node == base.cpu_bytes_per_node
    assert any("policy.ema_decay" in n and "ZeRO-3 partition" in n for n in plan.notes)
    off = ["deepspeed.policy.offload_param=true", "deepspeed.policy.offload_optimizer=true"]
    base, _ = policy_states(*off)
    ema, _ = policy_states(*off, "policy.ema_decay=0.992")
    assert ema.gpu_bytes_per_rank == base.gpu_bytes_per_rank
    assert ema.cpu_bytes_per_node - base.cpu_bytes_per_node == 4 * params // 8 * 8


def test_multi_turn_plan_counts_the_whole_episode():
    """With an env, a response is an episode of env.max_total_tokens (turns and observations):
    the KV cache, the later turns' prefill and the scoring sequences are that long."""
    base = load_config("70b")
    multi = load_config("70b", ["env.function=ds_ppo.envs.calculator:Calculator",
                                "env.max_total_tokens=8192", "data.reward_keys=[answer]"])
    cluster = P.Cluster(8, 8, 80 * GiB)
    a, b = P.plan(base, cluster), P.plan(multi, cluster)
    assert (a.seq_response, b.seq_response) == (base.generation.max_new_tokens, 8192)
    ps = b.roles["policy"].shape
    gen = b.phases[0].transient
    batch = multi.generation.batch_size
    assert gen["KV cache"] == P.kv_cache_bytes(ps, multi.data.max_prompt_len + 8192, batch) // 8
    assert gen["prefill activations (one layer)"] == P.prefill_activation_bytes(
        ps, multi.data.max_prompt_len + 8192 - multi.generation.max_new_tokens, batch, False,
        tp=8)
    assert b.peak_gpu_bytes > a.peak_gpu_bytes


# ------------------------------------------------------------------- mixture of experts
@pytest.mark.parametrize("name,nodes,total,active", [("30b-a3b", 1, 30.53, 3.35),
                                                     ("235b-a22b", 8, 235.09, 22.19)])
def test_moe_presets_fit_and_count_total_and_active_params(name, nodes, total, active):
    """The MoE presets fit 80 GB GPUs as configured; the plan holds and trains every expert
    (total parameters) and names the active ones, each MoE block's whole-layer ZeRO-3 gather
    and, without their offloaded optimizer, the lever that makes them fit."""
    cfg = load_config(name)
    p = P.plan(cfg, P.Cluster(nodes, 8, 80 * GiB))
    assert p.fits, P.format_plan(p, name)
    shape = p.roles["policy"].shape
    assert (round(shape.params / 1e9, 2), round(shape.active_params / 1e9, 2)) == (total, active)
    assert shape.experts == 128 and shape.top_k == 8
    assert shape.largest_layer_params == shape.layer_expert_params  # the fused experts
    text = P.format_plan(p, name)
    assert "mixture of experts, 128 experts" in text and "gathers each MoE block whole" in text
    js = P.to_json(p)["roles"]["policy"]
    assert (js["experts"], js["top_k"], js["active_params"]) == (128, 8, shape.active_params)
    unoffloaded = load_config(name, ["deepspeed.policy.offload_optimizer=false"])
    q = P.plan(unoffloaded, P.Cluster(nodes, 8, 80 * GiB))
    if not q.fits:
        assert "deepspeed.policy.offload_optimizer=true" in q.biggest_lever.lever.overrides


def test_235b_decodes_on_a_tensor_parallel_replica_with_its_experts_split():
    """235b-a22b: a node's 8 GPUs hold one replica, attention split by heads (one of the 4 KV
    heads per GPU), each layer's 128 experts 16 per GPU (those expert parallelism 8 gives it,
    so the copy's largest gather is the output head's); by hand: per rank the experts / 8,
    q and o / 8, k and v / 4, embeddings, head, norms and routers whole; the KV cache / 4."""
    cfg = load_config("235b-a22b")
    p = P.plan(cfg, P.Cluster(8, 8, 80 * GiB))
    assert p.fits and p.generation_mode == "tensor_parallel" and p.tp_size == 8
    s = p.roles["policy"].shape
    assert (s.layers, s.moe_layers, s.heads, s.kv_heads) == (94, 94, 64, 4)
    qo, kv = 2 * 4096 * 128 * 64, 2 * 4096 * 128 * 4
    assert s.expert_params == 94 * 128 * 3 * 4096 * 1536
    whole = s.params - s.expert_params - 94 * (qo + kv)
    assert P.tp_shard_params(s, 8) == whole + (s.expert_params + 94 * qo) // 8 + 94 * kv // 4
    gen = {ph.name: ph.transient for ph in p.phases}["generation (tensor_parallel)"]
    name = "16-bit policy replica shard (1/8 of each layer, 16 of 128 experts)"
    assert gen[name] == 2 * P.tp_shard_params(s, 8)
    assert gen["layer gather while copying"] == 2 * s.vocab * s.hidden
    assert gen["KV cache"] == P.kv_cache_bytes(s, 512 + 1024, 64) // 4
    # without expert parallelism the copy gathers each MoE block whole
    q = P.plan(load_config("235b-a22b", ["deepspeed.policy.expert_parallel_size=1"]),
               P.Cluster(8, 8, 80 * GiB))
    assert {ph.name: ph.transient for ph in q.phases}["generation (tensor_parallel)"][
        "layer gather while copying"] == 2 * s.layer_expert_params


def test_router_replay_memory_is_noted():
    text = P.format_plan(P.plan(load_config("30b-a3b"), P.Cluster(1, 8, 80 * GiB)), "30b-a3b")
    assert "ppo.router_replay: the recorded expert choices take 768 bytes per token" in text


# ------------------------------------------------------------------------------ placement
OFF_POLICY = {"schedule": "one_step_off", "rollout_correction": "tis"}


def _small_plan(tmp_path, gpus: int, **ppo) -> "P.Plan":
    cfg = load_config(str(small_config(tmp_path, ppo={**OFF_POLICY, **ppo})))
    return P.plan(cfg, P.Cluster(1, gpus, 80 * GiB))


def test_split_placement_by_hand(tmp_path):
    """4 GPUs, 2 of them generation ranks: the trained roles' ZeRO-3 states are partitioned over
    the 2 training ranks; a generation rank holds a whole 16-bit replica and decodes one training
    rank's 8 / 2 = 4 rows with their KV cache, and no model state."""
    p = _small_plan(tmp_path, 4, placement="split", generation_ranks=2)
    pol = p.roles["policy"]
    n, largest = pol.shape.params, pol.shape.largest_layer_params
    assert (p.placement, p.generation_ranks, p.training_cluster.world_size) == ("split", 2, 2)
    assert pol.states.gpu_bytes_per_rank == 4 * largest + int(18 * n / 2)  # ZeRO-3 over 2
    gen = p.phases[0]
    assert gen.generation_ranks and p.gen_batch == 4 and p.generation_mode == "gathered"
    # 2 (K, V) x 2 layers x 2 kv heads x 16 head dim x (32 + 16) tokens x 4 rows x 2 bytes
    kv = 2 * 2 * 2 * 16 * 48 * 4 * 2
    assert kv == 49_152
    assert gen.transient == {
        "16-bit policy replica": 2 * n, "KV cache": kv,
        "prefill activations (one layer)": P.prefill_activation_bytes(pol.shape, 32, 4, False),
        "fp32 logits of one step": 4 * 1000 * 4}
    assert gen.total(p.resident_bytes) == 2 * GiB + sum(gen.transient.values())
    assert p.rank_peak(True) == gen.total(p.resident_bytes)
    trains = [ph for ph in p.phases if not ph.generation_ranks]
    assert p.rank_peak(False) == max(ph.total(p.resident_bytes) for ph in trains)
    assert p.peak_gpu_bytes == max(p.rank_peak(True), p.rank_peak(False))
    # the training ranks' phases hold no replica and no decoding
    assert not any("replica" in k or "KV" in k for ph in trains for k in ph.transient)
    # split over 4 = colocated over 2 on the training side
    two = _small_plan(tmp_path, 2)
    assert p.resident_bytes == two.resident_bytes


def test_colocated_off_policy_counts_the_worker_beside_training(tmp_path):
    """An off-policy schedule keeps the worker's replica and its decoding (2 rows per rank of 4)
    on every rank while scoring and training run; sync adds nothing to them."""
    sync = load_config(str(small_config(tmp_path)))
    base = P.plan(sync, P.Cluster(1, 4, 80 * GiB))
    p = _small_plan(tmp_path, 4)
    n = p.roles["policy"].shape.params
    worker = {"generation worker's 16-bit replica": 2 * n,
              "worker's KV cache": 2 * 2 * 2 * 16 * 48 * 2 * 2,
              "worker's prefill activations (one layer)": P.prefill_activation_bytes(
                  p.roles["policy"].shape, 32, 2, False),
              "worker's fp32 logits of one step": 2 * 1000 * 4}
    assert p.phases[0] == base.phases[0]  # the first rollout, generated on the spot
    for ph, before in zip(p.phases[1:], base.phases[1:]):
        assert ph.transient == {**before.transient, **worker}
    assert p.peak_gpu_bytes == base.peak_gpu_bytes + sum(worker.values())
    assert p.rank_peak(True) == 0


def test_placement_levers(tmp_path):
    """Colocated with an off-policy schedule may move generation to a rank of its own; split
    may give a generation rank back to training; an off-policy worker needs a whole replica."""
    p = _small_plan(tmp_path, 4)
    cfg = load_config(str(small_config(tmp_path, ppo=OFF_POLICY)))
    overrides = [lv.overrides for lv in P.candidate_levers(cfg, p)]
    assert ("ppo.placement=split", "ppo.generation_ranks=1") in overrides
    assert not any(o[0].startswith("generation.mode") for o in overrides)
    cfg = load_config(str(small_config(tmp_path, ppo={**OFF_POLICY, "placement": "split",
                                                      "generation_ranks": 2})))
    overrides = [lv.overrides for lv in P.candidate_levers(cfg, P.plan(cfg, P.Cluster(1, 4,
                                                                                     80 * GiB)))]
    assert ("ppo.generation_ranks=1",) in overrides


def test_split_plan_refuses_no_training_rank(tmp_path, capsys):
    path = small_config(tmp_path, ppo={**OFF_POLICY, "placement": "split"})
    with pytest.raises(ConfigError, match="ppo.generation_ranks = 1 leaves no training rank"):
        P.main(plan_args(path, gpus=1))
    assert P.main(plan_args(path, gpus=2)) == 0
    out = capsys.readouterr().out
    assert "placement: split, 1 generation rank(s)" in out and "generation ranks (split)" in out
    assert P.main(plan_args(path, gpus=2, as_json=True)) == 0
    js = json.loads(capsys.readouterr().out)["placement"]
    assert (js["name"], js["generation_ranks"], js["training_ranks"]) == ("split", 1, 1)


def test_expert_parallelism_in_the_plan():
    """deepspeed.policy.expert_parallel_size = N: under ZeRO-3 a rank's share of the states is
    unchanged (E / N experts over world / N ranks), the training gather holds E / N experts of
    a layer (none at world = N: the output head is then the largest), each layer's all-to-all
    buffers join the training phase, and under ZeRO-2 a rank keeps only its experts' states.
    The 30b-a3b preset runs it (8 GPUs, 16 experts each)."""
    on = load_config("30b-a3b")
    assert on.deepspeed.policy.expert_parallel_size == 8
    off = load_config("30b-a3b", ["deepspeed.policy.expert_parallel_size=1"])
    a, b = (P.plan(c, P.Cluster(1, 8, 80 * GiB)) for c in (off, on))
    s = b.roles["policy"].shape
    assert b.roles["policy"].states.resident_bytes == a.roles["policy"].states.resident_bytes
    train = {p.name: p.transient for p in b.phases}["training: policy"]
    assert train["layer gather (weights + grads)"] == 4 * s.vocab * s.hidden
    assert {p.name: p.transient for p in a.phases}["training: policy"][
        "layer gather (weights + grads)"] == 4 * s.layer_expert_params
    tokens = b.micro_batch * (b.seq_prompt + b.seq_response)
    assert train["expert all-to-all (one layer)"] == 4 * tokens * s.top_k * s.hidden * 2
    assert "expert parallelism 8 (AutoEP): 16 experts of each layer per rank" in \
        P.format_plan(b, "30b-a3b")
    assert P.to_json(b)["roles"]["policy"]["expert_parallel_size"] == 8
    # ZeRO-2: the experts' states of one rank's 16 experts over the 1 rank holding them, the
    # rest's over 8 (2 + 18 / ranks bytes per parameter)
    two = on.deepspeed.policy.model_copy(update={"zero_stage": 2, "offload_optimizer": False})
    got = P.expert_parallel_states(s, 8, P.Cluster(1, 8, 80 * GiB), two).gpu_bytes_per_rank
    e, rest = s.expert_params // 8, s.params - s.expert_params
    assert got == (2 * rest + int(18 * rest / 8)) + (2 * e + 18 * e)
