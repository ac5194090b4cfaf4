"""LoRA (Hu et al. 2021, built with peft) on the ZeRO-3 roles.

- `add_adapters`: wraps a loaded (ZeRO-3-partitioned) HF model in a peft model. The base stays
  frozen and sharded as before; the new adapter layers are ordinary parameters, which
  `deepspeed.initialize` converts to ZeRO-3 parameters (broadcast from rank 0, then sharded).
  Only the adapters (and a value model's scalar head) have `requires_grad`, so only they get
  gradients and optimizer state.
- `AdaptersOff`: the reference role read from the policy engine with its adapters switched off:
  the untouched base, no second copy of it.
- `replica_weights`: the weights of the plain HF model a generation replica or an export holds,
  with every adapted layer merged (W + alpha / r x B A), so decoding runs on a hook-free model;
  `adapter_weights`: those a weight sync after the first refreshes, merged from a copy of the
  frozen base the replica keeps (`keep_bases`), so only the adapters are gathered.
- `save_adapters`: a checkpoint's PEFT directory (adapter_config.json + safetensors), which
  `ds-ppo export` merges into the base or copies as it is (`--adapter-only`).
- `base_fingerprint`: config and weight-file headers of a base model, recorded in the trainer
  state; a resume whose base files changed stops (its adapters were trained on other weights).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, Iterator

import torch

from ds_ppo.engine import dist
from ds_ppo.role_names import TRAINED_ROLES

log = logging.getLogger("ds_ppo")
ADAPTER = "default"  # peft's adapter name; ds_ppo trains one adapter per role


def adapts_output_head(lora_cfg, random_init: bool, model: torch.nn.Module,
                       path: str | None = None) -> bool:
    """policy.lora.output_head resolved for `model` (`config.lora_output_head`). With auto, a
    model loaded from a local `path` counts as random-init when its saved head looks it
    (`head_looks_random_init`)."""
    from ds_ppo.config import lora_output_head

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if (lora_cfg.output_head == "auto" and not random_init and not tied and path is not None
            and Path(path).is_dir()):
        head = next((f"{name}.weight" for name, m in model.named_modules()
                     if m is model.get_output_embeddings()), None)
        why = head_looks_random_init(Path(path), head, model.config) if head else None
        if why:
            random_init = True
            if dist.is_main():
                log.info("policy.lora.output_head auto: the output head of %s looks randomly "
                         "initialised (%s); adapting it as well", path, why)
    return lora_output_head(lora_cfg, random_init, tied)


def head_looks_random_init(path: Path, name: str, config) -> str | None:
    """Why the weight `name` saved under `path` (safetensors) looks freshly initialised, or None.
    HF initialises an untied head as N(0, initializer_range^2): then its std is within 5% of
    initializer_range, its mean near 0, and its rows' norms all alike (coefficient of variation
    about 1 / sqrt(2 x hidden size)). A trained head's rows (frequent against rare tokens)
    differ far more, so all three holding is taken as a random-init head."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    files = ([path / json.loads(index.read_text())["weight_map"].get(name, "-")]
             if index.is_file() else [path / "model.safetensors"])
    if not files[0].is_file() or name not in json.loads(_safetensors_header(files[0])):
        return None  # weights in another format (.bin): not looked at
    with safe_open(str(files[0]), framework="pt") as f:
        w = f.get_tensor(name).float()
    sigma = float(getattr(config, "initializer_range", 0.02) or 0.02)
    std, mean = float(w.std()), float(w.mean())
    norms = w.norm(dim=1)
    cv = float(norms.std() / norms.mean())
    limit = 2.0 / (2 * w.shape[1]) ** 0.5
    if abs(std / sigma - 1) < 0.05 and abs(mean) < 0.1 * std and cv < limit:
        return (f"weight std {std:.4f} ~ initializer_range {sigma:g}, row-norm variation "
                f"{cv:.3f} < {limit:.3f}")
    return None


def _targets(model: torch.nn.Module, lora_cfg, output_head: bool) -> list[str] | str:
    """peft's target_modules: the configured ones, plus the output head when `output_head`
    (`all-linear` spelled out as peft resolves it, every Linear/Conv1D module, head included)."""
    if not output_head:
        return lora_cfg.target_modules
    from transformers.pytorch_utils import Conv1D

    out = model.get_output_embeddings()
    head = next(name for name, m in model.named_modules() if m is out)
    if lora_cfg.target_modules == "all-linear":
        return [name for name, m in model.named_modules()
                if isinstance(m, (torch.nn.Linear, Conv1D))]
    return list(dict.fromkeys([*lora_cfg.target_modules, head]))


