"""Loading a config: a YAML file or a packaged preset, dotted ``key=value`` overrides, parsing
into the typed tree with errors that name the key; and the key reference (``describe``) that
``ds-ppo config --describe`` prints and docs/CONFIG.md is generated from.
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ds_ppo.config.sections import Config
from ds_ppo.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"


def preset_path(name: str) -> Path:
    return PRESETS_DIR / f"{name}.yaml"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-5` as a string; read it as a float, as YAML 1.2 does (this matters
    in untyped maps such as policy.arch, which go to transformers as they are)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


# Aliases share one object, so a few hundred bytes of nested &anchors/*aliases (an "alias bomb")
# stand for billions of values, which validation and error messages would walk.
MAX_YAML_VALUES = 100_000


def _load_yaml(text: str) -> Any:
    data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)
    count, stack = 0, [data]
    while stack:  # the values of the tree with every alias expanded, up to the limit
        node = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise ConfigError(f"YAML input expands, through its *aliases, to more than "
                              f"{MAX_YAML_VALUES:,} values; write the values out instead")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return data


def _short(value: Any, limit: int = 200) -> str:
    """repr of user input for a message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _read_yaml(source: str | os.PathLike | None) -> dict[str, Any]:
    if source is None:
        source = preset_path("tiny")
    path = Path(source)
    if not path.is_file() and preset_path(str(source)).is_file():
        path = preset_path(str(source))
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(source)!r} {what} (presets: "
                          f"{', '.join(preset_names())})")
    try:
        data = _load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top, got "
                          f"{type(data).__name__}")
    return data


def _known_keys(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


def _section_type(model: type[BaseModel], key: str, optional: bool = False
                  ) -> type[BaseModel] | None:
    """The section class of `model.key`; with `optional`, also of a `Section | None` field
    (policy.lora), whose keys are checked but which `describe` lists as one key."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    ann = field.annotation
    if optional:
        ann = next((a for a in typing.get_args(ann) if a is not type(None)), ann)
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _did_you_mean(model: type[BaseModel], prefix: list[str], key: str) -> str:
    """`; did you mean 'ppo.kl_coef'?` for the closest key of `model` (a typo), else ''. A key
    that belongs to another section (`ppo.lr`) names where it lives (`policy.lr`)."""
    close = difflib.get_close_matches(key, _known_keys(model), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {'.'.join([*prefix, close[0]])!r}?"
    elsewhere = [k for k in _all_keys(Config) if k.rsplit(".", 1)[-1] == key]
    return f"; did you mean {' or '.join(map(repr, elsewhere[:3]))}?" if elsewhere else ""


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name in model.model_fields:
        sub = _section_type(model, name, optional=True)
        keys += _all_keys(sub, f"{prefix}{name}.") if sub is not None else [f"{prefix}{name}"]
    return keys


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides (values parsed as YAML) to a raw config dict."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {_short(item)} is not of the form key=value "
                              "(e.g. ppo.kl_coef=0.05)")
        key, raw = item.split("=", 1)
        try:
            value = _load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        node, model = data, Config
        for i, part in enumerate(parts):
            if model is not None and part not in model.model_fields:
                where = ".".join(parts[:i]) or "the top level"
                raise ConfigError(f"unknown config key {key!r}: {where} has no {part!r}"
                                  f"{_did_you_mean(model, parts[:i], part)} "
                                  f"(valid: {', '.join(_known_keys(model))})")
            if i == len(parts) - 1:
                node[part] = value
            else:
                child = node.get(part)
                child = dict(child) if isinstance(child, dict) else {}
                node[part] = child
                node = child
                model = (_section_type(model, part, optional=True) if model is not None
                         else None)
    return data


def _format_validation_error(err: ValidationError, data: dict[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parent = Config
            for p in e["loc"][:-1]:
                parent = _section_type(parent, str(p), optional=True) if parent else None
            valid = ", ".join(_known_keys(parent)) if parent else "?"
            hint = (_did_you_mean(parent, [str(p) for p in e["loc"][:-1]], str(e["loc"][-1]))
                    if parent else "")
            lines.append(f"unknown config key {loc!r}{hint} (valid here: {valid})")
        else:
            lines.append(f"{loc} = {_short(e.get('input'))}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


# Keys of a section that name the same thing in different ways (where a model comes from, what
# scores a response): one given on the command line replaces the others a config file sets,
# together with the settings that only the replaced one reads (an arch's tokenizer, a reward
# function's data columns) unless the new source reads them too.
_SOURCES = {"policy": ("path", "arch"), "value": ("path", "arch"),
            "reward": ("function", "model", "url")}
_COMPANIONS = {"policy.arch": ("policy.tokenizer",), "value.arch": ("value.tokenizer",),
               "reward.model": ("reward.tokenizer",), "reward.function": ("data.reward_keys",),
               "reward.url": ("data.reward_keys",)}


def _command_line_sources(data: dict[str, Any], overrides: list[str]) -> tuple[dict, list[str]]:
    """The file's config without the sources that a command-line override replaces (a preset's
    `policy.arch` and its tokenizer when `policy.path=...` is given, its `reward.function` and
    `data.reward_keys` when `reward.model=...` is), and one note per replacement."""
    given = {o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip()
             for o in overrides if "=" in o}
    data, notes = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}, []

    def is_set(key: str) -> bool:
        section, name = key.split(".")
        return isinstance(data.get(section), dict) and data[section].get(name) is not None

    for section, sources in _SOURCES.items():
        chosen = next((f"{section}.{k}" for k in sources if given.get(f"{section}.{k}", "null")
                       not in ("", "null", "~")), None)
        if chosen is None:
            continue
        dropped = [f"{section}.{k}" for k in sources if f"{section}.{k}" != chosen
                   and is_set(f"{section}.{k}") and f"{section}.{k}" not in given]
        kept = set(_COMPANIONS.get(chosen, ()))
        dropped += [c for d in dropped for c in _COMPANIONS.get(d, ())
                    if c not in kept and c not in given and is_set(c)]
        for key in dropped:
            sec, name = key.split(".")
            del data[sec][name]
        if dropped:
            notes.append(f"{chosen} from the command line replaces the config file's "
                         f"{', '.join(dropped)}")
    return data, notes


def load_config(source: str | os.PathLike | None = None,
                overrides: list[str] | None = None, notes: list[str] | None = None) -> Config:
    """Read a YAML file (or a preset name; None = the tiny default), apply overrides, parse.
    A model or reward source given on the command line replaces the file's (its `arch` by a
    `path`, its tokenizer with it); `notes`, when given, receives one line per key replaced."""
    data, replaced = _command_line_sources(_read_yaml(source), overrides or [])
    if notes is not None:
        notes.extend(replaced)
    data = apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, data)) from None


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Lines `key (default): description` for every field, for `ds-ppo config`."""
    lines = []
    for name, field in model.model_fields.items():
        sub = _section_type(model, name)
        key = f"{prefix}{name}"
        if sub is not None:
            lines.extend(describe(sub, key + "."))
        else:
            default = field.get_default(call_default_factory=True)
            lines.append(f"{key} (default {yaml_value(default)}): {field.description or ''}")
    return lines


def yaml_value(value: Any) -> str:
    """A default as it is written in a config file: null, true, [0.9, 0.95], {}, auto."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value.strip() and _load_yaml(value) == value else repr(value)
    return repr(value)
