"""The base of every config section (ds_ppo.config.sections assembles the tree)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

# The longest duration a config may set (about 31 years): every clock a timeout reaches counts
# nanoseconds in a signed 64-bit integer (CPython's thread waits and sockets, the process
# group's collectives), which ends at 9.2e9 s; a limit past that fails inside the library
# (OverflowError, a C++ abort) instead of at the config. Durations are the fields named
# *_s (seconds) and *_minutes.
MAX_SECONDS = 1e9
_UNITS = {"_s": 1.0, "_minutes": 60.0}
_INT64 = 2**63 - 1


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen."""

    # coerce_numbers_to_str: `tracking.run_name=2024` or `tags: {version: 2}` are strings;
    # allow_inf_nan=False: `.nan` / `.inf` (YAML) are refused for every number, with the key
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _representable(cls, value, info):
        """Counts (and seeds) go to torch and C libraries as 64-bit integers, durations to
        clocks that end at 9.2e9 s: larger ones are refused here, with the key, instead of
        overflowing there."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        if isinstance(value, int) and abs(value) > _INT64:
            raise ValueError(f"must be at most {_INT64} in size (a signed 64-bit integer)")
        unit = next((u for suffix, u in _UNITS.items() if info.field_name.endswith(suffix)),
                    None)
        if unit is not None and value * unit > MAX_SECONDS:
            name = "s" if unit == 1.0 else "minutes"
            raise ValueError(f"must be at most {MAX_SECONDS // unit:,.0f} {name} (about 31 years: "
                             "longer limits overflow the clocks of threads, sockets and "
                             "collectives)")
        return value

    def problems(self) -> list[str]:
        """The rules among this section's own fields that one field's range cannot say: each
        broken rule as a line naming the keys and a value that works. Rules that join sections
        or need the world size are in config/checks.py."""
        return []
