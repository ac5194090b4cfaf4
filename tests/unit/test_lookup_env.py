"""The built-in lookup environment (ds_ppo/envs/lookup.py, preset `lookup`): its steps and
rewards, and its data: every prompt once per code, so never copying is right 1/4 of the time at
best and copying always."""
from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from conftest import REPO
from ds_ppo.config import load_config
from ds_ppo.envs.base import load_python_env
from ds_ppo.envs.lookup import CALL_REWARD, CODES, Lookup, tasks


def test_lookup_then_a_copied_answer():
    env = Lookup()
    env.reset("look up the code of the red box .", code="7")
    call = env.step(" code =")
    assert (call.observation, call.reward, call.done) == (" 7", CALL_REWARD, False)
    answer = env.step(" 7 .")
    assert answer.done and answer.reward == 1.0
    assert answer.info == {"lookup": 1.0, "correct": 1.0, "correct_7": 1.0}


def test_a_guess_without_lookup_and_a_second_lookup_is_an_answer():
    env = Lookup()
    env.reset("p", code="3")
    step = env.step(" 5")
    assert step.done and step.reward == 0.0
    assert step.info == {"lookup": 0.0, "correct": 0.0, "correct_3": 0.0}
    env.reset("p", code="3")
    env.step("=")
    step = env.step(" = 3")  # after the one lookup, any turn is the answer: 3 is its number
    assert step.done and step.reward == 1.0 and step.info["lookup"] == 1.0


def test_no_prompt_tells_its_code():
    rows = [json.loads(line) for line in
            (REPO / "ds_ppo" / "data" / "lookup.jsonl").read_text().splitlines()]
    assert rows == tasks()  # the packaged data is tasks()'s
    codes = defaultdict(list)
    for r in rows:
        codes[r["prompt"]].append(r["code"])
    assert len(codes) == 64 and all(sorted(c) == sorted(CODES) for c in codes.values())
    # the best answer that ignores the observation: one code, right 1/4 of the time
    assert max(Counter(r["code"] for r in rows).values()) / len(rows) == 0.25


def test_the_preset_runs_the_environment_with_its_column():
    cfg = load_config("lookup")
    assert cfg.env.function == "ds_ppo.envs.lookup:Lookup" and cfg.data.reward_keys == ["code"]
    assert cfg.data.path == "builtin:lookup" and cfg.env.stop == ["="]
    load_python_env(cfg.env.function, cfg.data.reward_keys)  # its signature fits the column


def _results_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lookup_results",
                                                  REPO / "launch" / "lookup_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_table_blocks_and_verdicts(tmp_path):
    m = _results_script()
    rows = [{"iteration": i, "env/correct": 0.25 if i <= 100 else 0.95 if i <= 200 else 0.5}
            for i in range(1, 301)]
    assert m.accuracy_blocks(rows) == pytest.approx([0.25, 0.95, 0.5])
    assert m.kept([0.25, 0.95, 0.97]) == "from 101, held 100 after"
    assert m.kept([0.25, 0.95, 0.97], last=250) == "from 101, held 50 after"
    assert m.kept([0.25, 0.95], last=174) == "from 101"  # stopped inside the first such block
    assert m.kept([0.25, 0.95, 0.5, 0.95]) == "from 101, lost in 201-300"
    assert m.kept([0.25, 0.3]) == "not reached"
    # a dip the blocks hide: 20 iterations at 0.5 inside a block whose mean is 0.9
    dip = [{"iteration": i, "env/correct": 0.5 if 131 <= i <= 150 else 1.0}
           for i in range(101, 201)]
    assert m.lowest_window(dip, after=100) == "0.50 (131-150)"
    assert m.lowest_window(dip, after=190) == ""  # fewer than 20 iterations left
    run = tmp_path / "recommended_seed2"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = m.table(tmp_path, [1, 2])
    assert "| recommended | 2 | 0.25 | 0.95 | 0.50 | from 101, lost in 201-300 | 0.50 (201-220) |" \
        in text
    assert "calculator" not in text  # runs not made are left out
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:250]))
    assert "| 0.25 | 0.95 | 0.50 (to 250) |" in m.table(tmp_path, [2])  # a run stopped early
    cmd = m.command("calculator", 3, 500, tmp_path)
    assert "seed=3" in cmd and "env.function=ds_ppo.envs.lookup:Lookup" in cmd


def test_every_results_setting_is_a_valid_config():
    from ds_ppo.config import validate
    m = _results_script()
    for name, args in m.SETTINGS.items():
        assert args[0] == "--config", name
        cfg = load_config(args[1], args[2:])
        validate(cfg, 1)
        assert cfg.env.function == "ds_ppo.envs.lookup:Lookup", name
    floor = load_config("lookup", m.SETTINGS["token_floor"][2:])
    assert floor.ppo.entropy_target_scope == "token"
    assert load_config("lookup", m.SETTINGS["bonus_only"][2:]).ppo.samples_per_prompt == 4
