"""Every number of the config is range-checked before anything runs.

The test walks the typed config tree (every section, also the optional ones such as
policy.lora), finds every numeric key and gives it NaN, infinity and a value outside its range:
`ds-ppo train --dry-run` and `ds-ppo train` (in process, through the CLI's `main`, with the
training itself replaced by a failure: the config path is the one `train` runs before any model
loads) must both exit 2 with one message naming the key, and no traceback. A numeric key added
later without a range fails `test_every_numeric_key_has_a_range` until it gets one (a Field
constraint, or a rule in config/checks.py listed in OUT_OF_RANGE below).
"""
from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from conftest import clean_env, run_cli
from ds_ppo.cli import main
from ds_ppo.config import Config

# keys whose range is a rule of config/checks.py (not a Field constraint): a value outside it
OUT_OF_RANGE = {
    "policy.max_grad_norm": "0", "value.max_grad_norm": "0",
    "policy.betas": "[0.9, 1.0]", "value.betas": "[-0.1, 0.9]",
    "reward.score_clip": "0", "ppo.value_clip_eps": "0", "ppo.kl_loss_coef": "-0.1",
    "ppo.clip_eps_high": "0", "ppo.dual_clip": "1.0",
    "watchdog_minutes": "30",  # must be below dist_timeout_minutes (30 in the tiny preset)
}
# numeric keys with no range to leave (NaN and infinity are still refused)
ANY_VALUE = {"seed": "any integer seeds the run"}
# free-form maps whose numbers go to transformers as they are: NaN and infinity refused
FREE_MAPS = {"policy.arch": "initializer_range", "value.arch": "initializer_range"}


def _numeric(annotation) -> bool:
    args = typing.get_args(annotation) or (annotation,)
    if typing.get_origin(annotation) is typing.Literal:
        return False
    return any(a in (int, float) or (typing.get_origin(a) is None and a in (int, float))
               for a in args) and bool not in args


