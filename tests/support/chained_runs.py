"""Several `ds-ppo` commands, one after another, in one launched job: the launcher and each
rank's imports (10-20 s per launch on a small machine) are paid once per chain, not once per
command. Each command runs through `ds_ppo.cli.main`, as `python -m ds_ppo ARGS` would.

    deepspeed --num_gpus 2 tests/support/chained_runs.py PLAN.json

PLAN.json is a list of {"argv": [...], "fault": "kill_during_save:4" or null}; `fault` is the
command's DS_PPO_FAULT (fault injection, read when it fires). Rank 0 prints
`[chained_runs] <i> exit <code>` after each command. A fault that kills the process ends the
chain there, as it ends a `ds-ppo train` command; a command that exits non-zero also ends it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from ds_ppo.cli import main as ds_ppo_main

    # the launcher adds --local_rank=N to a script's arguments
    plan_path = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    plan = json.loads(Path(plan_path).read_text())
    for i, run in enumerate(plan):
        os.environ.pop("DS_PPO_FAULT", None)
        if run.get("fault"):
            os.environ["DS_PPO_FAULT"] = run["fault"]
        rc = ds_ppo_main(list(run["argv"]))
        if os.environ.get("RANK", "0") == "0":
            print(f"[chained_runs] {i} exit {rc}", flush=True)
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
