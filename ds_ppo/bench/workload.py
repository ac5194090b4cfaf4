"""What `ds-ppo bench` runs: the model shapes, the ds_ppo config built from its flags (and
validated as any run's config is), a stand-in tokenizer and random-token prompts."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from ds_ppo.role_names import ROLES

# Per shape: the architecture and the default batch. `1b` is a 0.85B model
# (untied embeddings); `tiny` runs in seconds on a CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        arch=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  tie_word_embeddings=False),
        prompts=4, prompt_len=8, new_tokens=8, iterations=1, micro_batch=2,
        score_micro_batch=4),
    "1b": dict(
        arch=dict(model_type="llama", hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                  vocab_size=32000, tie_word_embeddings=False, rms_norm_eps=1e-5),
        prompts=64, prompt_len=256, new_tokens=256, iterations=3, micro_batch=16,
        score_micro_batch=32),
    # mixture-of-experts policies (Qwen3-MoE): the decode bench's `--experts` runs
    "tiny_moe": dict(
        arch=dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, tie_word_embeddings=False),
        prompts=4, prompt_len=8, new_tokens=8, iterations=1, micro_batch=2,
        score_micro_batch=4),
    # Qwen3-30B-A3B's layers (128 experts, top-8, expert width 768), 2 of its 48
    "30b_a3b_2l": dict(
        arch=dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                  num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                  rms_norm_eps=1e-6),
        prompts=64, prompt_len=256, new_tokens=256, iterations=3, micro_batch=16,
        score_micro_batch=32),
}


class BenchTokenizer:
    """The members of a tokenizer that the engines and the rollout use, for prompts that are
    random token ids: a size, the special ids, `decode` (ids spelled `t<id>`, for the reward
    function's text) and `save_pretrained` (writes a note, not a loadable tokenizer).
    Ids 0, 1, 2 are pad, BOS, EOS; prompts use ids from 3 up."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    FIRST_ORDINARY_ID = 3

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        """The special ids by name, the others as `decode` spells them (`t<id>`), so
        generation.stop_tokens can name ordinary ids (responses of many lengths)."""
        return {"<pad>": 0, "<s>": 1, "</s>": 2,
                **{f"t{i}": i for i in range(self.FIRST_ORDINARY_ID, self.vocab_size)}}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return " ".join(f"t{i}" for i in ids
                        if not (skip_special_tokens and i < self.FIRST_ORDINARY_ID))

    def save_pretrained(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "bench_tokenizer.json").write_text(json.dumps(
            {"note": "ds_ppo.bench stand-in tokenizer: random-id prompts, no vocabulary",
             "vocab_size": self.vocab_size, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 2}))


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """`--reward function`: a reward that costs nothing (response words / 100)."""
    return [len(r.split()) / 100.0 for r in responses]


# `--reward-latency S`: the reward function's added latency per call, for every rank
LATENCY_ENV = "DS_PPO_BENCH_REWARD_LATENCY"


def slow_length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """`--reward-latency S`: `length_reward` answering after S seconds (a remote judge, a
    sandbox): what ppo.schedule's background worker overlaps with training."""
    import os
    import time

    time.sleep(float(os.environ.get(LATENCY_ENV, "0")))
    return length_reward(prompts, responses)


def resolve(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    """Every setting of this run, the shape's defaults filled in."""
    name = args.shape or ("1b" if on_gpu else "tiny")
    shape = SHAPES[name]
    s = dict(shape=name, arch=dict(shape["arch"]))
    for key in ("prompts", "prompt_len", "new_tokens", "iterations", "micro_batch",
                "score_micro_batch"):
        value = getattr(args, key)
        s[key] = shape[key] if value is None else value
    s["mini_batch"] = args.mini_batch or s["prompts"]
    s["arch"]["max_position_embeddings"] = max(2048, s["prompt_len"] + s["new_tokens"])
    s["gen_loop"], s["cuda_graph"] = args.gen_loop, args.cuda_graph
    if args.gen_loop == "hf":
        s["gen_cache"] = args.gen_cache or ("static" if on_gpu else "dynamic")
        s["compile"] = on_gpu if args.compile is None else args.compile
    else:  # options of HF generate; config validation rejects them with loop=own
        s["gen_cache"], s["compile"] = args.gen_cache or "dynamic", bool(args.compile)
    s["baseline_new_tokens"] = args.baseline_new_tokens or min(s["new_tokens"], 32)
    for key in ("warmup", "ppo_epochs", "attn", "gradient_checkpointing", "zero_stage",
                "persistence_threshold", "prefetch_bucket_size", "max_live_parameters",
                "compile_step", "reward", "seed", "overrides", "reward_latency"):
        s[key] = getattr(args, key)
    return s


def _zero3_knobs(s: dict) -> dict[str, int]:
    """deepspeed.<role>.zero3 of every role, from --persistence-threshold,
    --prefetch-bucket-size and --max-live-parameters (applied where a role runs ZeRO-3)."""
    return {key: int(s[key]) for key in ("persistence_threshold", "prefetch_bucket_size",
                                         "max_live_parameters") if s.get(key) is not None}


def build_config(s: dict, run_dir: Path):
    """The ds_ppo Config of this benchmark (written to run_dir/bench_config.yaml, then loaded
    and validated as any run's config is)."""
    import yaml

    from ds_ppo.config import load_config, validate
    from ds_ppo.engine import dist

    P, T = s["prompt_len"], s["new_tokens"]
    role_ds = {"zero_stage": s["zero_stage"], "offload_param": False, "offload_optimizer": False,
               "zero3": _zero3_knobs(s)}
    model = {"attn_implementation": s["attn"], "dtype": "auto",
             "gradient_checkpointing": s["gradient_checkpointing"]}
    if s["reward"] == "model":  # a 4th model: the policy's random-init directory as a classifier
        reward = {"model": str(run_dir / "init_models" / "policy"), "max_len": P + T}
    elif s.get("reward_latency"):
        reward = {"function": "ds_ppo.bench.workload:slow_length_reward"}
    else:
        reward = {"function": "ds_ppo.bench.workload:length_reward"}
    data = {
        "output_dir": str(run_dir), "seed": s["seed"], "resume": "never",
        "iterations": s["warmup"] + s["iterations"],
        "policy": {"arch": s["arch"], **model},
        "value": dict(model),
        "reward": reward,
        "generation": {"mode": "gathered", "max_new_tokens": T, "min_new_tokens": T,
                       "temperature": 1.0, "loop": s["gen_loop"], "cuda_graph": s["cuda_graph"],
                       "cache_implementation": s["gen_cache"], "compile": s["compile"],
                       # a kept replica keeps HF's compiled decoding step between rollouts
                       "keep_replica": s.get("compile_step", False) or (
                           s["gen_loop"] == "hf" and (s["gen_cache"] == "static"
                                                      or s["compile"])),
                       "compile_step": s.get("compile_step", False)},
        "ppo": {"rollout_batch_size": s["prompts"], "mini_batch_size": s["mini_batch"],
                "micro_batch_size": s["micro_batch"],
                "score_micro_batch_size": s["score_micro_batch"], "ppo_epochs": s["ppo_epochs"]},
        "data": {"max_prompt_len": P},
        "tracking": {"enabled": False},
        "checkpoint": {"every": 0, "save_at_end": False, "export_at_end": False},
        "deepspeed": {role: dict(role_ds) for role in ROLES},
    }
    path = run_dir / "bench_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path, s["overrides"])
    validate(cfg, dist.world_size())
    return cfg


def settings_from(cfg) -> dict[str, Any]:
    """The settings the FLOP count and the table read, as the validated config has them."""
    p, g = cfg.ppo, cfg.generation
    return {"prompts": p.rollout_batch_size, "mini_batch": p.mini_batch_size,
            "micro_batch": p.micro_batch_size,
            "score_micro_batch": p.score_micro_batch_size or p.micro_batch_size,
            "ppo_epochs": p.ppo_epochs, "new_tokens": g.max_new_tokens,
            "gen_loop": g.loop, "cuda_graph": g.cuda_graph,
            "gen_cache": g.cache_implementation, "compile": g.compile,
            "reward": "model" if cfg.reward.model is not None else "function",
            "zero_stage": cfg.deepspeed.policy.zero_stage}


def run_dir_for(root: Path, s: dict) -> Path:
    """One directory per architecture and seed, so a kept --output-dir reuses the weights."""
    key = json.dumps({"arch": s["arch"], "seed": s["seed"]}, sort_keys=True)
    run_dir = root / f"{s['shape']}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def random_prompts(n: int, length: int, vocab: int, seed: int):
    import torch

    from ds_ppo.data.prompts import PromptSet

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(BenchTokenizer.FIRST_ORDINARY_ID, vocab, (n, length), generator=g)
    rows = ids.tolist()
    return PromptSet(input_ids=rows, texts=[""] * n, stats={"rows": n, "used": n})
