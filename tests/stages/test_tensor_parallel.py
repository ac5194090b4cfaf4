"""generation.mode=tensor_parallel on every model family it accepts (MODEL_TYPES): two gloo ranks,
each with its own prompts, decode greedily through the sharded replica and must get exactly what
the whole replica gives, in float32. (tests/support/dist_checks.py runs the mode inside real DeepSpeed
training; this covers the families.)"""
from __future__ import annotations

import json
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_ppo.engine.generation.choice import MODEL_TYPES

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attn_implementation="sdpa")
EXTRA = {"gemma": {"head_dim": 16}, "qwen3": {"head_dim": 16},
         "mistral": {"sliding_window": None}}


def _family_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **COMMON, **EXTRA.get(model_type, {}))
    return AutoModelForCausalLM.from_config(config).eval()


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from ds_ppo.config import load_config
    from ds_ppo.engine.generation import generate

    cfg = load_config(None, ["generation.temperature=0", "generation.max_new_tokens=10",
                             "generation.tp_size=2"]).generation
    results = {}
    for model_type in MODEL_TYPES:
        model = _family_model(model_type)
        engine = types.SimpleNamespace(module=model, empty_partition_cache=lambda: None)
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own prompts
        ids = torch.randint(3, 300, (2 + rank, 5 + rank), generator=g)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[0, :2] = False
        sharded = generate(engine, ids, mask, cfg, "tensor_parallel", [1], 0, torch.float32)
        whole = generate(engine, ids, mask, cfg, "gathered", [1], 0, torch.float32)
        results[model_type] = {"equal": torch.equal(sharded.response_ids, whole.response_ids),
                               "rows": int(sharded.response_ids.shape[0])}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def family_results(tmp_path_factory):
    work = tmp_path_factory.mktemp("tp_families")
    mp.spawn(_worker, args=(str(work / "init"), str(work)), nprocs=2)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sharded_replica_decodes_as_the_whole_one(family_results, model_type):
    for rank, results in enumerate(family_results):
        assert results[model_type] == {"equal": True, "rows": 2 + rank}, (rank, results)
