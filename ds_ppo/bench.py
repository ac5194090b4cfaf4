"""`ds-ppo bench` (or `python -m ds_ppo.bench`): time one PPO iteration's phases on one device.

Builds the four roles (policy, value, reference, reward model) of one Llama-shape architecture
with random weights (`--shape 1b`: the 0.85B model of the device notes, hidden 2048, 16 layers,
GQA 16/4 heads, vocab 32000; `--shape tiny` for CPU/CI), feeds random-token prompts of a fixed
length, and runs a warm-up iteration and then `--iterations` PPO iterations through the trainer's
own stage functions (make_rollout, score, add_advantages, ppo_update). Then, on the same batch and
the same weights, three greedy generations: HF generate through the ZeRO-3 hooks (generation mode
`zero3`), plain HF generate on the gathered replica with the default dynamic cache, and ours
(mode `gathered` with the configured cache / compile). It prints one markdown table and one JSON
line (also written to `--json FILE`).

Counting (each formula in FlopModel):
- tokens: generation = new tokens; scoring and training = sequence tokens (prompt + response),
  each of which goes through 3-4 models (scoring) or 2 models x ppo_epochs (training).
- FLOPs are model FLOPs (MFU, not hardware FLOPs: no recomputation is counted): 2 per
  non-embedding parameter per token, plus causal attention, plus the output head where logits
  are computed; backward = 2x forward.
- MFU = achieved TFLOP/s / the peak this run measures itself (a large matmul in the compute
  dtype), or `--device-peak-tflops`.

Responses always have exactly `--new-tokens` tokens (min_new_tokens = max_new_tokens), so every
run of a shape does the same work. Nothing here imports mlflow or datasets (tracking is off and
prompts are random ids), so it runs on an image that has neither.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("ds_ppo.bench")

# Per shape: the architecture and the default batch. `1b` is the 0.85B model the device notes
# measured (untied embeddings); `tiny` runs in seconds on a CPU.
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
}
# The targets on the H200 (ratios: ours / baseline tok/s; MFU: fraction of peak).
TARGETS = {"generation_vs_hooks": 20.0, "generation_vs_plain": 5.0, "training_mfu": 0.35,
           "end_to_end_mfu": 0.25}
ROLES = ("policy", "value", "reference", "reward")


# --------------------------------------------------------------------------- tokenizer
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
        return {"<pad>": 0, "<s>": 1, "</s>": 2}

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


# ------------------------------------------------------------------------------- FLOPs
@dataclass(frozen=True)
class FlopModel:
    """What the FLOP count needs of the one architecture all four roles share."""

    body_params: int  # parameters outside the token embedding and the output head
    layers: int
    attn_width: int  # num_attention_heads * head_dim (query width; GQA does not change it)
    hidden: int
    vocab: int

    def forward(self, seq_len: int, head_positions: int, head_width: int) -> float:
        """FLOPs of one forward over one sequence of `seq_len` tokens.

        2 per body parameter per token (a multiply-add; Kaplan et al. 2020, PaLM App. B), plus
        attention scores QK^T and the weighted sum AV, 2 * attn_width FLOPs per (query, key) pair
        each, counted causally (query i sees keys 1..i: S(S+1)/2 pairs; PaLM's 12*L*H*Q*T counts
        all S^2), plus the output head (hidden x head_width) at `head_positions` positions
        (logits_to_keep for the policy, every position for the value head, one for a reward).
        """
        body = 2 * self.body_params * seq_len
        attention = 2 * self.layers * self.attn_width * seq_len * (seq_len + 1)
        head = 2 * self.hidden * head_width * head_positions
        return float(body + attention + head)

    def generate(self, prompt_len: int, new_tokens: int) -> float:
        """FLOPs of generating `new_tokens` after one prompt with a KV cache: a prefill of the
        prompt (logits at its last position only) and new_tokens - 1 one-token steps, step k
        attending to prompt_len + k keys. Equals forward(prompt_len + new_tokens - 1,
        new_tokens, vocab): the cache saves recomputation, not counted work."""
        if new_tokens <= 0:
            return 0.0
        steps = new_tokens - 1
        keys = steps * prompt_len + steps * (steps + 1) // 2
        return (self.forward(prompt_len, 1, self.vocab)
                + steps * (2 * self.body_params + 2 * self.hidden * self.vocab)
                + 4 * self.layers * self.attn_width * keys)

    def scoring(self, prompt_len: int, new_tokens: int, reward_model: bool) -> float:
        """One sequence's scoring forwards: policy and reference log-probs (logits at T + 1
        positions), the value head at every position, and the reward model at the last."""
        S, T = prompt_len + new_tokens, new_tokens
        flops = 2 * self.forward(S, T + 1, self.vocab) + self.forward(S, S, 1)
        return flops + (self.forward(S, 1, 1) if reward_model else 0.0)

    def training(self, prompt_len: int, new_tokens: int, ppo_epochs: int) -> float:
        """One sequence's PPO update: forward + backward (2x forward) of policy and value, per
        epoch. Gradient checkpointing's recomputed forward is not counted (model FLOPs)."""
        S, T = prompt_len + new_tokens, new_tokens
        return ppo_epochs * 3 * (self.forward(S, T + 1, self.vocab) + self.forward(S, S, 1))


