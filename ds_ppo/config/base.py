"""The base of every config section (ds_ppo.config.sections assembles the tree)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen."""

    # coerce_numbers_to_str: `tracking.run_name=2024` or `tags: {version: 2}` are strings;
    # allow_inf_nan=False: `.nan` / `.inf` (YAML) are refused for every number, with the key
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              coerce_numbers_to_str=True, allow_inf_nan=False)
