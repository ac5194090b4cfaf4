"""Export the policy (and optionally the value model) as a Hugging Face model directory:
safetensors 16-bit weights + config + tokenizer, loadable with `from_pretrained` and no ds_ppo.

Two paths: `export_engine` inside a running job (weights gathered a group at a time from ZeRO-3
and streamed into safetensors shards by the ranks of node 0: engine/hf_writer.py), and
`ds-ppo export --checkpoint DIR --out DIR` offline from a checkpoint (the checkpoint's safetensors
copies re-written tensor by tensor, else DeepSpeed's ZeRO checkpoint consolidation; one process,
CPU only).

An offline export never overwrites what it did not write: `--out` must be new, empty or an
earlier ds_ppo export (it holds `ds_ppo_export.json`) unless `--overwrite`; the export is written
into a temporary directory next to it and renamed into place, so a failed export leaves nothing
half-written.

A LoRA policy (policy.lora) exports merged (W + alpha / r x B A: a plain model, no peft needed to
load it), from the checkpoint's adapter and the base model at its recorded path; or with
`adapter_only` as the PEFT directory (`PeftModel.from_pretrained(base, dir)`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("ds_ppo")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MARKER = "ds_ppo_export.json"  # marks a directory an offline export wrote


def export_engine(engine, tokenizer, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Collective: stream the engine's (ZeRO-3) weights, gathered a group at a time, into
    safetensors shards written by the ranks of node 0 (engine/hf_writer.py), plus config and
    tokenizer."""
    from ds_ppo.engine.hf_writer import save_module

    return save_module(engine.module, tokenizer, out_dir, dtype)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype,
                      with_value: bool = False, overwrite: bool = False,
                      adapter_only: bool = False) -> list[Path]:
    """Offline export of a ds_ppo checkpoint (no process group, CPU).

    Reads the safetensors copies the checkpoint holds (checkpoint.save_hf_weights); a checkpoint
    saved without them is consolidated from DeepSpeed's ZeRO shards instead (pickles: only for
    checkpoints you wrote yourself).

    Raises:
        UserError: `out_dir` holds files of something else (and not `overwrite`).
    """
    from ds_ppo.engine.checkpoint import read_state, resolve_checkpoint

    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite)
    ckpt = resolve_checkpoint(checkpoint)
    if with_value and not (ckpt / "value").exists():
        from ds_ppo.errors import UserError

        raise UserError(f"--value: {ckpt} has no value model (trained with a critic-free "
                        "ppo.advantage_estimator); export without --value")
    lora_bases = read_state(ckpt).lora_bases
    _check_lora_request(ckpt, lora_bases, with_value, adapter_only)
    write_atomically(out_dir, lambda tmp: _export_into(ckpt, tmp, dtype, with_value, lora_bases,
                                                       adapter_only))
    return [out_dir] + ([out_dir / "value"] if with_value else [])


def check_export_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse an `--out` that holds anything but an earlier ds_ppo export (unless overwrite)."""
    from ds_ppo.errors import UserError

    if overwrite or not out_dir.exists() or (out_dir / MARKER).is_file():
        return
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    raise UserError(f"--out {out_dir} is not empty and is not an earlier ds_ppo export (no "
                    f"{MARKER}); choose a new or empty directory, or pass --overwrite to "
                    "replace everything in it")


def write_atomically(out_dir: Path, write) -> None:
    """`write(tmp)` fills a temporary directory next to `out_dir`, which then replaces `out_dir`
    (two renames); if `write` fails, the temporary directory is removed and `out_dir` is as it
    was."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.is_dir() and not out_dir.is_symlink():
        os.replace(out_dir, old)
    elif out_dir.exists() or out_dir.is_symlink():
        out_dir.unlink()
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _export_into(ckpt: Path, out_dir: Path, dtype: torch.dtype, with_value: bool,
                 lora_bases: dict, adapter_only: bool) -> None:
    from transformers import AutoTokenizer

    from ds_ppo.engine.hf_writer import save_module

    tokenizer = AutoTokenizer.from_pretrained(ckpt / "hf")
    roles = [("policy", out_dir)] + ([("value", out_dir / "value")] if with_value else [])
    for role, target in roles:
        src = ckpt / ("hf" if role == "policy" else "hf_value")
        if role in lora_bases and adapter_only:
            _copy_adapter(src, target)
        elif role in lora_bases:
            save_module(_merged_lora(ckpt, src, lora_bases[role]), None, target, dtype)
        elif (src / "model.safetensors").exists() or (src / "model.safetensors.index.json").exists():
            _copy_safetensors(src, target, dtype)  # one tensor in memory at a time
        else:
            log.warning("%s has no safetensors weights (checkpoint.save_hf_weights=false): "
                        "consolidating DeepSpeed's ZeRO shards", src)
            model = _from_zero_shards(ckpt, role)
            save_module(model, None, target, dtype)
        tokenizer.save_pretrained(target)
    write_marker(out_dir, str(ckpt.resolve()), dtype, with_value)


def write_marker(out_dir: Path, source: str, dtype: torch.dtype, with_value: bool) -> None:
    """Mark `out_dir` as a ds_ppo export (a later `ds-ppo export --out` may replace it)."""
    (out_dir / MARKER).write_text(json.dumps(
        {"checkpoint": source, "dtype": str(dtype).removeprefix("torch."),
         "value": with_value}, indent=2) + "\n")


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


def _copy_safetensors(src: Path, target: Path, dtype: torch.dtype) -> None:
    """The weights re-written (streamed) in `dtype`; config and generation config copied."""
    from transformers import AutoConfig, GenerationConfig

    from ds_ppo.engine.hf_writer import copy_safetensors_weights

    copy_safetensors_weights(src, target, dtype)
    config = AutoConfig.from_pretrained(src)
    config.dtype = str(dtype).split(".")[1]
    config.save_pretrained(target)
    if (src / "generation_config.json").exists():
        GenerationConfig.from_pretrained(src).save_pretrained(target)


def _from_zero_shards(ckpt: Path, role: str):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

    from ds_ppo.engine.checkpoint import TAG

    ds_dir = ckpt / role / TAG
    if any(ds_dir.glob("zero_pp_rank_*")):
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / role), tag=TAG)
    else:  # saved without ZeRO (zero_stage auto/0 on one rank): the whole module in one file
        state = torch.load(ds_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
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
                                  getattr(args, "overwrite", False),
                                  getattr(args, "adapter_only", False)):
        print(f"exported {path}")
    return 0