def flop_model(model) -> FlopModel:
    """The FlopModel of an HF causal LM (parameters counted as ZeRO-3's full sizes)."""
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    body = sum(numel(p) for p in model.parameters()) - numel(embedding)
    if head is not None and head.weight is not embedding:
        body -= numel(head.weight)
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return FlopModel(body_params=body, layers=c.num_hidden_layers,
                     attn_width=c.num_attention_heads * head_dim, hidden=c.hidden_size,
                     vocab=c.vocab_size)


# ------------------------------------------------------------------------ measurements
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _measured(device, into: dict):
    """Wall seconds (device synchronised) and, on CUDA, the peak allocated memory in GiB."""
    import torch

    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    yield into
    _sync(device)
    into["seconds"] = time.perf_counter() - t0
    into["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30
                            if device.type == "cuda" else None)


def measure_peak_tflops(device, dtype, size: int | None = None, reps: int = 10) -> float:
    """TFLOP/s of a (size x size) @ (size x size) matmul in `dtype`: the MFU denominator.
    8192 on a GPU (~1.1 TFLOP per product), 1024 on a CPU."""
    import torch

    size = size or (8192 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - t0) / reps
    return 2 * size**3 / seconds / 1e12


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (0 if it never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


# ------------------------------------------------------------------------------ set-up
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ds-ppo bench", description="Time a PPO iteration's phases (generation, scoring, "
        "training) and generation baselines on one device; prints one table and a JSON line.")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape (default: 1b on a GPU, tiny on CPU)")
    p.add_argument("--prompts", type=int, help="prompts per iteration (1b: 64, tiny: 4)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (1b: 256, tiny: 8)")
    p.add_argument("--new-tokens", type=int, help="response tokens (1b: 256, tiny: 8)")
    p.add_argument("--iterations", type=int, help="timed PPO iterations (1b: 3, tiny: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first (compile, "
                   "allocator, cuBLAS heuristics)")
    p.add_argument("--micro-batch", type=int, help="ppo.micro_batch_size (1b: 16, tiny: 2)")
    p.add_argument("--score-micro-batch", type=int,
                   help="ppo.score_micro_batch_size (1b: 32, tiny: 4)")
    p.add_argument("--mini-batch", type=int, help="ppo.mini_batch_size (default: --prompts, "
                   "one optimizer step per epoch)")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--gen-loop", choices=["own", "hf"], default="own",
                   help="generation.loop of our gathered generation: own (static cache, CUDA "
                   "graph, no per-token sync) or hf (HF generate)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="generation.cuda_graph (--gen-loop own, CUDA only)")
    p.add_argument("--gen-cache", choices=["dynamic", "static"], default=None,
                   help="--gen-loop hf: KV cache (default: static on GPU, dynamic on CPU)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="--gen-loop hf: generation.compile (default: on with a GPU)")
    p.add_argument("--attn", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa",
                   help="attention kernel of every role")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="policy and value recompute activations in backward")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=3,
                   help="ZeRO stage of every role (the hooks baseline needs 3)")
    p.add_argument("--persistence-threshold", type=float, default=None,
                   help="stage3_param_persistence_threshold of every role (default: the "
                   "template's; 1e9 keeps every parameter whole on one GPU)")
    p.add_argument("--prefetch-bucket-size", type=float, default=None,
                   help="stage3_prefetch_bucket_size of every role (default: the template's)")
    p.add_argument("--reward", choices=["model", "function"], default="model",
                   help="model: a 4th model of the same shape; function: a free Python reward")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any ds_ppo config override, e.g. --set ppo.ppo_epochs=2 (repeatable)")
    p.add_argument("--device-peak-tflops", type=float, default=None,
                   help="MFU denominator; skips the matmul measurement")
    p.add_argument("--baseline-new-tokens", type=int, default=None,
                   help="new tokens of the slow hooks baseline (default: min(new tokens, 32)); "
                   "tok/s is what is compared")
    p.add_argument("--skip-baselines", action="store_true",
                   help="no hooks / plain generation baselines (and no greedy match check)")
    p.add_argument("--output-dir", default=None,
                   help="keep the random-init weights here and reuse them in later runs of the "
                   "same shape (default: a temporary directory, removed at the end)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                   help="run nothing: print one comparison row per earlier --json result")
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
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
                "persistence_threshold", "prefetch_bucket_size", "reward", "seed", "overrides"):
        s[key] = getattr(args, key)
    return s


