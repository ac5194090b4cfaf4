"""The README's quick-start commands: the lines of the first ```bash block under
"## Quick start". `.ci/run` runs them as written, in order (`--print` writes them out);
tests/unit/test_docs.py checks that they install torch first and end with the test suite.

    python tests/support/quick_start.py --print
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def commands(readme: str) -> list[str]:
    """The quick start's command lines (comments and blank lines left out)."""
    section = readme.split("## Quick start", 1)
    if len(section) < 2:
        raise SystemExit("README.md has no '## Quick start' section")
    block = re.search(r"```bash\n(.*?)```", section[1], re.S)
    if block is None:
        raise SystemExit("README.md's quick start has no ```bash block")
    lines = [ln.strip() for ln in block.group(1).splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


if __name__ == "__main__":
    if sys.argv[1:] != ["--print"]:
        raise SystemExit(__doc__)
    print("\n".join(commands(README.read_text())))
