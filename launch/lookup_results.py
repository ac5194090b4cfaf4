#!/usr/bin/env python
"""docs/RESULTS.md's lookup table: the lookup task (preset `lookup`) trained with the calculator
preset's settings, with the recommended ones (the preset) and with the entropy target as a floor
on each token's entropy, for each seed, then env/correct (the share of right answers) averaged
per block of 100 iterations, and whether a run kept what it learned: the blocks after the first
at >= 0.9, and the lowest 20-iteration mean after that block.

    python launch/lookup_results.py                          # seeds 1 2 3, 1500 iterations
    python launch/lookup_results.py --seeds 1 --iterations 300 --out /tmp/lookup
    python launch/lookup_results.py --table-only --out outputs/lookup_results
    python launch/lookup_results.py --settings recommended --seeds 2 --out outputs/lookup_results

Each (settings, seed) is a run of its own: several commands with different --seeds (or
--settings) can run side by side on the same --out.

Runs one after another on CPU (30-60 minutes each at 1500 iterations); a finished run is not run
again (the trainer sees its output_dir complete), so the command can be repeated after an
interruption.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# the calculator preset's settings, on the lookup task
BASELINE = ["--config", "calculator", "env.function=ds_ppo.envs.lookup:Lookup",
            "data.path=builtin:lookup", "data.reward_keys=[code]"]
# the lookup preset: the same, plus 8 responses per prompt, an entropy bonus steered by
# ppo.entropy_target (on the mean token entropy), ppo.zero_std_advantage, ppo.dynamic_sampling,
# a cosine learning-rate decay, the alarm on env/correct and checkpoint.keep_best
RECOMMENDED = ["--config", "lookup"]
# the preset with the target as a floor on each token's entropy instead
TOKEN_FLOOR = RECOMMENDED + ["ppo.entropy_target_scope=token", "ppo.entropy_target=4.0"]
# the preset without the batch baseline of the groups that score alike (and with 4 rounds)
NO_ZERO_STD = RECOMMENDED + ["ppo.zero_std_advantage=0", "ppo.dynamic_sampling_max_rounds=4"]
# the entropy bonus and dynamic sampling alone: 4 responses per prompt, a constant learning rate
BONUS_ONLY = NO_ZERO_STD + ["ppo.samples_per_prompt=4", "ppo.mini_batch_size=32",
                            "policy.schedule=constant"]
BONUS_ONLY_FLOOR = BONUS_ONLY + ["ppo.entropy_target_scope=token", "ppo.entropy_target=4.0"]
SETTINGS = {"calculator": BASELINE, "recommended": RECOMMENDED, "token_floor": TOKEN_FLOOR,
            "no_zero_std": NO_ZERO_STD, "bonus_only": BONUS_ONLY,
            "bonus_only_floor": BONUS_ONLY_FLOOR}
BLOCK = 100
WINDOW = 20  # iterations of the lowest mean after the share was reached


def command(settings: str, seed: int, iterations: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "ds_ppo", "train", *SETTINGS[settings], f"seed={seed}",
            f"iterations={iterations}", f"output_dir={out / f'{settings}_seed{seed}'}",
            "tracking.enabled=false", "log_every=50"]


def accuracy_blocks(rows: list[dict], key: str = "env/correct") -> list[float]:
    """The mean of `key` over each block of BLOCK iterations (a last, partial block too)."""
    blocks: dict[int, list[float]] = {}
    for r in rows:
        if key in r:
            blocks.setdefault((r["iteration"] - 1) // BLOCK, []).append(r[key])
    return [sum(v) / len(v) for _, v in sorted(blocks.items())]


def kept(blocks: list[float], last: int | None = None, ceiling: float = 1.0,
         share: float = 0.9) -> str:
    """When a run first reached `share` of the ceiling (a block's mean), and whether every later
    block stayed there: held for how many iterations after that block, or the block it lost it
    in. `last`: the run's last iteration (default: the end of the last block)."""
    first = next((i for i, b in enumerate(blocks) if b >= share * ceiling), None)
    if first is None:
        return "not reached"
    lost = next((i for i in range(first + 1, len(blocks)) if blocks[i] < share * ceiling), None)
    if lost is not None:
        return f"from {first * BLOCK + 1}, lost in {lost * BLOCK + 1}-{(lost + 1) * BLOCK}"
    last = len(blocks) * BLOCK if last is None else last
    if last <= (first + 1) * BLOCK:  # stopped inside that block
        return f"from {first * BLOCK + 1}"
    return f"from {first * BLOCK + 1}, held {last - (first + 1) * BLOCK} after"


def lowest_window(rows: list[dict], after: int, width: int = WINDOW,
                  key: str = "env/correct") -> str:
    """The lowest mean of `key` over `width` consecutive iterations after iteration `after`, and
    where it starts: a dip that a block's mean hides."""
    values = [(r["iteration"], r[key]) for r in rows if key in r and r["iteration"] > after]
    if len(values) < width:
        return ""
    means = [(sum(v for _, v in values[i:i + width]) / width, values[i][0])
             for i in range(len(values) - width + 1)]
    low, start = min(means)
    return f"{low:.2f} ({start}-{start + width - 1})"


def table(out: Path, seeds: list[int]) -> str:
    lines, width = [], 0
    rows = []
    for settings in SETTINGS:
        for seed in seeds:
            log = out / f"{settings}_seed{seed}" / "metrics.jsonl"
            if not log.exists():
                continue
            metrics = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
            blocks = accuracy_blocks(metrics)
            width = max(width, len(blocks))
            first = next((i for i, b in enumerate(blocks) if b >= 0.9), None)
            low = "" if first is None else lowest_window(metrics, (first + 1) * BLOCK)
            rows.append((settings, seed, blocks, low, metrics[-1]["iteration"]))
    head = [f"{i * BLOCK + 1}-{(i + 1) * BLOCK}" for i in range(width)]
    lines.append("| settings | seed | " + " | ".join(head) + " | >= 0.9 | lowest "
                 f"{WINDOW}-iteration mean after |")
    lines.append("|---|---|" + "---|" * len(head) + "---|---|")
    for settings, seed, blocks, low, last in rows:
        cells = [f"{b:.2f}" for b in blocks] + [""] * (width - len(blocks))
        if last % BLOCK:  # a run stopped inside a block: the block's mean so far, and where
            cells[len(blocks) - 1] += f" (to {last})"
        lines.append(f"| {settings} | {seed} | " + " | ".join(cells)
                     + f" | {kept(blocks, last)} | {low} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=Path("outputs/lookup_results"))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if not args.table_only:
        for settings in args.settings:
            for seed in args.seeds:
                cmd = command(settings, seed, args.iterations, args.out)
                print("+", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True)
    print(table(args.out, args.seeds))


if __name__ == "__main__":
    main()