def _ds_templates(s: dict, run_dir: Path) -> dict[str, str]:
    """Copies of the default DeepSpeed templates with --persistence-threshold /
    --prefetch-bucket-size set (ZeRO-3 only); role -> path. Empty when neither is given."""
    if s["zero_stage"] != 3 or (s["persistence_threshold"] is None
                                and s["prefetch_bucket_size"] is None):
        return {}
    from ds_ppo.ds_templates import default_template, load_template

    paths = {}
    for role in ROLES:
        ds = load_template(default_template(role, 3))
        zero = ds.setdefault("zero_optimization", {})
        if s["persistence_threshold"] is not None:
            zero["stage3_param_persistence_threshold"] = int(s["persistence_threshold"])
        if s["prefetch_bucket_size"] is not None:
            zero["stage3_prefetch_bucket_size"] = int(s["prefetch_bucket_size"])
        path = run_dir / f"ds_{role}.json"
        path.write_text(json.dumps(ds, indent=2))
        paths[role] = str(path)
    return paths


def build_config(s: dict, run_dir: Path):
    """The ds_ppo Config of this benchmark (written to run_dir/bench_config.yaml, then loaded
    and validated as any run's config is)."""
    import yaml

    from ds_ppo.config import load_config, validate
    from ds_ppo.engine import dist

    P, T = s["prompt_len"], s["new_tokens"]
    role_ds = {"zero_stage": s["zero_stage"], "offload_param": False, "offload_optimizer": False}
    templates = _ds_templates(s, run_dir)
    model = {"attn_implementation": s["attn"], "dtype": "auto",
             "gradient_checkpointing": s["gradient_checkpointing"]}
    if s["reward"] == "model":  # a 4th model: the policy's random-init directory as a classifier
        reward = {"model": str(run_dir / "init_models" / "policy"), "max_len": P + T}
    else:
        reward = {"function": "ds_ppo.bench:length_reward"}
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
                       "keep_replica": s["gen_loop"] == "hf" and (
                           s["gen_cache"] == "static" or s["compile"])},
        "ppo": {"rollout_batch_size": s["prompts"], "mini_batch_size": s["mini_batch"],
                "micro_batch_size": s["micro_batch"],
                "score_micro_batch_size": s["score_micro_batch"], "ppo_epochs": s["ppo_epochs"]},
        "data": {"max_prompt_len": P},
        "tracking": {"enabled": False},
        "checkpoint": {"every": 0, "save_at_end": False, "export_at_end": False},
        "deepspeed": {role: dict(role_ds, **({"config": templates[role]} if role in templates
                                             else {})) for role in ROLES},
    }
    path = run_dir / "bench_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path, s["overrides"])
    validate(cfg, dist.world_size())
    return cfg


def _settings_from(cfg) -> dict[str, Any]:
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


def _run_dir(root: Path, s: dict) -> Path:
    """One directory per architecture and seed, so a kept --output-dir reuses the weights."""
    key = json.dumps({"arch": s["arch"], "seed": s["seed"]}, sort_keys=True)
    run_dir = root / f"{s['shape']}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _random_prompts(n: int, length: int, vocab: int, seed: int):
    import torch

    from ds_ppo.data.prompts import PromptSet

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(BenchTokenizer.FIRST_ORDINARY_ID, vocab, (n, length), generator=g)
    rows = ids.tolist()
    return PromptSet(input_ids=rows, texts=[""] * n, stats={"rows": n, "used": n})


