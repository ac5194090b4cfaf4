"""The PPO stages take the few settings they read, not the whole config: each stage's frozen
settings dataclass is built from the config in one function next to it (`advantage_settings`,
`update_settings`, ...), which the driver (ppo/train_job.py, ppo/iteration.py) calls."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re

from conftest import REPO

PPO = REPO / "ds_ppo" / "ppo"
# the driver around the stages builds their settings from the config; so do ppo.schedule's
# rollout worker (rollout_worker.py, once when it starts) and the generation ranks of the split
# placement (split.py), which run the generation stages beside the training loop
DRIVER = {"train_job.py", "iteration.py", "rollout_worker.py", "split.py"}
# stages that still read the config (file -> its functions that do; None: all of them)
STILL_CONFIG: dict[str, set[str] | None] = {}
# Config -> what one stage reads, besides the `<stage>_settings` functions
BUILDERS = {"batching", "greedy_config"}


def _takes_config(fn: ast.FunctionDef) -> bool:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return any(a.arg == "cfg" or (a.annotation is not None and re.search(
        r"\bConfig\b", ast.unparse(a.annotation))) for a in args)


def _config_takers() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PPO.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_config(node):
                found.setdefault(path.name, []).append(node.name)
    return found


def test_no_ppo_stage_takes_the_whole_config():
    strays = {}
    for name, fns in _config_takers().items():
        if name in DRIVER or (name in STILL_CONFIG and STILL_CONFIG[name] is None):
            continue
        allowed = STILL_CONFIG.get(name) or set()
        bad = [f for f in fns if f not in allowed and f not in BUILDERS
               and not f.endswith("_settings")]
        if bad:
            strays[name] = bad
    assert not strays, (f"these ppo/ functions take the whole Config: {strays}; give the stage a "
                        "frozen settings dataclass built by a `<stage>_settings(cfg)` next to it")


def test_each_settings_builder_returns_a_frozen_dataclass():
    """`<stage>_settings(cfg)` builds a frozen dataclass of that module (the stage cannot change
    what it was given)."""
    seen = 0
    for name, fns in _config_takers().items():
        module = importlib.import_module(f"ds_ppo.ppo.{name[:-3]}")
        for fn in fns:
            if not fn.endswith("_settings") and fn != "batching":
                continue
            returned = getattr(module, getattr(module, fn).__annotations__["return"])
            assert dataclasses.is_dataclass(returned), (name, fn)
            assert returned.__dataclass_params__.frozen, (name, fn)
            seen += 1
    # advantages, batching, correction, dynamic, episodes, evaluate, report, rollout, scoring (with
    # the reward's and the reward call's), update
    assert seen >= 12


def test_the_check_sees_a_function_that_takes_the_config(tmp_path, monkeypatch):
    """A stage that takes `cfg: Config` again is caught (the check is not vacuous)."""
    import sys

    fake = tmp_path / "ppo"
    fake.mkdir()
    (fake / "update.py").write_text("def ppo_update(exp, engines, cfg: Config):\n    pass\n"
                                    "def update_settings(cfg: Config):\n    pass\n")
    (fake / "train_job.py").write_text("def start(cfg: Config):\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "PPO", fake)
    assert _config_takers() == {"train_job.py": ["start"],
                              "update.py": ["ppo_update", "update_settings"]}
    try:
        test_no_ppo_stage_takes_the_whole_config()
    except AssertionError as e:
        assert "update.py': ['ppo_update']" in str(e)
    else:
        raise AssertionError("a stage taking Config passed the check")
