"""Export the policy (and optionally the value model) as a Hugging Face model directory:
safetensors 16-bit weights + config + tokenizer, loadable with `from_pretrained` and no ds_ppo.

Two paths: `export_engine` inside a running job (weights gathered module by module from ZeRO-3,
written by rank 0), and `ds-ppo export --checkpoint DIR --out DIR` offline from a checkpoint
(DeepSpeed's ZeRO checkpoint consolidation, one process, CPU only).

A LoRA policy (policy.lora) exports merged (W + alpha / r x B A: a plain model, no peft needed to
load it), from the checkpoint's adapter and the base model at its recorded path; or with
`adapter_only` as the PEFT directory (`PeftModel.from_pretrained(base, dir)`).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from ds_ppo.engine import dist

log = logging.getLogger("ds_ppo")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_engine(engine, tokenizer, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Collective: gather the engine's (ZeRO-3) weights into a CPU model on rank 0 and save it."""
    from ds_ppo.engine.generation import build_replica

    out_dir = Path(out_dir)
    model = build_replica(engine.module, dtype, torch.device("cpu"),
                          materialize=dist.is_main())
    if dist.is_main():
        model.config.use_cache = True
        model.save_pretrained(out_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    dist.barrier()
    return out_dir


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype,
                      with_value: bool = False, adapter_only: bool = False) -> list[Path]:
    """Offline export of a ds_ppo checkpoint (no process group, CPU).

    Reads the safetensors copies the checkpoint holds (checkpoint.save_hf_weights); a checkpoint
    saved without them is consolidated from DeepSpeed's ZeRO shards instead (pickles: only for
    checkpoints you wrote yourself)."""
    from transformers import AutoTokenizer

    from ds_ppo.engine.checkpoint import read_state, resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    lora_bases = read_state(ckpt).lora_bases
    _check_lora_request(ckpt, lora_bases, with_value, adapter_only)
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "hf")
    roles = [("policy", out_dir)] + ([("value", out_dir / "value")] if with_value else [])
    written = []
    for role, target in roles:
        src = ckpt / ("hf" if role == "policy" else "hf_value")
        if role in lora_bases and adapter_only:
            _copy_adapter(src, target)
            tokenizer.save_pretrained(target)
            written.append(target)
            continue
        if role in lora_bases:
            model = _merged_lora(ckpt, src, lora_bases[role])
        elif ((src / "model.safetensors").exists()
              or (src / "model.safetensors.index.json").exists()):
            model = _from_safetensors(src, role)
        else:
            log.warning("%s has no safetensors weights (checkpoint.save_hf_weights=false): "
                        "consolidating DeepSpeed's ZeRO shards", src)
            model = _from_zero_shards(ckpt, role)
        model.to(dtype)
        model.save_pretrained(target, safe_serialization=True)
        tokenizer.save_pretrained(target)
        written.append(target)
    return written


def _check_lora_request(ckpt: Path, lora_bases: dict, with_value: bool,
                        adapter_only: bool) -> None:
    from ds_ppo.errors import UserError

    if adapter_only and "policy" not in lora_bases:
        raise UserError(f"--adapter-only: the policy in {ckpt} was not trained with LoRA "
                        "(policy.lora); export it without --adapter-only")
    if with_value and "value" in lora_bases:
        raise UserError(f"--value: the value model in {ckpt} was trained with LoRA (value.lora); "
                        "its adapters and head are in the DeepSpeed files only: export the "
                        "policy without --value")


def _copy_adapter(src: Path, target: Path) -> None:
    """The checkpoint's PEFT directory (adapter config and weights, as trained)."""
    import shutil

    target.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(src / name, target / name)


def _merged_lora(ckpt: Path, src: Path, base: dict):
    """The policy with its adapters merged into the base it was trained on (fingerprint
    checked), as a plain HF model."""
    from peft import PeftModel

    from ds_ppo.engine.lora import check_base

    check_base({"policy": base}, {"policy": base["path"]}, ckpt)
    model = _model_class("policy").from_pretrained(base["path"], dtype=torch.float32)
    return PeftModel.from_pretrained(model, src).merge_and_unload()


def _model_class(role: str):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    return AutoModelForCausalLM if role == "policy" else AutoModelForTokenClassification


def _from_safetensors(src: Path, role: str):
    return _model_class(role).from_pretrained(src, dtype=torch.float32)


def _from_zero_shards(ckpt: Path, role: str):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

    from ds_ppo.engine.checkpoint import TAG

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / role), tag=TAG)
    config = AutoConfig.from_pretrained(ckpt / ("hf" if role == "policy" else "hf_value"))
    with torch.device("meta"):
        model = _model_class(role).from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if unexpected or missing:
        raise RuntimeError(f"{role} checkpoint does not match its config: missing {missing}, "
                           f"unexpected {unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def main(args: argparse.Namespace) -> int:
    for path in export_checkpoint(args.checkpoint, args.out, DTYPES[args.dtype], args.value,
                                  args.adapter_only):
        print(f"exported {path}")
    return 0