# -------------------------------------------------------------------------------- runs
def _ppo_iterations(cfg, engines, tok, s: dict) -> list[dict]:
    """Warm-up + timed iterations through the trainer's stage functions; one record each."""
    from ds_ppo.data.reencode import rollout_for_reward
    from ds_ppo.metrics import Accumulator
    from ds_ppo.rollout import make_rollout, stop_token_ids
    from ds_ppo.scoring import add_advantages, score
    from ds_ppo.update import ppo_update

    device = engines.device
    prompts = _random_prompts(s["prompts"], s["prompt_len"], len(tok), s["seed"])
    indices = list(range(len(prompts)))
    eos_ids = stop_token_ids(tok, cfg)
    reward_encode = None
    if cfg.reward.model is not None:
        def reward_encode(rollout):  # one tokenizer for all roles: the rollout's own ids
            return rollout_for_reward(rollout, cfg.reward.max_len, tok.bos_token_id)

    records = []
    for it in range(s["warmup"] + s["iterations"]):
        rec = {"warmup": it < s["warmup"], "graphs_before": _compiled_graphs()}
        with _measured(device, rec.setdefault("generation", {})):
            rollout, gen = make_rollout(prompts, indices, engines, cfg, tok, "gathered", eos_ids)
        rec["generation"].update(_loop_info(gen))
        rec["generation"]["new_tokens"] = int(rollout.mask.sum())
        rec["generation"]["width"] = int(rollout.response_ids.shape[1])
        with _measured(device, rec.setdefault("scoring", {})):
            exp = score(rollout, engines, cfg, reward_encode)
        with _measured(device, rec.setdefault("advantages", {})):
            exp = add_advantages(exp, cfg, cfg.ppo.kl_coef)
        with _measured(device, rec.setdefault("training", {})):
            ppo_update(exp, engines, cfg, it + 1, Accumulator())
        rec["graphs_built"] = _compiled_graphs() - rec.pop("graphs_before")
        records.append(rec)
        log.info("iteration %d%s: generation %.3fs, scoring %.3fs, training %.3fs%s", it + 1,
                 " (warm-up)" if rec["warmup"] else "", rec["generation"]["seconds"],
                 rec["scoring"]["seconds"], rec["training"]["seconds"],
                 f", {rec['graphs_built']} graphs compiled" if rec["graphs_built"] else "")
    return records


def _loop_info(gen) -> dict:
    """Which decoding loop ran and whether its steps were CUDA-graph replays."""
    errors = [st.graph_error for st in gen.decode_stats if st.graph_error]
    return {"loop": gen.loop,
            "cuda_graph": bool(gen.decode_stats) and all(st.graph for st in gen.decode_stats),
            "graph_error": errors[0] if errors else None}


def _replica_build_seconds(engines) -> float:
    """Seconds to gather the policy into a generation replica (the replica is dropped)."""
    from ds_ppo.engine.generation import build_replica

    rec: dict[str, Any] = {}
    with _measured(engines.device, rec):
        build_replica(engines.policy.module, engines.dtype, engines.device)
    return rec["seconds"]


