"""Checkpoints and exports: everything a run writes to disk and reads back.

- `files.py`: the checkpoint directory's layout, which checkpoint a run continues from, whether a
  checkpoint or an export is whole (no torch, no DeepSpeed: `--dry-run` and the CLI use it);
- `manifest.py`: every file's size and CRC-32, written at save, checked at load (no torch);
- `save_load.py`: writing a checkpoint from the engines and loading one into them (DeepSpeed's
  files, RNG states, EMA, the universal format for another world size);
- `hf_export.py`: a role's weights as a Hugging Face directory, inside a job or from a checkpoint;
- `hf_writer.py`: the streamed safetensors writer both use.

The names callers need are found here, each in its home module, imported on first use so that
the torch-free ones stay torch-free: `from ds_ppo.engine.checkpoint import find_resume` loads
files.py only.
"""
from __future__ import annotations

import importlib

# name -> module (relative to this package) that defines it
_HOMES = {
    **dict.fromkeys(
        ("AUTOEP_UNIVERSAL_TAG", "TAG", "UNIVERSAL_TAG", "EXPORT_MARKER", "TrainerState",
         "checkpoint_name", "checkpoints_dir", "complete_checkpoints",
         "find_resume",
         "finished_message", "finished_run", "is_export", "latest_checkpoint", "read_state",
         "resolve_checkpoint", "unusable", "verify_checkpoint", "verify_export", "verify_files",
         "verify_model_paths"), "files"),
    **dict.fromkeys(
        ("ensure_universal", "expert_parallel_resume", "load_checkpoint",
         "read_in_flight", "rng_state", "save_checkpoint", "saved_zero3", "set_rng_state",
         "stage_changed", "universal_workers"), "save_load"),
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:  # a submodule (`from ds_ppo.engine.checkpoint import manifest`) or a typo
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
