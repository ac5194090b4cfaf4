"""File names say what they hold: two modules of the package share a name only where they are
parallel on purpose (each job's task, each command's CLI and entry point, packages)."""
from __future__ import annotations

from collections import Counter

from conftest import REPO

# the same role in parallel packages: sft/task.py and rm/task.py, the ds-ppo and bench CLIs
PARALLEL = {"__init__.py", "__main__.py", "cli.py", "task.py"}


def test_no_two_modules_share_a_name_unless_parallel():
    names = Counter(p.name for p in (REPO / "ds_ppo").rglob("*.py"))
    shared = {name: sorted(str(p.relative_to(REPO / "ds_ppo"))
                           for p in (REPO / "ds_ppo").rglob(name))
              for name, n in names.items() if n > 1 and name not in PARALLEL}
    assert not shared, (f"modules that share a name: {shared}; name each for what it holds "
                        "(e.g. config/rollout_sections.py beside ppo/rollout.py)")
