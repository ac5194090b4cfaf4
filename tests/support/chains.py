"""Chains of `ds-ppo` commands in one launched two-rank job (tests/support/chained_runs.py),
and what the kill/resume tests compare of their runs: the metrics but for timings, and the
final weights."""
from __future__ import annotations

import json
import subprocess

from conftest import REPO, clean_env, deepspeed_cmd, free_port

# metrics that depend on the machine's speed, never equal between two runs
VOLATILE = ("time/", "tokens_per_s/", "memory/", "async/training", "async/generation",
            "async/weight_sync_s")
KILL = "kill_during_save:4"  # a fault that kills a command in its iteration-4 save


def run_chain(work, name: str, runs: list[tuple[list[str], str | None]]):
    """The commands `runs` ((argv, fault) each) one after another on two launched ranks."""
    plan = work / f"{name}.json"
    plan.write_text(json.dumps([{"argv": argv, "fault": fault} for argv, fault in runs]))
    return subprocess.run([*deepspeed_cmd(2, free_port()), str(REPO / "tests" / "support" /
                                                               "chained_runs.py"), str(plan)],
                          cwd=work, env=clean_env(), capture_output=True, text=True, timeout=900)


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def final_weights(out):
    """The policy's weights in the run's iteration-4 checkpoint."""
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / "iter_000004" / "hf" / "model.safetensors")
