"""A LoRA policy's weight sync into the generation replica (engine/generation `build_replica` with
`bases`, engine/lora.py `adapter_weights`): after the first sync only the adapters are gathered and
merged into the replica's copy of the frozen base, giving bit for bit the weights a full rebuild
gives; the schedule's runs are unchanged but for the bytes moved, and a corrupted adapter sync
stops the run with one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_ppo.config.role_sections import LoraConfig
from ds_ppo.engine.generation import GATHER_CHUNK_NUMEL, _param_chunks, build_replica
from ds_ppo.engine.lora import add_adapters, trained_bytes

CPU = torch.device("cpu")


def _lora_llama(output_head: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=False))
    return add_adapters(model, LoraConfig(r=4), seed=1, output_head=output_head)


def _train_a_step(model: torch.nn.Module, seed: int) -> None:
    """As an optimizer step would: every trained parameter moves (B leaves zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("output_head", [False, True])
def test_adapter_only_sync_equals_a_full_rebuild_bit_for_bit(output_head):
    model = _lora_llama(output_head)
    # a trained weight that is not adapted (as a fully trained module would be): gathered whole
    model.get_base_model().model.norm.weight.requires_grad_(True)
    bases: dict[str, torch.Tensor] = {}
    replica = build_replica(model, torch.float32, CPU, own_config=True, bases=bases)
    assert _same(replica, build_replica(model, torch.float32, CPU))
    adapted = {n for n in bases}
    assert "model.layers.0.self_attn.q_proj.weight" in adapted
    assert ("lm_head.weight" in adapted) == output_head
    for step in range(2):
        _train_a_step(model, seed=step)
        sums: dict[str, int] = {}
        again = build_replica(model, torch.float32, CPU, into=replica, sums=sums, bases=bases)
        assert again is replica
        # fp32 on CPU: the same merge (W + scale x B A in fp32) from the same W, so bit for bit
        assert _same(replica, build_replica(model, torch.float32, CPU))
        assert set(sums) == adapted | {"model.norm.weight"}
        # what was gathered: the adapters and the trained weight, no frozen weight
        gathered = [p for chunk in _param_chunks(model, GATHER_CHUNK_NUMEL, bases)
                    for _, ps, _ in chunk for p in ps]
        assert all(p.requires_grad for p in gathered)
        assert sum(p.numel() * p.element_size() for p in gathered) == trained_bytes(model)


def test_a_plain_policy_syncs_in_full_every_time():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4))
    bases: dict[str, torch.Tensor] = {}
    replica = build_replica(model, torch.float32, CPU, bases=bases)
    sums: dict[str, int] = {}
    build_replica(model, torch.float32, CPU, into=replica, sums=sums, bases=bases)
    assert not bases and set(sums) == {n for n, _ in replica.named_parameters()}


# ------------------------------------------------------------- whole runs (in process)
SMALL = ["tracking.enabled=false", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=4", "generation.max_new_tokens=6",
         "checkpoint.export_at_end=false", "checkpoint.every=0"]
LORA_OFF = ["ppo.schedule=one_step_off", "ppo.rollout_correction=tis", "policy.lora.r=8",
            "deepspeed.policy.zero_stage=3"]  # the syncs gather from ZeRO-3 partitions


def _train(out: Path, *overrides: str):
    from ds_ppo.config import load_config
    from ds_ppo.trainer import train

    return train(load_config(None, [*SMALL, f"output_dir={out}", *overrides]))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_schedule_run_is_unchanged_but_for_the_bytes(tmp_path, monkeypatch):
    import ds_ppo.ppo.schedule as schedule

    _train(tmp_path / "adapters", *LORA_OFF, "iterations=3")
    real = schedule.build_replica
    # every sync in full, as a replica without a copy of the base does
    monkeypatch.setattr(schedule, "build_replica",
                        lambda *a, **kw: real(*a, **{**kw, "bases": None}))
    _train(tmp_path / "full", *LORA_OFF, "iterations=3")
    volatile = ("time/", "tokens_per_s/", "memory/", "async/weight_sync_s",
                "async/weight_sync_bytes", "async/training_", "async/generation_idle")
    a, b = _rows(tmp_path / "adapters"), _rows(tmp_path / "full")
    assert [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in a] == \
        [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in b]
    moved = [r["async/weight_sync_bytes"] for r in a]
    full = [r["async/weight_sync_bytes"] for r in b]
    # iteration 1's sync is the full one; after it, only the adapters (and the adapted head)
    assert moved[0] == full[0] and all(m < f / 4 for m, f in zip(moved[1:], full[1:]))
    assert moved[1] == moved[2]


def test_corrupted_adapter_sync_stops(tmp_path, monkeypatch):
    from ds_ppo.ppo.schedule import WeightSyncError

    # version 1: the sync after the first, adapters only
    monkeypatch.setenv("DS_PPO_FAULT", "corrupt_sync:1")
    with pytest.raises(WeightSyncError) as e:
        _train(tmp_path, *LORA_OFF, "iterations=3")
    message = str(e.value)
    assert "\n" not in message and "policy version 1" in message and "checksum" in message
    assert "_proj.weight" in message  # a merged layer was the corrupted one
