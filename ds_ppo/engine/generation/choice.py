"""How rollouts are generated, decided once: the generation mode, the decoding loop, and whether
tensor parallelism can split the policy (and why not), from the config and the policy's HF
config. The engine (`engine/generation/__init__.py`) calls `choose_generation` with the device memory it
measures, `ds-ppo plan` (`ds_ppo/plan/`) with the memory of its plan, so the plan promises what
the engine does.

Imports only ds_ppo.config and ds_ppo.errors (torch lazily, for `decoder_linears`), never
deepspeed.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from ds_ppo.config import GenerationConfig
from ds_ppo.config.tensor_parallel_shapes import unshardable
from ds_ppo.errors import ConfigError

Mode = Literal["gathered", "tensor_parallel", "zero3"]
Loop = Literal["own", "hf"]
REPLICA_MODES = ("gathered", "tensor_parallel")  # the modes that decode on a hook-free replica

ATTENTION_KERNELS = ("sdpa", "eager")  # the kernels that take the own loop's 4D masks


def own_loop_unsupported(config) -> str | None:
    """Why our decoding loop (engine/generation/loop.py) cannot serve a model with this HF config, or
    None when it can: its masks are 4D and built for full causal attention."""
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ATTENTION_KERNELS:
        return (f"attention kernel {attn!r} does not take a 4D mask (supported: "
                f"{', '.join(ATTENTION_KERNELS)})")
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"layer types {other} (only full causal attention is supported)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={config.sliding_window})"
    return None


def decoder_linears(model) -> frozenset[str]:
    """Names (last path component) of the linear layers inside a model's decoder layers; a LoRA
    layer (engine/lora.py) counts as its base layer, since the replica holds it merged; an
    expert-parallel (AutoEP) layer's router and experts do not count: the replica holds the
    Hugging Face MoE block it replaced (engine/moe.py)."""
    import torch

    ep = tuple(f"{name}." for name, m in model.named_modules()
               if getattr(m, "_is_autoep_layer", False))
    return frozenset(name.removesuffix(".base_layer").rsplit(".", 1)[-1]
                     for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
                     and ".lora_" not in name and not (ep and name.startswith(ep)))


def choose_loop(cfg: GenerationConfig, mode: str, model_config) -> Loop:
    """Resolve generation.loop for a policy with this HF config: `own` (ds_ppo.engine.generation.loop) or
    `hf` (HF generate). zero3 mode always uses HF generate (it needs synced_gpus).
    generation.continuous=true needs `own`: ConfigError otherwise."""
    loop = _loop(cfg, mode, model_config)
    if cfg.continuous is True and loop == "hf":
        raise ConfigError(f"generation.continuous=true needs our decoding loop, but generation "
                          f"runs with HF generate here (generation.mode={mode}, "
                          f"generation.loop={cfg.loop}); set generation.continuous=auto, or "
                          "generation.loop=own with a replica mode")
    return loop


def use_continuous(cfg: GenerationConfig, loop: str, rows: int) -> bool:
    """Whether generating `rows` rows on a rank (or tensor-parallel group) uses continuous
    batching (engine/generation/loop.py: generation.batch_size slots, refilled as responses end): with
    our loop, when the rows outnumber the slots, unless generation.continuous=false."""
    return (loop == "own" and cfg.continuous is not False and cfg.batch_size is not None
            and cfg.batch_size < rows)


def _loop(cfg: GenerationConfig, mode: str, model_config) -> Loop:
    if mode not in REPLICA_MODES or cfg.loop == "hf":
        return "hf"
    reason = own_loop_unsupported(model_config)
    if cfg.loop == "own":
        if reason:
            raise ConfigError(f"generation.loop=own cannot serve this policy: {reason}; set "
                              "generation.loop=auto (or hf) to use HF generate")
        return "own"
    if reason or cfg.cache_implementation != "dynamic" or cfg.compile:
        return "hf"
    return "own"


@dataclass(frozen=True)
class GenerationChoice:
    """The resolved generation of a run."""

    mode: Mode
    loop: Loop
    tp_size: int  # ranks per tensor-parallel group (generation.tp_size, else a node's GPUs)
    tp_unsupported: str | None  # why tensor_parallel cannot split the policy tp_size ways
    replica_bytes: int | None = None  # mode=auto: bytes per rank of the chosen mode's replica
    free_bytes: float | None = None  # mode=auto: the free memory the choice was made on


def choose_generation(cfg: GenerationConfig, model_config: Any, tp_size: int,
                      replica_bytes: Callable[[int], int], free_bytes: Callable[[], float],
                      linears: Collection[str] | None = None) -> GenerationChoice:
    """Resolve generation.mode and generation.loop for a policy with this HF config
    (`model_config`; None: none, so no tensor parallelism) and `linears` (its
    `decoder_linears`, when known).

    `auto` is decided by memory: `gathered` when the whole replica (`replica_bytes(1)`, bytes
    per rank) fits in generation.replica_memory_fraction of `free_bytes()` (bytes per GPU),
    else `tensor_parallel` when a 1/tp_size shard (`replica_bytes(tp_size)`) does and the
    model splits, else `zero3`. Both callables are called for `auto` only (the engine's free
    memory is a collective). An explicit mode or loop the policy cannot be served by raises
    ConfigError, naming the key and the fix.
    """
    why_not_tp = (unshardable(model_config, tp_size, linears) if model_config is not None
                  else "no HF config")
    need, free = None, None
    if cfg.mode == "tensor_parallel" and why_not_tp:
        raise ConfigError(f"generation.mode=tensor_parallel: {why_not_tp}; set "
                          "generation.tp_size to a divisor of them, or generation.mode=auto")
    if cfg.mode != "auto":
        mode = cfg.mode
    else:
        free = free_bytes()
        budget = cfg.replica_memory_fraction * free
        need = replica_bytes(1)
        shard = replica_bytes(tp_size) if tp_size > 1 and not why_not_tp else None
        if need <= budget:
            mode = "gathered"
        elif shard is not None and shard <= budget:
            mode, need = "tensor_parallel", shard
        else:
            mode = "zero3"
    return GenerationChoice(mode, choose_loop(cfg, mode, model_config), tp_size, why_not_tp,
                            need, free)
