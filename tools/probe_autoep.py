"""Whether DeepSpeed's AutoEP (expert parallelism, `expert_parallel` in a DeepSpeed config)
runs on this machine with the installed DeepSpeed and transformers, outside ds_ppo: a tiny
random-init Qwen3-MoE (4 experts, top-2) through deepspeed.initialize with
expert_parallel.autoep_size = the world size, one forward (its logits against the model's own
before replacement) and one optimizer step. ds_ppo's own use of it is
deepspeed.<role>.expert_parallel_size (docs/SCALING.md, Expert parallelism).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 tools/probe_autoep.py [--stage 3] [--shim]

--shim applies ds_ppo's compatibility shim first (`moe.autoep_compat`: transformers 5.25's
output-recorder registry refuses the default argument DeepSpeed 0.19.8 passes, and AutoEP fails
at engine start with "TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3
were given"); without it, the probe shows whether a new release pair still needs it.
"""
from __future__ import annotations

import argparse
import os
import traceback

import torch


def main() -> None:
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--shim", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.shim:
        from ds_ppo.engine.moe import autoep_compat

        autoep_compat()
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": args.stage},
          "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": "qwen3_moe"},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds)
        logits = engine(input_ids=ids).logits
        engine.backward(logits.float().pow(2).mean())
        engine.step()
        print(f"rank {rank}: AutoEP ran (ZeRO-{args.stage}, EP {world}): "
              f"{type(engine.module.model.layers[0].mlp).__name__}, logits max abs diff "
              f"{float((logits - before).abs().max()):.3g}, one optimizer step", flush=True)
    except Exception as e:
        traceback.print_exc()
        print(f"rank {rank}: AutoEP failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