def _section(annotation) -> type[BaseModel] | None:
    for a in typing.get_args(annotation) or (annotation,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def numeric_keys(model: type[BaseModel] = Config, prefix: str = ""):
    """(dotted key, field) of every numeric leaf, optional sections included."""
    for name, field in model.model_fields.items():
        sub = _section(field.annotation)
        if sub is not None:
            yield from numeric_keys(sub, f"{prefix}{name}.")
        elif typing.get_origin(field.annotation) is tuple:  # policy.betas
            if all(_numeric(a) for a in typing.get_args(field.annotation)):
                yield f"{prefix}{name}", field
        elif _numeric(field.annotation):
            yield f"{prefix}{name}", field


def _beyond(field) -> str | None:
    """A value just outside the field's declared bounds (gt/ge/lt/le), as YAML."""
    is_int = int in (typing.get_args(field.annotation) or (field.annotation,))
    for m in field.metadata:
        for attr, step in (("gt", 0), ("ge", -1), ("lt", 0), ("le", 1)):
            bound = getattr(m, attr, None)
            if bound is not None:
                value = bound + step
                return str(int(value) if is_int else float(value))
    return None


KEYS = dict(numeric_keys())


def bad_values(key: str) -> list[str]:
    field = KEYS[key]
    out_of_range = OUT_OF_RANGE.get(key) or _beyond(field)
    if typing.get_origin(field.annotation) is tuple:
        return ["[0.9, .nan]", "[.inf, 0.9]", out_of_range]
    return [".nan", ".inf"] + ([out_of_range] if out_of_range else [])


def test_every_numeric_key_has_a_range():
    assert len(KEYS) > 60, sorted(KEYS)  # the walk found the tree (policy.lora.r, ppo.*, ...)
    assert "policy.lora.r" in KEYS and "policy.betas" in KEYS and "ppo.kl_clip" in KEYS
    unranged = [k for k in KEYS if k not in ANY_VALUE and not (OUT_OF_RANGE.get(k)
                                                                or _beyond(KEYS[k]))]
    assert not unranged, f"numeric keys without a range (add a Field bound or a check): {unranged}"


@pytest.fixture
def no_training(monkeypatch):
    """`ds-ppo train` up to the point where models would load; loading is a test failure. The
    tiny preset's YAML is parsed once (pure-Python YAML: 30 ms a parse, ~600 parses here)."""
    import copy

    import ds_ppo.config.load
    import ds_ppo.trainer

    preset = ds_ppo.config.load._read_yaml(None)
    monkeypatch.setattr(ds_ppo.config.load, "_read_yaml",
                        lambda source: copy.deepcopy(preset) if source is None else 1 / 0)

    def refuse(cfg):
        raise AssertionError("the config was accepted and training started")
    monkeypatch.setattr(ds_ppo.trainer, "train", refuse)


@pytest.mark.parametrize("key", sorted(KEYS) + [f"{m}.{k}" for m, k in FREE_MAPS.items()])
def test_nan_inf_and_out_of_range_stop_dry_run_and_train(key, no_training, capsys, tmp_path,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = bad_values(key) if key in KEYS else [".nan", ".inf"]
    for value in values:
        for dry in (["--dry-run"], []):
            assert main(["train", *dry, f"{key}={value}"]) == 2, (key, value, dry)
            err = capsys.readouterr().err
            shown = key.rsplit(".", 1)[0] if key.endswith(".betas") else key
            assert shown in err and "Traceback" not in err, (key, value, err)
            assert err.count("\n") <= 3, err  # one message, not a dump


@pytest.mark.parametrize("override, shown", [
    ("policy.betas=[0.9,2.0]", "policy.betas = [0.9, 2.0]: each must be in [0, 1)"),
    ("reward.score_clip=.nan", "reward.score_clip = nan: Input should be a finite number"),
])
def test_real_train_command_stops_before_any_model_loads(override, shown, tmp_path):
    proc = run_cli(["train", override, f"output_dir={tmp_path}/out"], cwd=tmp_path,
                   env=clean_env(), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert shown in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # nothing started


# durations, at the longest the platform's clocks can represent (1e9 s: thread waits, sockets
# and collectives count nanoseconds in 64 bits) and just past it
DURATIONS = {"reward.timeout_s": ("1e9", "1.1e9"), "env.timeout_s": ("1e9", "1e12"),
             "dist_timeout_minutes": ("16666666", "1e10"), "watchdog_minutes": (None, "1e9")}
INTEGERS = sorted(k for k, f in KEYS.items()
                  if int in (typing.get_args(f.annotation) or (f.annotation,)))


def test_every_duration_is_bounded():
    assert sorted(k for k in KEYS if k.endswith(("_s", "_minutes"))) == sorted(DURATIONS)


@pytest.mark.parametrize("key", sorted(DURATIONS) + INTEGERS)
def test_values_the_platform_cannot_represent_stop_the_dry_run(key, no_training, capsys,
                                                               tmp_path, monkeypatch):
    """A duration past 1e9 s (reward.timeout_s=1e12 was an OverflowError at the first reward
    call, dist_timeout_minutes=1e10 a C++ abort) and a count or seed past 64 bits: one line
    naming the key at --dry-run; the longest duration itself is accepted."""
    monkeypatch.chdir(tmp_path)
    ok, beyond = DURATIONS.get(key, (None, str(10**20)))
    assert main(["train", "--dry-run", f"{key}={beyond}"]) == 2, key
    err = capsys.readouterr().err
    assert f"{key} = " in err and "Traceback" not in err and err.count("\n") <= 3, err
    if key in DURATIONS:
        assert "about 31 years" in err, err
    elif key in ("seed", "iterations"):  # no bound of their own: the 64-bit one
        assert "must be at most 9223372036854775807 in size" in err, err
    if ok is not None:
        assert main(["train", "--dry-run", f"{key}={ok}"]) == 0, capsys.readouterr().err
