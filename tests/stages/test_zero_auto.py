"""`deepspeed.<role>.zero_stage: auto`: ZeRO-3 where it partitions something, stage 0 on one rank
(where ZeRO-3's hooks only cost time), 3 whenever a universal checkpoint is loaded; and a clear
error, not DeepSpeed's, for a stage-0 checkpoint resumed on another world size."""
from __future__ import annotations

import json

import pytest
import torch

from ds_ppo.config import load_config
from ds_ppo.engine.checkpoint import TAG, ensure_universal
from ds_ppo.engine.ds_config import build_ds_config, template_path
from ds_ppo.errors import ConfigError


def _cfg(*extra):
    return load_config(None, ["deepspeed.policy.zero_stage=auto", "deepspeed.value.zero_stage=3",
                              "deepspeed.reference.zero_stage=auto",
                              "deepspeed.reference.offload_param=true", *extra])


def test_auto_stage_by_world_size_offload_and_universal():
    cfg = _cfg()
    d = cfg.deepspeed.policy
    assert d.stage(1) == 0 and d.stage(2) == 3 and d.stage(1, load_universal=True) == 3
    assert cfg.deepspeed.reference.stage(1) == 3  # offload_param needs ZeRO-3
    assert _cfg("deepspeed.reference.offload_param=false").deepspeed.reference.stage(1) == 0
    assert _cfg("deepspeed.policy.offload_optimizer=true").deepspeed.policy.stage(1) == 3
    assert cfg.deepspeed.value.stage(1) == 3  # an explicit stage stays as it is
    tiny = load_config(None).deepspeed  # the tiny preset: auto everywhere, nothing offloaded
    assert [getattr(tiny, r).stage(1) for r in ("policy", "value", "reference", "reward")] \
        == [0, 0, 0, 0]


def test_auto_stage_reaches_the_deepspeed_config():
    cfg = _cfg()
    one = build_ds_config(cfg, "policy", 1, torch.float32, 64)
    two = build_ds_config(cfg, "policy", 2, torch.float32, 64)
    uni = build_ds_config(cfg, "policy", 1, torch.float32, 64, load_universal=True)
    assert one["zero_optimization"]["stage"] == 0 and template_path(cfg, "policy").name == \
        "zero0_train.json"
    assert two["zero_optimization"]["stage"] == 3 and uni["zero_optimization"]["stage"] == 3


def test_an_auto_key_ds_ppo_does_not_fill_is_a_config_error(tmp_path):
    own = tmp_path / "own.json"  # as written for HF's Trainer, which fills these
    own.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                     "sub_group_size": "auto"},
                               "bf16": {"enabled": "auto"}, "train_batch_size": "auto",
                               "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    cfg = load_config(None, [f"deepspeed.policy.config={own}"])
    with pytest.raises(ConfigError, match=r"deepspeed.policy.config = .*own.json.*: "
                                          r"optimizer.params.lr still \"auto\""):
        build_ds_config(cfg, "policy", 1, torch.float32, 64)
    (ds := json.loads(own.read_text()))["optimizer"]["params"]["lr"] = 1e-5
    own.write_text(json.dumps(ds))
    filled = build_ds_config(cfg, "policy", 1, torch.float32, 64)  # the rest ds_ppo fills
    assert filled["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert "sub_group_size" not in filled["zero_optimization"]  # DeepSpeed's default
    assert filled["bf16"] == {"enabled": False}
    assert filled["train_batch_size"] == cfg.ppo.mini_batch_size


def test_stage0_checkpoint_on_another_world_size_is_a_config_error(tmp_path):
    ckpt = tmp_path / "iter_000002"
    for role in ("policy", "value"):
        (ckpt / role / TAG).mkdir(parents=True)
        (ckpt / role / TAG / "mp_rank_00_model_states.pt").write_bytes(b"")  # stage 0's only file
    (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": 2, "world_size": 1}))
    with pytest.raises(ConfigError, match="resume it on world size 1"):
        ensure_universal(ckpt)


def test_zero3_knobs_reach_the_deepspeed_config_of_zero3_roles_only():
    """deepspeed.<role>.zero3: DeepSpeed's stage3_* keys, over the template's values, where the
    role runs ZeRO-3; unset ones keep the template's (auto: from the hidden size)."""
    cfg = load_config(None, ["deepspeed.policy.zero_stage=3",
                             "deepspeed.policy.zero3.persistence_threshold=1e9",
                             "deepspeed.policy.zero3.max_live_parameters=300000000",
                             "deepspeed.value.zero3.prefetch_bucket_size=1000"])
    zero = build_ds_config(cfg, "policy", 1, torch.float32, 64)["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 10**9
    assert zero["stage3_max_live_parameters"] == 3 * 10**8
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)  # the template's auto
    value = build_ds_config(cfg, "value", 1, torch.float32, 64)["zero_optimization"]
    assert value == {"stage": 0}  # auto on one CPU rank: stage 0, no ZeRO-3 keys
    two = build_ds_config(cfg, "value", 2, torch.float32, 64)["zero_optimization"]
    assert two["stage"] == 3 and two["stage3_prefetch_bucket_size"] == 1000
    with pytest.raises(ConfigError, match="persistence_threshold"):
        load_config(None, ["deepspeed.policy.zero3.persistence_threshold=-1"])


def test_a_stage_moving_to_or_from_zero3_is_seen_in_the_checkpoint(tmp_path):
    from ds_ppo.engine.checkpoint import saved_zero3, stage_changed

    ckpt = tmp_path / "iter_000002"
    (ckpt / "policy" / TAG).mkdir(parents=True)
    (ckpt / "policy" / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    (ckpt / "value" / TAG).mkdir(parents=True)
    (ckpt / "value" / TAG / "mp_rank_00_model_states.pt").write_bytes(b"")  # stage 0-2
    (ckpt / "value" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert saved_zero3(ckpt) == {"policy": True, "value": False}
    assert stage_changed(ckpt, {"policy": 3, "value": 2}) == []
    assert stage_changed(ckpt, {"policy": 2, "value": 3}) == ["policy", "value"]
    assert stage_changed(ckpt, {"policy": 3, "value": 0}) == []  # 2 -> 0: both stage 0-2
    assert stage_changed(ckpt, {"policy": 3}) == []  # a critic-free run: no value engine