def add_adapters(model: torch.nn.Module, lora_cfg, seed: int, head: str | None = None,
                 causal_lm: bool = True, output_head: bool = False) -> torch.nn.Module:
    """`model` with LoRA adapters on `lora_cfg.target_modules` (and on the output head with
    `output_head`, see `adapts_output_head`), everything else frozen but the `head` module (a
    value model's scalar head: trained fully, never adapted). The adapters start at B = 0
    (peft's default), so the wrapped model computes exactly what the base does; A's random
    initialisation is drawn from `seed` alone, the same on every rank."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=_targets(model, lora_cfg, output_head), bias="none",
                        exclude_modules=[head] if head else None,
                        task_type="CAUSAL_LM" if causal_lm else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # autocast_adapter_dtype=False: adapters in the model's dtype, as the base (DeepSpeed
        # keeps the fp32 master copy in its optimizer)
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    if head:
        getattr(peft_model.get_base_model(), head).requires_grad_(True)
    return peft_model


def is_lora(module: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(module, PeftModel)


def plain_model(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a peft wrapper (adapter layers still in it), else `module` itself."""
    return module.get_base_model() if is_lora(module) else module


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def count_params(params) -> int:
    """Elements of (possibly ZeRO-3-partitioned) parameters, full sizes."""
    return int(sum(getattr(p, "ds_numel", p.numel()) for p in params))


class AdaptersOff:
    """The reference role when it is the LoRA policy's base: a forward of the policy engine with
    its adapters switched off, so the log-probs are exactly those of the untouched base model.
    Called like an engine: `AdaptersOff(policy)(input_ids=..., ...)`."""

    def __init__(self, policy_engine):
        self.engine = policy_engine

    def adapters_off(self):
        """The context in which the policy's adapters are off (also for calls of its output head
        outside the forward: forward.py's tiled log-probs)."""
        return self.engine.module.disable_adapter()

    def __call__(self, **inputs):
        with self.adapters_off():
            return self.engine(**inputs)


