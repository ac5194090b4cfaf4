"""The engine side of exporting a model as a Hugging Face directory (safetensors weights +
config + tokenizer, loadable with `from_pretrained` and no ds_ppo).

- `export_engine`: inside a running job, a role's (ZeRO-3) weights gathered a group at a time
  and streamed into safetensors shards by the ranks of node 0 (engine/checkpoint/hf_writer.py);
- `export_into`: offline, from a checkpoint (one process, CPU): its safetensors copies re-written
  tensor by tensor, else DeepSpeed's ZeRO checkpoint consolidation; a LoRA role merged into its
  base or copied as its PEFT directory.

The `ds-ppo export` command (checks on the target directory and the flags, the atomic write) is
ds_ppo/run/export.py.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ds_ppo.engine.checkpoint.files import EXPORT_MARKER, TAG
from ds_ppo.errors import CheckpointError

log = logging.getLogger("ds_ppo")
MARKER = EXPORT_MARKER  # marks a directory an export wrote (engine/checkpoint/files.py)
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT directory's files


def export_engine(engine, tokenizer, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Collective: stream the engine's (ZeRO-3) weights, gathered a group at a time, into
    safetensors shards written by the ranks of node 0 (engine/checkpoint/hf_writer.py), plus config and
    tokenizer. `engine`: anything with the model as `.module` (a role of `Engines`)."""
    from ds_ppo.engine.checkpoint.hf_writer import save_module

    return save_module(engine.module, tokenizer, out_dir, dtype)


def export_final(engine, tokenizer, final: Path, dtype: torch.dtype, source: str,
                 iteration: int | None = None, with_manifest: bool = True) -> Path:
    """Collective: the end-of-run export. `export_engine` writes into `.final.tmp` next to
    `final`; then rank 0 marks it (ds_ppo_export.json), writes its manifest (`with_manifest`)
    and renames it into place (`replace_dir`), so a kill at any moment leaves `final` as it was
    or complete, never a mix of old and new files.

    Raises:
        CheckpointError: the disk filled up (or a file hit the size limit); `.final.tmp` is
            removed, `final` is as it was.
    """
    from ds_ppo.engine import dist

    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        export_engine(engine, tokenizer, tmp, dtype)  # ends with a barrier: every shard written
        if dist.is_main():
            write_marker(tmp, source, dtype, with_value=False, iteration=iteration,
                         with_manifest=with_manifest)
            replace_dir(tmp, final)
    except (OSError, RuntimeError) as e:
        why = disk_full_reason(e, final.parent)
        if why is None:
            raise
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the partial export took
        raise CheckpointError(
            f"{why} while exporting to {getattr(e, 'filename', None) or tmp}; {final} is as it "
            "was and the checkpoints are intact: free space and run the same command to finish "
            "the export") from None
    dist.barrier()
    return final


# how torch.save's C++ writer reports a failed write (it drops the errno)
_TORCH_WRITE_FAILED = ("inline_container", "PytorchStreamWriter", "iostream error",
                       "file write failed")


def disk_full_reason(e: BaseException, where: Path) -> str | None:
    """"no space left on the device" or "file too large (...)" when `e` is a write that failed
    for a full disk (or quota) or the file-size limit, else None. torch.save loses the errno
    ("enforce fail at inline_container.cc"), so there the free space at `where` and the
    file-size limit decide."""
    code = getattr(e, "errno", None)
    torch_write = code is None and any(m in str(e) for m in _TORCH_WRITE_FAILED)
    if code in (errno.ENOSPC, errno.EDQUOT) or (torch_write and _disk_full(where)):
        return "no space left on the device"
    if code == errno.EFBIG or (torch_write and _size_limited()):
        return "file too large (the file-size limit, `ulimit -f`)"
    return None


def _disk_full(path: Path) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 16 * 2**20


def _size_limited() -> bool:
    import resource

    return resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


def replace_dir(new: Path, target: Path) -> None:
    """Rename the complete directory `new` to `target`; an existing `target` is renamed aside
    first and deleted after. A kill between the two renames leaves no `target` but
    `.<target>.old`, which the next call (or `ds-ppo export --out`) puts back first."""
    old = target.with_name(f".{target.name}.old")
    if old.exists() and not target.exists():  # a replace killed between its renames
        os.replace(old, target)
    shutil.rmtree(old, ignore_errors=True)
    if target.is_dir() and not target.is_symlink():
        os.replace(target, old)
    elif target.exists() or target.is_symlink():
        target.unlink()
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def export_reads(ckpt: Path, with_value: bool) -> tuple[str, ...]:
    """The parts of checkpoint `ckpt` an export reads (for the manifest check): the HF
    directories, and a role's DeepSpeed files when it has no safetensors copy."""
    roles = [("policy", "hf")] + ([("value", "hf_value")] if with_value else [])
    out = []
    for role, sub in roles:
        out.append(f"{sub}/")
        if not _weight_files(ckpt / sub) and not (ckpt / sub / ADAPTER[1]).exists():
            out.append(f"{role}/{TAG}/")
    return tuple(out)


