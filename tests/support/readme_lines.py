"""The README's printed training lines, regenerated from a run of the code.

A README code block of progress lines (`iter    1/40 | score ...`) follows a marker line
`<!-- readme-lines: ds-ppo train OVERRIDES -->` that names the command printing them. From the
repository root:

    python -m tests.support.readme_lines            # run each marked command, print its lines
    python -m tests.support.readme_lines --write    # ... and write them into README.md

Runs use one torch thread (OMP_NUM_THREADS=1, as the tests run ds_ppo): the lines are then the
same on every run on one machine. Another make of CPU (other vector kernels, another BLAS)
changes the last bits of the logits, and forty iterations of sampling amplify them: the first
iteration prints the same numbers everywhere, later ones differ as another seed's would. Each
line is cut after `len` (times and eta vary): `... | len 12.0 | ...`. tests/e2e/test_train.py
checks the block of the plain `ds-ppo train` against its run of the tiny default with
`differences`: the first iteration to its printed digits, later ones within the spread of
seeds (BANDS).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- readme-lines: ds-ppo train(?P<args>[^>]*)-->\n(?P<cmd>(?:.*\n)*?)```\n"
                    r"(?P<body>(?:.*\n)*?)```\n")
_LINE = re.compile(r"^iter +(\d+)/\d+ \|")


def cut(line: str) -> str:
    """A progress line as the README shows it: up to its `len` column, then `| ...`."""
    return line.split(" | gen ")[0] + " | ..." if " | gen " in line else line


def progress_lines(stdout: str) -> dict[int, str]:
    """Iteration -> its printed progress line, cut as the README shows it."""
    return {int(m.group(1)): cut(line) for line in stdout.splitlines()
            if (m := _LINE.match(line))}


# Column -> the largest difference between the README's number and a run's after the first
# iteration: about twice the spread of five seeds of the tiny default (iteration 40: score
# 0.70-0.77, kl/tok 0.98-1.15, entropy 5.07-5.35, pg -0.013..-0.026, vf 0.006-0.013); kl/tok
# is relative. A changed default that moves a number past its band needs the README rewritten.
BANDS = {"score": 0.15, "kl/tok": 0.4, "entropy": 0.35, "pg": 0.03, "vf": 0.015, "len": 1.0}
RELATIVE = {"kl/tok"}
_FIELD = re.compile(r"\| (?P<name>[a-z/]+) (?P<value>[-+]?\d+\.\d+(?:e[-+]\d+)?)")


def fields(line: str) -> dict[str, float]:
    """The numbers of a progress line: {'score': 0.0493, 'kl/tok': 0.0, ...}."""
    return {m.group("name"): float(m.group("value")) for m in _FIELD.finditer(line)}


def differences(shown: dict[int, str], printed: dict[int, str]) -> list[str]:
    """Where a run's lines disagree with the README's: the first iteration's line must be the
    same to its last digit (up to one unit of rounding), later ones within BANDS."""
    out = []
    first = min(shown)
    for it, line in shown.items():
        if it not in printed:
            out.append(f"iteration {it}: the run printed no line")
            continue
        want, got = fields(line), fields(printed[it])
        if set(want) != set(got):
            out.append(f"iteration {it}: columns {sorted(got)} instead of {sorted(want)}")
            continue
        for name, w in want.items():
            if it == first:
                ok = abs(got[name] - w) <= 1.5 * 10.0 ** -_decimals(line, name)
            else:
                band = BANDS[name] * (abs(w) if name in RELATIVE else 1.0)
                ok = abs(got[name] - w) <= band
            if not ok:
                out.append(f"iteration {it}: {name} {got[name]} (README: {w})")
    return out


def _decimals(line: str, name: str) -> int:
    """The printed precision: 4 for +0.0213, 7 for -2.13e-05."""
    m = re.search(rf"\| {name} [-+]?\d+\.(\d+)(?:e([-+]\d+))?", line)
    return len(m.group(1)) - int(m.group(2) or 0) if m else 0


def blocks(readme: str) -> list[tuple[list[str], dict[int, str]]]:
    """(overrides, {iteration: line}) of every marked block of progress lines."""
    found = []
    for m in MARKER.finditer(readme):
        found.append((m.group("args").split(), progress_lines(m.group("body"))))
    return found


def run(overrides: list[str]) -> str:
    """The stdout of `ds-ppo train OVERRIDES` in a fresh output_dir, one torch thread."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "ds_ppo", "train", f"output_dir={tmp}/out",
                               *overrides], cwd=tmp, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"ds-ppo train {' '.join(overrides)} exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args(argv)
    path = REPO / "README.md"
    readme = path.read_text()
    for overrides, shown in blocks(readme):
        printed = progress_lines(run(overrides))
        new = "\n".join(printed[i] for i in shown) + "\n"
        print(f"ds-ppo train {' '.join(overrides)}\n{new}")
        old_body = "\n".join(shown.values()) + "\n"
        readme = readme.replace(old_body, new, 1)
    if args.write:
        path.write_text(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