# ----------------------------------------------------------------------------- replica
WeightSource = tuple[str, list[torch.nn.Parameter], Callable[[], torch.Tensor]]


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
               fan_in_fan_out: bool) -> torch.Tensor:
    """W + scale x B A (Hu et al. 2021) in W's dtype, computed in fp32: W (out, in), or (in, out)
    with `fan_in_fan_out` (GPT-2's Conv1D); A (r, in), B (out, r)."""
    delta = (b.float() @ a.float()) * scale  # (out, in)
    if fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def _partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter whose full data is not on this rank now (released to its shard)."""
    return hasattr(p, "ds_id") and p.data.numel() != p.ds_numel


def merged_linear(layer, x: torch.Tensor) -> torch.Tensor | None:
    """A peft LoRA layer's output for `x` computed as the replica computes it: with its merged
    weight (`merge_lora`, the same arithmetic as `replica_weights`) in its base layer's own
    arithmetic (a Linear's torch.nn.functional.linear, GPT-2's Conv1D's addmm), so with the
    batch-invariant kernels every forward of the trainer (scoring and the update's) gives the
    sampler's bits. Gradients reach A and B through the merge, as close to float64's as peft's
    own forward's are (relative to the gradient's norm; docs/SAMPLING.md). The cost, with
    gradients on: the merged weight (the size of W) is kept for the backward, which computes a
    full-size gradient of it before A's and B's. None where the layer's own forward must run:
    adapters off or merged, another adapter or a variant (DoRA), an input dropout while
    training, a base that is neither a Linear nor a Conv1D, or a ZeRO-3 parameter of the layer
    that is not gathered (its own forwards gather it: correct, no longer bit-exact)."""
    from transformers.pytorch_utils import Conv1D

    base = layer.base_layer
    if (layer.disable_adapters or layer.merged or list(layer.active_adapters) != [ADAPTER]
            or ADAPTER not in layer.lora_A or ADAPTER in getattr(layer, "lora_variant", {})
            or not isinstance(base, (torch.nn.Linear, Conv1D))
            or bool(getattr(layer, "fan_in_fan_out", False)) != isinstance(base, Conv1D)
            or (layer.training and not isinstance(layer.lora_dropout[ADAPTER],
                                                  torch.nn.Identity))
            or any(_partitioned(p) for p in (base.weight, layer.lora_A[ADAPTER].weight,
                                             layer.lora_B[ADAPTER].weight))):
        return None
    conv = isinstance(base, Conv1D)  # weight (in, out): peft's fan_in_fan_out
    weight = merge_lora(base.weight, layer.lora_A[ADAPTER].weight,
                        layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER], conv)
    if conv:  # Conv1D.forward with the merged weight
        out = torch.addmm(base.bias, x.view(-1, x.size(-1)), weight)
        return out.view(*x.shape[:-1], base.nf)
    return torch.nn.functional.linear(x, weight, base.bias)


def _merged(layer, weight: torch.nn.Parameter, base: torch.Tensor | None = None
            ) -> Callable[[], torch.Tensor]:
    """A peft LoRA layer's merged weight (`merge_lora`), read once the parameters are gathered.
    `base`: a copy of W kept from an earlier sync (`adapter_weights`), read in place of the
    parameter, which then need not be gathered. The function's `base` and `layer` attributes
    are the parameter W and the layer (`lora_parts`)."""
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight

    def merge() -> torch.Tensor:
        w = weight.data if base is None else base
        return merge_lora(w.to(weight.dtype), a.data, b.data, layer.scaling[ADAPTER],
                          bool(getattr(layer, "fan_in_fan_out", False)))
    merge.base, merge.layer = weight, layer
    return merge


def lora_parts(full: Callable[[], torch.Tensor], dtype: torch.dtype, with_base: bool) -> dict:
    """What a generation rank of a split placement merges an adapted layer's weight from
    (`merge_lora`): its adapters a, b in `dtype`, scale and fan_in_fan_out, and with `with_base`
    its frozen weight W (sent at the first sync only); `full`: a `replica_weights` entry's merge
    of an adapted layer, its parameters gathered."""
    layer = full.layer
    parts = {"a": layer.lora_A[ADAPTER].weight.data.to(dtype),
             "b": layer.lora_B[ADAPTER].weight.data.to(dtype),
             "scale": float(layer.scaling[ADAPTER]),
             "fan_in_fan_out": bool(getattr(layer, "fan_in_fan_out", False))}
    if with_base:
        parts["base"] = full.base.data.to(dtype)
    return parts


def _adapted_layers(base: torch.nn.Module) -> dict:
    from peft.tuners.lora import LoraLayer

    return {f"{name}.base_layer.weight": m for name, m in base.named_modules()
            if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def replica_weights(module: torch.nn.Module) -> Iterator[WeightSource]:
    """(name in the plain HF model, parameters to gather, the full tensor once gathered) for
    every weight of `module` in module order; adapted layers merged, tied weights once."""
    from ds_ppo.engine.moe import ep_layers, ep_weights

    base = plain_model(module)
    adapted = _adapted_layers(base)
    # expert parallelism: each AutoEP layer's weights in the layout of the block it replaced
    experts, done = ep_layers(base), set()
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue  # merged into their base layer's weight
        layer = next((k for k in experts if name.startswith(k + ".")), None)
        if layer is not None:
            if layer not in done:
                done.add(layer)
                yield from ep_weights(layer, experts[layer])
            continue
        plain = name.replace(".base_layer.", ".")
        if name in adapted:
            layer = adapted[name]
            yield plain, [p, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight], \
                _merged(layer, p)
        else:
            yield plain, [p], (lambda p=p: p.data)


def adapter_weights(module: torch.nn.Module, bases: dict[str, torch.Tensor | None]
                    ) -> Iterator[WeightSource]:
    """The `replica_weights` entries a LoRA policy's training can have changed, for a weight
    sync after the first: each adapted layer merged from `bases` (its frozen weight W, copied
    at the first sync: see `keep_bases`) and its gathered adapters, so only A and B are
    gathered; a trained weight that is not adapted (requires_grad) gathered whole. Frozen
    weights are left out: the replica holds them from the first sync. A None in `bases`: the
    merge is done by the side that holds W (split placement: `lora_parts`)."""
    layers = {k.replace(".base_layer.", "."): m
              for k, m in _adapted_layers(plain_model(module)).items()}
    for name, params, full in replica_weights(module):
        weight = getattr(full, "base", None)
        if weight is not None and name in bases:
            yield name, params[1:], _merged(layers[name], weight, bases[name])
        elif any(p.requires_grad for p in params):
            yield name, params, full


def keep_bases(chunk: list[WeightSource], bases: dict[str, torch.Tensor]) -> None:
    """At a LoRA policy's first weight sync, with `chunk`'s parameters gathered: a copy of each
    adapted layer's frozen weight W into `bases` (by replica name), for `adapter_weights`."""
    for name, _, full in chunk:
        weight = getattr(full, "base", None)
        if weight is not None:
            bases[name] = weight.data.clone()


def trained_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's trained parameters (full sizes, their dtype): what a weight sync
    after the first gathers for a LoRA policy (`adapter_weights`)."""
    return int(sum(getattr(p, "ds_numel", p.numel()) * p.element_size()
                   for p in trainable(module)))


def weight_shape(params: list[torch.nn.Parameter], full: Callable[[], torch.Tensor]
                 ) -> tuple[int, ...]:
    """The full shape of a `replica_weights` entry's tensor: its `full`'s own (an expert-parallel
    weight collected from several ranks, `moe.ep_weights`), else its first parameter's
    (ZeRO-3: `ds_shape`)."""
    shape = getattr(full, "shape", None)
    if shape is None:
        p = params[0]
        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
    return tuple(shape)


# -------------------------------------------------------------------------- checkpoints
def save_adapters(engine, out_dir: Path) -> None:
    """Collective: the engine's trainable parameters gathered to rank 0 and written as a PEFT
    directory (adapter_config.json, adapter_model.safetensors). No-op without adapters."""
    import deepspeed

    module = engine.module
    if not is_lora(module):
        return
    state = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if dist.is_main():
                    state[name] = p.data.detach().clone().cpu()
    if dist.is_main():
        module.save_pretrained(out_dir, state_dict=state, safe_serialization=True,
                               save_embedding_layers=False)
    dist.barrier()


def _local_dir(path: str) -> Path:
    """The local directory of a model directory or hub name (the download cache)."""
    from transformers.utils import cached_file

    if Path(path).is_dir():
        return Path(path)
    return Path(cached_file(path, "config.json")).parent


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file: every tensor's name, dtype, shape and offsets."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def base_fingerprint(path: str) -> str:
    """sha256 of a base model's config.json, its weights index (if sharded) and every weight
    file's name, size and safetensors header. Reads a few KB per file, not the weights, so it
    catches another model, another shape, another file layout or re-saved weights of another
    size; weights rewritten in place with identical sizes and headers are not caught."""
    local = _local_dir(path)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (local / name).exists():
            h.update(name.encode() + b"\0" + (local / name).read_bytes())
    for f in sorted(local.glob("*.safetensors")):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode() + _safetensors_header(f))
    for f in sorted(local.glob("*.bin")):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
    return h.hexdigest()


def base_record(base_paths: dict[str, str]) -> dict[str, dict[str, str]]:
    """role -> {path, fingerprint} of each LoRA role's frozen base, for the trainer state."""
    return {role: {"path": p, "fingerprint": base_fingerprint(p)}
            for role, p in base_paths.items()}


def check_base(recorded: dict | None, base_paths: dict[str, str], checkpoint: Path) -> None:
    """Stop a resume whose LoRA bases are not the ones the checkpoint's adapters were trained
    on (the checkpoint holds no copy of a base: it is rebuilt from its original path)."""
    from ds_ppo.errors import UserError

    recorded = recorded or {}
    if set(recorded) != set(base_paths):
        raise UserError(f"{checkpoint} was saved with LoRA on {sorted(recorded) or 'no role'}, "
                        f"the config asks for {sorted(base_paths) or 'none'} (policy.lora, "
                        "value.lora): resume with the LoRA settings it was trained with, or "
                        "start a new output_dir")
    for role, path in base_paths.items():
        if base_fingerprint(path) != recorded[role]["fingerprint"]:
            raise UserError(
                f"{role}.lora: the base model files at {path} changed since {checkpoint} was "
                f"saved (config or weights fingerprint differs; recorded from "
                f"{recorded[role]['path']}): its adapters were trained on other weights. "
                "Restore the original base model files, or start a new output_dir")


def describe_trainable(name: str, module: torch.nn.Module) -> str:
    n, total = count_params(trainable(module)), count_params(module.parameters())
    return f"{name}: {n:,} trainable of {total:,} parameters ({100 * n / max(total, 1):.2f}%)"


def trainable_counts(engines) -> dict[str, str]:
    """MLflow params: trainable parameters of each trained role (all of them without LoRA)."""
    return {f"{role}.trainable_params": str(count_params(trainable(getattr(engines, role).module)))
            for role in TRAINED_ROLES if getattr(engines, role, None) is not None}