def source_problem(ckpt: Path, with_value: bool, lora_bases: dict,
                   adapter_only: bool) -> tuple[Path, str] | None:
    """(file, what is wrong) for the first file an export of `ckpt` needs that is missing or
    cannot be read whole (safetensors: the header parses and the size matches it), else None.
    Cheap: no weights are read."""
    roles = [("policy", "hf")] + ([("value", "hf_value")] if with_value else [])
    for role, sub in roles:
        src = ckpt / sub
        lora = role in lora_bases
        needed = [src / "config.json"] if not (lora and adapter_only) else []
        if lora:
            needed += [src / ADAPTER[0]]
            weights = [src / ADAPTER[1]]
        else:
            weights = _weight_files(src)
        for f in needed:
            if not f.is_file():
                return f, "is missing"
            try:
                json.loads(f.read_text())
            except (OSError, ValueError) as e:
                return f, f"cannot be read ({type(e).__name__}: {e})"
        for f in weights:
            what = safetensors_problem(f)
            if what:
                return f, what
        if not lora and not weights and not any((ckpt / role / TAG).glob("*.pt")):
            return ckpt / role / TAG, "holds no weights (and there is no safetensors copy)"
        if not lora and not weights and role in _expert_parallel_roles(ckpt):
            return src, ("is missing: the role ran expert parallelism, whose DeepSpeed shards "
                         "(AutoEP's layers, E / N experts per rank) do not consolidate into a "
                         "Hugging Face model; export from a checkpoint saved with "
                         "checkpoint.save_hf_weights=true, or from the run's final/")
    return None


def _expert_parallel_roles(ckpt: Path) -> dict:
    """The roles a checkpoint saved with expert parallelism (its trainer_state.json)."""
    try:
        return json.loads((ckpt / "trainer_state.json").read_text()).get("expert_parallel", {})
    except (OSError, ValueError):
        return {}


def _weight_files(src: Path) -> list[Path]:
    """A HF directory's safetensors weight files (one file, or the shards its index names)."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [index]  # reported by safetensors_problem as unreadable
        return [src / n for n in names]
    return [src / "model.safetensors"] if (src / "model.safetensors").exists() else []


def safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot be read whole (None: its header parses and the file is as
    long as the header says); reads only the header."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > size - 8:
                return "is cut off (shorter than its safetensors header says)"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        return f"is not a readable safetensors file ({type(e).__name__}: {e})"
    if size < 8 + n + end:
        return f"is cut off ({size} bytes, its safetensors header says {8 + n + end})"
    if size > 8 + n + end:
        return f"is {size} bytes, its safetensors header says {8 + n + end} (damaged)"
    return None


def export_into(ckpt: Path, out_dir: Path, dtype: torch.dtype, with_value: bool,
                lora_bases: dict, adapter_only: bool) -> None:
    """Write the policy of checkpoint `ckpt` (and its value model under value/) into the
    existing directory `out_dir`, then the export marker."""
    from transformers import AutoTokenizer

    from ds_ppo.engine.checkpoint.hf_writer import save_module

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


def write_marker(out_dir: Path, source: str, dtype: torch.dtype, with_value: bool,
                 iteration: int | None = None, with_manifest: bool = True) -> None:
    """Mark the complete export `out_dir` as ds_ppo's (a later `ds-ppo export --out` may
    replace it), then write its manifest (engine/checkpoint/manifest.py: every file's size and CRC-32,
    the marker's included), which the marker records, so every later load requires it. A
    run's own export at its end also records the iteration it holds."""
    from ds_ppo.engine.checkpoint import manifest

    marker = {"checkpoint": source, "dtype": str(dtype).removeprefix("torch."),
              "value": with_value}
    if iteration is not None:
        marker["iteration"] = iteration
    if with_manifest:
        marker["manifest"] = manifest.MANIFEST
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if with_manifest:
        manifest.write(out_dir)


def _copy_adapter(src: Path, target: Path) -> None:
    """The checkpoint's PEFT directory (adapter config and weights, as trained)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER:
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

    from ds_ppo.engine.checkpoint.hf_writer import copy_safetensors_weights

    copy_safetensors_weights(src, target, dtype)
    config = AutoConfig.from_pretrained(src)
    config.dtype = str(dtype).split(".")[1]
    config.save_pretrained(target)
    if (src / "generation_config.json").exists():
        GenerationConfig.from_pretrained(src).save_pretrained(target)


def _from_zero_shards(ckpt: Path, role: str):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

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