def _generation_compare(cfg, engines, tok, s: dict) -> dict:
    """Greedy generation of the same prompts by the hooks path, plain HF generate (dynamic
    cache) and ours; each timed as the trainer pays it (a gathered run includes the replica
    build, timed once on its own as well)."""
    import torch

    from ds_ppo.data.prompts import left_pad
    from ds_ppo.engine.generation import generate
    from ds_ppo.rollout import stop_token_ids

    device, dtype = engines.device, engines.dtype
    prompts = _random_prompts(s["prompts"], s["prompt_len"], len(tok), s["seed"])
    ids, am = left_pad(prompts.input_ids, tok.pad_token_id)
    ids, am = ids.to(device), am.to(device).bool()
    eos_ids = stop_token_ids(tok, cfg)
    greedy = cfg.generation.model_copy(update={"temperature": 0.0})
    plain = greedy.model_copy(update={"loop": "hf", "cache_implementation": "dynamic",
                                      "compile": False, "keep_replica": False})
    bn = s["baseline_new_tokens"]
    hooks = plain.model_copy(update={"max_new_tokens": bn, "min_new_tokens": bn})

    def run(gen_cfg, mode: str, run_dtype=dtype, n: int | None = None) -> tuple[dict, Any]:
        rec: dict[str, Any] = {}
        with _measured(device, rec):
            out = generate(engines.policy, ids[:n], am[:n], gen_cfg, mode, eos_ids,
                           tok.pad_token_id, run_dtype,
                           kept_replica=engines.replica if gen_cfg.keep_replica else None)
        if gen_cfg.keep_replica:
            engines.replica = out.replica
        rec.update(_loop_info(out))
        rec["new_tokens"] = int(out.mask.sum())
        rec["width"] = int(out.response_ids.shape[1])
        return rec, out.response_ids

    res: dict[str, Any] = {"replica_build_s": _replica_build_seconds(engines)}
    log.info("generation baselines: plain HF generate, dynamic cache ...")
    res["plain"], plain_ids = run(plain, "gathered")
    log.info("generation: ours, greedy (loop %s) ...", greedy.loop)
    first, ours_ids = run(greedy, "gathered")  # any compile for greedy decoding happens here
    res["ours"], ours_ids2 = run(greedy, "gathered")
    res["ours"]["first_call_s"] = first["seconds"]
    # Last: HF generate through the hooks leaves prefetched parameters in flight, and a
    # GatheredParameters (build_replica) on them afterwards fails ("Cannot partition a param in
    # flight"); empty_partition_cache waits for them and releases them.
    log.info("generation baselines: hooks path (%d new tokens) ...", bn)
    res["hooks"], _ = run(hooks, "zero3")
    engines.policy.empty_partition_cache()
    res.update(_greedy_agreement(plain_ids, ours_ids, ours_ids2))
    # In 16-bit with random weights the top logits of a step differ by less than the rounding
    # of two kernels' sums, so greedy paths of two correct implementations can fork. Whether
    # ours computes the same thing is checked in fp32, on a few prompts and tokens:
    n, t = min(8, len(ids)), min(s["new_tokens"], 32)
    exact = {"max_new_tokens": t, "min_new_tokens": t, "keep_replica": False}
    log.info("generation: greedy check in float32 (%d prompts x %d tokens) ...", n, t)
    _, plain32 = run(plain.model_copy(update=exact), "gathered", torch.float32, n)
    _, ours32 = run(greedy.model_copy(update=exact), "gathered", torch.float32, n)
    res["greedy_fp32"] = {"prompts": n, "new_tokens": t,
                          **_greedy_agreement(plain32, ours32, ours32)}
    return res


def _greedy_agreement(plain, ours, ours_again) -> dict:
    """Token agreement of two greedy outputs (B, T): all equal (and ours reproducible), the
    share of equal tokens and the mean length of the common prefix."""
    import torch

    if plain.shape != ours.shape:
        return {"greedy_match": False, "greedy_match_fraction": 0.0, "common_prefix": 0.0}
    equal = plain == ours
    prefix = equal.long().cumprod(dim=-1).sum(dim=-1).float().mean()
    return {"greedy_match": bool(equal.all() and torch.equal(ours, ours_again)),
            "greedy_match_fraction": float(equal.float().mean()),
            "common_prefix": float(prefix)}


# ----------------------------------------------------------------------------- results
def _phase_summary(records: list[dict], name: str, tokens: float, flops: float,
                   peak_tflops: float) -> dict:
    timed = [r for r in records if not r["warmup"]] or records
    per_it = [r[name]["seconds"] for r in timed]
    seconds = sum(per_it) / len(per_it)
    mems = [r[name]["peak_mem_gib"] for r in timed if r[name]["peak_mem_gib"] is not None]
    return _rates({"seconds": seconds, "per_iteration_s": per_it,
                   "peak_mem_gib": max(mems) if mems else None}, tokens, flops, peak_tflops)


def _rates(rec: dict, tokens: float, flops: float, peak_tflops: float) -> dict:
    s = max(rec["seconds"], 1e-12)
    rec.update(tokens=tokens, tokens_per_s=tokens / s, tflop=flops / 1e12,
               tflops=flops / 1e12 / s)
    rec["mfu"] = rec["tflops"] / peak_tflops if peak_tflops > 0 else math.nan
    return rec


