"""generation.mode=tensor_parallel on every model family it accepts (MODEL_TYPES): two gloo ranks,
each with its own prompts, decode greedily through the sharded replica and must get exactly what
the whole replica gives, in float32. The mixture-of-experts families (experts split over the two
ranks) also sample from one random stream and must draw the tokens and record the expert choices
the whole replica does, one of them with fewer KV heads than ranks. (tests/support/dist_checks.py
runs the mode inside real DeepSpeed training; this covers the families.)"""
from __future__ import annotations

import json
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_ppo.config.tensor_parallel_shapes import MODEL_TYPES

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attn_implementation="sdpa")
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.0)
EXTRA = {"gemma": {"head_dim": 16}, "qwen3": {"head_dim": 16},
         "mistral": {"sliding_window": None},
         # 1 KV head over 2 ranks: each rank holds a copy of it
         "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_key_value_heads": 1, **MOE},
         "mixtral": {"sliding_window": None, "num_local_experts": 4, **MOE}}
MOE_TYPES = ("qwen3_moe", "mixtral")


def _family_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **EXTRA.get(model_type, {})})
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
        if model_type in MOE_TYPES:
            results[model_type].update(_sampled_moe(engine, ids, mask, rank))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _sampled_moe(engine, ids, mask, rank: int) -> dict:
    """Sampling (temperature 1) from one random stream: this rank's rows of the group's
    tensor-parallel decode against the whole replica decoding the group's rows with the seed
    the group drew; tokens and recorded expert choices (prompt and response) equal."""
    from ds_ppo.config import load_config
    from ds_ppo.engine.generation import generate
    from ds_ppo.engine.generation.tensor_parallel import gather_group_prompts, tp_group

    cfg = load_config(None, ["generation.temperature=1", "generation.max_new_tokens=8",
                             "generation.tp_size=2"]).generation
    torch.manual_seed(123)
    sharded = generate(engine, ids, mask, cfg, "tensor_parallel", [1], 0, torch.float32)
    rows, rows_mask, offset = gather_group_prompts(ids, mask, 0, tp_group(2))
    torch.manual_seed(123)  # the seed the group's first rank drew for the group
    torch.manual_seed(int(torch.randint(0, 2**62, (1,), dtype=torch.long)))
    whole = generate(engine, rows, rows_mask, cfg, "gathered", [1], 0, torch.float32)
    mine = slice(offset, offset + ids.shape[0])
    P = ids.shape[1]
    return {"sampled_equal": torch.equal(sharded.response_ids, whole.response_ids[mine]),
            "routes_equal": sharded.prompt_routes is not None and torch.equal(
                sharded.prompt_routes, whole.prompt_routes[mine, -P:]) and torch.equal(
                sharded.response_routes, whole.response_routes[mine]),
            "routed": int((sharded.response_routes >= 0).sum()) > 0}


@pytest.fixture(scope="module")
def family_results(tmp_path_factory):
    work = tmp_path_factory.mktemp("tp_families")
    mp.spawn(_worker, args=(str(work / "init"), str(work)), nprocs=2)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sharded_replica_decodes_as_the_whole_one(family_results, model_type):
    moe = {"sampled_equal": True, "routes_equal": True, "routed": True}
    for rank, results in enumerate(family_results):
        assert results[model_type] == {"equal": True, "rows": 2 + rank,
                                       **(moe if model_type in MOE_TYPES else {})}, (rank, results)
