"""Local paths versus hub names in the config, and the dry run's check that local paths exist.

A model, tokenizer or dataset spec is a hub name when it is not on disk and reads as one: `name`
or `org/name` (letters, digits, `-`, `_`, `.`), not ending in a file ending (`.jsonl`, `.model`,
...). Everything else (`/abs`, `./rel`, `~/x`, `a/b/c`, `dir/`, `prompts.jsonl`) is a local path,
and one that does not exist is an error before anything loads.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from ds_ppo.config import Config

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# file endings that make a spec a file, never a hub name
FILE_ENDINGS = (".json", ".jsonl", ".ndjson", ".csv", ".parquet", ".pq", ".model", ".yaml",
                ".yml", ".txt", ".bin", ".safetensors")


def is_hub_name(spec: str) -> bool:
    """True when `spec` names a hub repository (and no local file or directory)."""
    return (not Path(spec).expanduser().exists() and _HUB_NAME.fullmatch(spec) is not None
            and ".." not in spec and not spec.lower().endswith(FILE_ENDINGS))


def missing_local(spec: str | None) -> bool:
    """A spec that is a local path (not a hub name, not `builtin:...`) that does not exist."""
    if spec is None or spec.startswith("builtin:"):
        return False
    return not Path(spec).expanduser().exists() and not is_hub_name(spec)


def missing_paths(cfg: Config, job: str | None = None) -> list[str]:
    """One problem per config key whose local path does not exist (hub names are not checked:
    reaching the hub is the real start's business). `job`: a supervised job (sft, rm, dpo), which
    reads the data, the policy section and the paths of its own section (`<job>.*_path`)."""
    keys = {"data.path": cfg.data.path, "policy.path": cfg.policy.path,
            "policy.tokenizer": cfg.policy.tokenizer}
    if job is not None:
        keys.update({f"{job}.{name}": value for name, value in getattr(cfg, job)
                     if name.endswith("_path")})
    else:
        keys.update({"data.ptx_path": cfg.data.ptx_path, "value.path": cfg.value.path, "value.tokenizer": cfg.value.tokenizer,
                     "reference.path": cfg.reference.path, "reward.model": cfg.reward.model,
                     "reward.tokenizer": cfg.reward.tokenizer, "teacher.path": cfg.teacher.path,
                     "teacher.tokenizer": cfg.teacher.tokenizer})
    split = cfg.data.eval_split
    if split and split.lower().endswith(FILE_ENDINGS):  # an evaluation file, not a split name
        keys["data.eval_split"] = split
    return [f"{key} = {spec!r}: no such file or directory (from {Path.cwd()}; a hub name reads "
            "as name or org/name)" for key, spec in keys.items()
            if missing_local(spec) and not is_placeholder(spec)]


# the presets' stand-in for a path the user fills in (`tokenizer: /path/to/Llama-3.2-1B-Instruct`)
PLACEHOLDER = "/path/to/"


def is_placeholder(spec: str | None) -> bool:
    return spec is not None and spec.startswith(PLACEHOLDER)


def placeholders(cfg: Config, sections: tuple[str, ...] | None = None) -> list[str]:
    """`key = value` for every setting that still holds a preset's /path/to/... placeholder
    (in `sections` only, when given: the supervised jobs read data and policy)."""
    found = []

    def walk(section, prefix: str) -> None:
        for name, value in section:
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")
            elif isinstance(value, str) and is_placeholder(value):
                found.append(f"{prefix}{name} = {value}")
    walk(cfg, "")
    return [f for f in found if sections is None or f.split(".", 1)[0] in sections]