def summarize(s: dict, fm: FlopModel, records: list[dict], compare: dict | None,
              peak_tflops: float) -> dict:
    """Per-phase seconds, tokens/s, TFLOP/s and MFU (mean over the timed iterations)."""
    B, P = s["prompts"], s["prompt_len"]
    T = records[-1]["generation"]["width"]
    S = P + T
    reward_model = s["reward"] == "model"
    flops = {"generation": B * fm.generate(P, T),
             "scoring": B * fm.scoring(P, T, reward_model),
             "advantages": 0.0,
             "training": B * fm.training(P, T, s["ppo_epochs"])}
    tokens = {"generation": float(records[-1]["generation"]["new_tokens"]),
              "scoring": float(B * S), "advantages": float(B * S),
              "training": float(B * S * s["ppo_epochs"])}
    phases = {name: _phase_summary(records, name, tokens[name], flops[name], peak_tflops)
              for name in flops}
    total_s = sum(p["seconds"] for p in phases.values())
    mems = [p["peak_mem_gib"] for p in phases.values() if p["peak_mem_gib"] is not None]
    phases["end_to_end"] = _rates(
        {"seconds": total_s, "peak_mem_gib": max(mems) if mems else None},
        tokens["generation"], sum(flops.values()), peak_tflops)
    out = {"phases": phases}
    if compare is not None:
        for key in ("hooks", "plain", "ours"):
            r = compare[key]
            _rates(r, float(r["new_tokens"]), B * fm.generate(P, r["width"]), peak_tflops)
        ours = compare["ours"]["tokens_per_s"]
        compare["ratio_vs_hooks"] = ours / compare["hooks"]["tokens_per_s"]
        compare["ratio_vs_plain"] = ours / compare["plain"]["tokens_per_s"]
        out["generation_compare"] = compare
    out["targets"] = {
        "generation_vs_hooks": {"target": TARGETS["generation_vs_hooks"],
                                "value": compare["ratio_vs_hooks"] if compare else None},
        "generation_vs_plain": {"target": TARGETS["generation_vs_plain"],
                                "value": compare["ratio_vs_plain"] if compare else None},
        "training_mfu": {"target": TARGETS["training_mfu"], "value": phases["training"]["mfu"]},
        "end_to_end_mfu": {"target": TARGETS["end_to_end_mfu"],
                           "value": phases["end_to_end"]["mfu"]},
    }
    for t in out["targets"].values():
        t["met"] = None if t["value"] is None else bool(t["value"] >= t["target"])
    return out


def _loop_label(s: dict, info: dict) -> str:
    """What our generation ran: the loop, its cache, and CUDA graph or compile."""
    if info.get("loop") == "own":
        return "own loop, static cache" + (" + CUDA graph" if info.get("cuda_graph") else "")
    return "HF generate, " + s["gen_cache"] + (" cache + compile" if s["compile"] else " cache")


