"""`ds-ppo export`: the policy (and optionally the value model) as a Hugging Face model directory:
safetensors weights (in the dtype the policy trained in, unless asked for another) + config +
tokenizer, loadable with `from_pretrained` and no ds_ppo.

Two paths, both written by engine/checkpoint/hf_export.py: `export_engine` inside a running job (weights
gathered a group at a time from ZeRO-3 and streamed into safetensors shards by the ranks of node
0: engine/checkpoint/hf_writer.py), and `ds-ppo export --checkpoint DIR --out DIR` offline from a checkpoint
(the checkpoint's safetensors copies re-written tensor by tensor, else DeepSpeed's ZeRO checkpoint
consolidation; one process, CPU only). This module is the command: its checks and the atomic
write.

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
import os
import shutil
import sys
from pathlib import Path

import torch

from ds_ppo.engine.checkpoint.files import (is_export, read_state, resolve_checkpoint, unusable,
                                            verify_export, verify_files)
from ds_ppo.engine.checkpoint.hf_export import (MARKER, export_engine, export_into, export_reads,
                                  replace_dir, source_problem, write_marker)
from ds_ppo.errors import CheckpointError, UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
__all__ = ["DTYPES", "MARKER", "check_export_target", "checkpoint_dtype", "dtype_name",
           "export_checkpoint", "export_dtype", "export_engine", "main", "write_atomically",
           "write_marker"]


def export_dtype(name: str, trained: torch.dtype) -> torch.dtype:
    """The dtype an export writes: `name` (checkpoint.export_dtype, `ds-ppo export --dtype`),
    where `auto` keeps `trained`, the dtype the weights were trained in."""
    return trained if name == "auto" else DTYPES[name]


def checkpoint_dtype(checkpoint: str | Path) -> torch.dtype:
    """The dtype the policy of `checkpoint` trained in, as its hf/config.json records it
    (a config without one: fp32, transformers' own default; an unreadable config too, which the
    export then refuses naming the file)."""
    try:
        config = json.loads((resolve_checkpoint(checkpoint) / "hf" / "config.json").read_text())
    except (OSError, ValueError):  # missing or damaged: the export's own checks name the file
        config = {}
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return {dtype_name(d): d for d in DTYPES.values()}.get(name, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    """As logs and config.json spell it: float32, bfloat16, float16."""
    return str(dtype).removeprefix("torch.")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype,
                      with_value: bool = False, overwrite: bool = False,
                      adapter_only: bool = False, verify: bool = True) -> list[Path]:
    """Offline export of a ds_ppo checkpoint (no process group, CPU).

    Reads the safetensors copies the checkpoint holds (checkpoint.save_hf_weights); a checkpoint
    saved without them is consolidated from DeepSpeed's ZeRO shards instead (pickles: only for
    checkpoints you wrote yourself). `verify`: first check the files it reads against the
    checkpoint's manifest (engine/checkpoint/manifest.py).

    Raises:
        UserError: `out_dir` holds files of something else (and not `overwrite`).
        CheckpointError: a file the export needs is missing, cut off, changed since the save or
            unreadable (named, with the checkpoint to export instead).
    """
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite)
    ckpt = resolve_checkpoint(checkpoint)
    if with_value and not (ckpt / "value").exists():
        raise UserError(f"--value: {ckpt} has no value model (trained with a critic-free "
                        "ppo.advantage_estimator); export without --value")
    lora_bases = read_state(ckpt).lora_bases
    _check_lora_request(ckpt, lora_bases, with_value, adapter_only)
    if verify:
        verify_files(ckpt, "export", export_reads(ckpt, with_value))
        if "policy" in lora_bases and not adapter_only:  # the merge reads the base too
            base = Path(lora_bases["policy"]["path"])
            if is_export(base):
                verify_export(base, "the LoRA policy's base model")
    else:
        print(f"ds-ppo export: --no-verify: the files of {ckpt} are NOT checked against its "
              "manifest (a damaged file may be exported as wrong weights)", file=sys.stderr,
              flush=True)
    problem = source_problem(ckpt, with_value, lora_bases, adapter_only)
    if problem is not None:
        raise unusable(ckpt, *problem, command="export")
    try:
        write_atomically(out_dir, lambda tmp: export_into(ckpt, tmp, dtype, with_value,
                                                           lora_bases, adapter_only))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  damaged files the checks above cannot see
        raise CheckpointError(f"cannot export checkpoint {ckpt}: {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                              f"; {out_dir} is unchanged. Export an earlier checkpoint "
                              "(--checkpoint .../iter_N), or resume training to save a new one"
                              ) from None
    return [out_dir] + ([out_dir / "value"] if with_value else [])


def check_export_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse an `--out` that holds anything but an earlier ds_ppo export (unless overwrite)."""
    if overwrite or not out_dir.exists() or (out_dir / MARKER).is_file():
        return
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    raise UserError(f"--out {out_dir} is not empty and is not an earlier ds_ppo export (no "
                    f"{MARKER}); choose a new or empty directory, or pass --overwrite to "
                    "replace everything in it")


def write_atomically(out_dir: Path, write) -> None:
    """`write(tmp)` fills a temporary directory next to `out_dir`, which then replaces `out_dir`
    (engine/checkpoint/hf_export.py replace_dir); if `write` fails, the temporary directory is removed and
    `out_dir` is as it was."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out_dir)


def _check_lora_request(ckpt: Path, lora_bases: dict, with_value: bool,
                        adapter_only: bool) -> None:
    if adapter_only and "policy" not in lora_bases:
        raise UserError(f"--adapter-only: the policy in {ckpt} was not trained with LoRA "
                        "(policy.lora); export it without --adapter-only")
    if with_value and "value" in lora_bases:
        raise UserError(f"--value: the value model in {ckpt} was trained with LoRA (value.lora); "
                        "its adapters and head are in the DeepSpeed files only: export the "
                        "policy without --value")


def main(args: argparse.Namespace) -> int:
    name = getattr(args, "dtype", "auto")
    dtype = DTYPES[name] if name != "auto" else checkpoint_dtype(args.checkpoint)
    for path in export_checkpoint(args.checkpoint, args.out, dtype, args.value,
                                  getattr(args, "overwrite", False),
                                  getattr(args, "adapter_only", False),
                                  not getattr(args, "no_verify", False)):
        print(f"exported {path} ({dtype_name(dtype)} weights)")
    return 0
