"""`ds-ppo samples OUTPUT_DIR`: the sample tables a run wrote to output_dir/samples.jsonl (the
rows of MLflow's `samples/` and `eval_samples/` tables: prompt, response, score, a chat
prompt's messages and the data.reward_keys columns, with the iteration and split), read back
without MLflow. A chat prompt is shown as its messages, one line per turn."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ds_ppo.errors import UserError

FIXED = ("iteration", "split", "prompt", "response", "score", "messages")


def read_samples(output_dir: str | Path) -> list[dict]:
    """Every row of output_dir/samples.jsonl (a torn last line is skipped)."""
    path = Path(output_dir) / "samples.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no such file; a run writes it every "
                        "tracking.log_samples_every iterations (and at each evaluation)")
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = []
    for n, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n < len(lines):
                raise UserError(f"{path} line {n} is not a JSON row") from None
    return rows


def select(rows: list[dict], iteration: int | None, split: str | None) -> tuple[int, list[dict]]:
    """The rows of one iteration (default: the latest that has rows of `split`)."""
    rows = [r for r in rows if split is None or r.get("split") == split]
    iterations = sorted({r["iteration"] for r in rows})
    if not iterations:
        raise UserError(f"no {split + ' ' if split else ''}samples were logged")
    if iteration is None:
        iteration = iterations[-1]
    elif iteration not in iterations:
        raise UserError(f"no samples at iteration {iteration}; iterations with samples: "
                        f"{', '.join(map(str, iterations))}")
    return iteration, [r for r in rows if r["iteration"] == iteration]


def format_rows(rows: list[dict]) -> str:
    """A readable listing: one block per row (score, extra columns, prompt or chat, response)."""
    out = []
    for i, r in enumerate(rows, start=1):
        extra = "".join(f" | {k}: {json.dumps(v, ensure_ascii=False)}" for k, v in r.items()
                        if k not in FIXED)
        out.append(f"[{i}] {r.get('split', 'train')} | score {r['score']:+.4f}{extra}\n"
                   f"{_prompt_lines(r)}\n    response: {r['response']!r}")
    return "\n".join(out)


def _prompt_lines(row: dict) -> str:
    """`prompt: '...'`, or for a chat prompt its turns: `chat:` then `  user: '...'` lines."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return f"    prompt:   {row['prompt']!r}"
    width = max(len(str(m.get("role", ""))) for m in messages) if messages else 0
    turns = [f"      {str(m.get('role', '')) + ':':<{width + 1}} {m.get('content', '')!r}"
             for m in messages]
    return "\n".join(["    chat:", *turns])


def main(args: argparse.Namespace) -> int:
    iteration, rows = select(read_samples(args.output_dir), args.iteration, args.split)
    if args.json:
        print("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
        return 0
    print(f"iteration {iteration}: {len(rows)} samples from {args.output_dir}/samples.jsonl")
    print(format_rows(rows))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("samples", help="print the sample prompts, responses and scores a run "
                       "logged (output_dir/samples.jsonl)")
    p.add_argument("output_dir", help="the run's output_dir")
    p.add_argument("--iteration", type=int, default=None,
                   help="the iteration to show (default: the latest with samples)")
    p.add_argument("--split", choices=["train", "eval"], default=None,
                   help="training samples or the evaluation's greedy ones (default: both)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=main)