def _fmt(x, kind: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if kind == "s":
        return f"{x:.3f}" if x < 100 else f"{x:.0f}"
    if kind == "int":
        return f"{x:,.0f}"
    if kind == "tflops":
        return f"{x:.1f}" if x >= 10 else f"{x:.3g}"
    if kind == "pct":
        return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2g}%"
    if kind == "gib":
        return f"{x:.1f}"
    if kind == "x":
        return f"{x:.2f}x"
    return str(x)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def format_table(result: dict) -> str:
    """The one markdown table (phases, end-to-end, generation baselines and ratios) and the
    lines that say what it was run on."""
    s, ph, cmp_ = result["settings"], result["phases"], result.get("generation_compare")
    gen_kind = _loop_label(s, result["iterations"][-1]["generation"])
    lines = [
        f"ds-ppo bench, {result['date']}, {result['device']['name']}: shape {s['shape']} "
        f"({_params(result['model']['params_total'])} params x 4 roles, {result['dtype']}), "
        f"{s['prompts']} prompts x {s['prompt_len']} prompt + {s['new_tokens']} new tokens, "
        f"micro-batch {s['micro_batch']} (scoring {s['score_micro_batch']}), "
        f"ZeRO-{s['zero_stage']}, "
        f"mean of {s['iterations']} iteration(s) after {s['warmup']} warm-up",
        f"peak {result['peak_tflops']:.4g} TFLOP/s ({result['peak_source']})",
        "",
        "| phase | seconds | tokens | tok/s | TFLOP/s | MFU | peak mem GiB | vs hooks | vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(label, r, vs_hooks=None, vs_plain=None):
        lines.append(
            f"| {label} | {_fmt(r['seconds'], 's')} | {_fmt(r['tokens'], 'int')} | "
            f"{_fmt(r['tokens_per_s'], 'int')} | {_fmt(r['tflops'], 'tflops')} | "
            f"{_fmt(r['mfu'], 'pct')} | {_fmt(r.get('peak_mem_gib'), 'gib')} | "
            f"{_fmt(vs_hooks, 'x')} | {_fmt(vs_plain, 'x')} |")

    reward = "+reward" if s["reward"] == "model" else ""
    row(f"generation (gathered, {gen_kind}, sampled)", ph["generation"])
    row(f"scoring (policy+ref+value{reward} fwd)", ph["scoring"])
    epochs = f"{s['ppo_epochs']} epoch" + ("s" if s["ppo_epochs"] > 1 else "")
    row(f"training (policy+value fwd+bwd, {epochs})", ph["training"])
    row("end-to-end iteration (incl. advantages)", ph["end_to_end"])
    if cmp_ is not None:
        row(f"greedy gen: hooks path (ZeRO-3 HF generate, {cmp_['hooks']['width']} new)",
            cmp_["hooks"])
        row("greedy gen: plain HF generate (dynamic cache)", cmp_["plain"])
        row(f"greedy gen: ours (gathered, {_loop_label(s, cmp_['ours'])})", cmp_["ours"],
            cmp_["ratio_vs_hooks"], cmp_["ratio_vs_plain"])
    lines.append("")
    if cmp_ is not None:
        lines.append(
            f"greedy outputs ours == plain: {'yes' if cmp_['greedy_match'] else 'NO'} "
            f"({100 * cmp_['greedy_match_fraction']:.1f}% of tokens, common prefix "
            f"{cmp_['common_prefix']:.1f} tokens); in float32 ({cmp_['greedy_fp32']['prompts']} "
            f"prompts x {cmp_['greedy_fp32']['new_tokens']} tokens): "
            f"{'yes' if cmp_['greedy_fp32']['greedy_match'] else 'NO'}; replica build "
            f"{cmp_['replica_build_s']:.3f}s (inside every gathered row); ours' first call "
            f"{cmp_['ours']['first_call_s']:.3f}s")
        if cmp_["ours"].get("graph_error"):
            lines.append(f"CUDA graph capture FAILED, decoding ran eagerly: "
                         f"{cmp_['ours']['graph_error']}")
    else:
        lines.append("generation baselines skipped (--skip-baselines)")
    if result.get("peak_rss_gib") is not None:
        lines.append(f"peak RSS {result['peak_rss_gib']:.2f} GiB (CPU run: per-phase memory is "
                     "measured on CUDA only)")
    targets = ", ".join(
        f"{k} {_fmt(t['value'], 'x' if 'vs' in k else 'pct')} (target "
        f"{_fmt(t['target'], 'x' if 'vs' in k else 'pct')})" for k, t in result["targets"].items())
    lines.append(f"targets (H200): {targets}")
    return "\n".join(lines)


def summary_table(results: list[tuple[str, dict]]) -> str:
    """One row per bench result (name, JSON dict): the numbers the issue's targets are about."""
    lines = ["| run | settings | gen tok/s (sampled) | ours greedy tok/s | vs hooks | vs plain "
             "| greedy == plain (fp32) | training MFU | end-to-end MFU | peak mem GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results:
        s, ph, c = r["settings"], r["phases"], r.get("generation_compare")
        gen = r["iterations"][-1]["generation"]
        settings = (f"ZeRO-{s['zero_stage']}, micro {s['micro_batch']}, "
                    f"{_loop_label(s, gen)}"
                    + (f", persistence {s['persistence_threshold']:.0e}"
                       if s.get("persistence_threshold") is not None else ""))
        match = "-"
        if c is not None:
            yes = {True: "yes", False: "no"}
            match = f"{yes[c['greedy_match']]} ({yes[c['greedy_fp32']['greedy_match']]})"
        lines.append(
            f"| {name} | {settings} | {_fmt(ph['generation']['tokens_per_s'], 'int')} | "
            f"{_fmt(c['ours']['tokens_per_s'] if c else None, 'int')} | "
            f"{_fmt(c['ratio_vs_hooks'] if c else None, 'x')} | "
            f"{_fmt(c['ratio_vs_plain'] if c else None, 'x')} | {match} | "
            f"{_fmt(ph['training']['mfu'], 'pct')} | {_fmt(ph['end_to_end']['mfu'], 'pct')} | "
            f"{_fmt(ph['end_to_end'].get('peak_mem_gib'), 'gib')} |")
    return "\n".join(lines)


def _device_info(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30}
    return {"type": "cpu", "name": f"CPU ({os.cpu_count()} cores, {platform.machine()})",
            "threads": torch.get_num_threads()}


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "deepspeed", "ds-ppo"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _setup_logging() -> None:
    import warnings

    logging.basicConfig(level=logging.INFO, format="[bench] %(message)s", stream=sys.stderr,
                        force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated")
    import transformers

    transformers.logging.set_verbosity_error()


def run(args: argparse.Namespace) -> dict:
    """Build the roles, run the iterations and baselines; the result dict (see format_table)."""
    import torch

    from ds_ppo.engine.dist import init_distributed
    from ds_ppo.engine.roles import init_engines

    t_start = time.perf_counter()
    device = init_distributed()
    s = _resolve(args, device.type == "cuda")
    root = Path(args.output_dir) if args.output_dir else Path(
        tempfile.mkdtemp(prefix="ds_ppo_bench_"))
    try:
        run_dir = _run_dir(root, s)
        cfg = build_config(s, run_dir)
        s.update(_settings_from(cfg))  # --set overrides count too
        torch.manual_seed(s["seed"])
        tok = BenchTokenizer(s["arch"]["vocab_size"])
        log.info("building 4 roles of shape %s in %s ...", s["shape"], run_dir)
        engines = init_engines(cfg, tok, device)
        fm = flop_model(engines.policy.module)
        dtype_name = str(engines.dtype).replace("torch.", "")
        if args.device_peak_tflops:
            peak, peak_source = args.device_peak_tflops, "--device-peak-tflops"
        else:
            peak = measure_peak_tflops(device, engines.dtype)
            size = 8192 if device.type == "cuda" else 1024
            peak_source = f"measured: {dtype_name} {size}^3 matmul"
        t_ready = time.perf_counter()
        records = _ppo_iterations(cfg, engines, tok, s)
        compare = None if args.skip_baselines else _generation_compare(cfg, engines, tok, s)
        result = {
            "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": "ds-ppo bench " + " ".join(args._argv),
            "device": _device_info(device), "versions": _versions(), "dtype": dtype_name,
            "settings": {k: v for k, v in s.items() if k != "arch"},
            "model": {"arch": s["arch"], "params_total": sum(
                int(getattr(p, "ds_numel", p.numel())) for p in engines.policy.module.parameters()),
                "body_params": fm.body_params},
            "peak_tflops": peak, "peak_source": peak_source,
            "iterations": records,
            **summarize(s, fm, records, compare, peak),
            "setup_s": t_ready - t_start, "total_s": time.perf_counter() - t_start,
        }
        if device.type != "cuda":
            import resource

            result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        # what the bench path imported: neither may be needed (the GPU image has neither)
        result["imported_mlflow"] = "mlflow" in sys.modules
        result["imported_datasets"] = "datasets" in sys.modules
        return result
    finally:
        if not args.output_dir:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `ds-ppo bench -- --shape tiny`: the CLI passes the separator on
        argv = argv[1:]
    args = parse_args(argv)
    args._argv = argv
    if args.summarize:
        print(summary_table([(Path(f).stem, json.loads(Path(f).read_text()))
                             for f in args.summarize]))
        return 0
    _setup_logging()
    from ds_ppo.errors import UserError

    try:
        result = run(args)
    except UserError as e:  # e.g. --prompts not divisible by --micro-batch
        print(f"ds-ppo bench: error: {e}", file=sys.stderr)
        return e.exit_code
    print(format_table(result), flush=True)
    line = json.dumps(result, default=float)
    if args.json_path:
        Path(args.json_path).write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
