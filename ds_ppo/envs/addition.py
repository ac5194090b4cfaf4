"""A small task that needs competence, for the SFT -> reward model -> RL recipe (README: "From a
base model to an RLHF model"): sums of single digits with an exact answer, "4+7+2=" -> "13".

`write_task` splits every problem of `terms` digits (10^terms of them) once, by a seeded shuffle,
into held-out test problems (never trained on by any step), problems with demonstrations for SFT,
and the rest; and writes the files each step reads:

| file | rows | read by |
|---|---|---|
| sft.jsonl | prompt, completion (the right sum) | `ds-ppo sft` |
| pairs.jsonl | prompt, chosen (right), rejected (wrong): 8 per non-test problem, half near misses | `ds-ppo rm` |
| pairs_test.jsonl | the same for the test problems | `ds-ppo rm` data.eval_split |
| rl.jsonl | prompt, answer: every non-test problem | `ds-ppo train` (answer: data.reward_keys) |
| test.jsonl | prompt, answer (= completion): the test problems | `evaluate` (greedy exact match), `ds-ppo sft` data.eval_split |

A wrong answer is a near miss (the sum +-1, +-2 or +-10: the mistakes a model that almost adds
makes) or, for every other one, any other sum. `exact_match` is the checker, usable as
reward.function (`ds_ppo.envs.addition:exact_match`, with data.reward_keys: [answer]).

`python -m ds_ppo.envs.addition DIR` writes the files; `... --evaluate MODEL_DIR --test FILE`
prints a model's greedy exact-match accuracy.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

FILES = ("sft.jsonl", "pairs.jsonl", "pairs_test.jsonl", "rl.jsonl", "test.jsonl")


def problems(terms: int) -> list[tuple[str, str]]:
    """Every (prompt, answer) of `terms` single digits, in order: ("0+0+1=", "1"), ..."""
    return [("+".join(map(str, d)) + "=", str(sum(d)))
            for d in itertools.product(range(10), repeat=terms)]


def wrong_answer(answer: str, rng: random.Random, terms: int, near: bool) -> str:
    """A wrong sum: near (+-1, +-2, +-10, within 0..9 x terms) or any other in range."""
    right, top = int(answer), 9 * terms
    if near:
        options = [right + d for d in (-10, -2, -1, 1, 2, 10) if 0 <= right + d <= top]
    else:
        options = [s for s in range(top + 1) if s != right]
    return str(rng.choice(options))


def split(terms: int, seed: int, test: int, sft: int) -> dict[str, list[tuple[str, str]]]:
    """The problems shuffled by `seed` and cut into test, sft (demonstrations) and rest."""
    items = problems(terms)
    random.Random(seed).shuffle(items)
    if test + sft > len(items):
        raise ValueError(f"test + sft = {test + sft} > the {len(items)} problems of {terms} terms")
    return {"test": items[:test], "sft": items[test:test + sft], "rest": items[test + sft:]}


def write_task(out_dir: str | Path, seed: int = 0, terms: int = 3, test: int = 200,
               sft: int = 300, pairs_per_problem: int = 8) -> dict[str, Path]:
    """Write the task's files (module docstring) into `out_dir`; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = split(terms, seed, test, sft)
    rng = random.Random(seed + 1)

    def pairs(items):
        return [{"prompt": p, "chosen": a,
                 "rejected": wrong_answer(a, rng, terms, near=k % 2 == 0)}
                for p, a in items for k in range(pairs_per_problem)]

    train = parts["sft"] + parts["rest"]
    rows = {
        "sft.jsonl": [{"prompt": p, "completion": a} for p, a in parts["sft"]],
        "pairs.jsonl": pairs(train),
        "pairs_test.jsonl": pairs(parts["test"]),
        "rl.jsonl": [{"prompt": p, "answer": a} for p, a in train],
        "test.jsonl": [{"prompt": p, "answer": a, "completion": a} for p, a in parts["test"]],
    }
    paths = {}
    for name, content in rows.items():
        paths[name] = out / name
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in content))
    return paths


def exact_match(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the response, stripped, is exactly the answer; else 0.0 (the checker and the
    GRPO reward)."""
    return [float(r.strip() == str(a).strip()) for r, a in zip(responses, answer)]


def evaluate(model_dir: str | Path, test_file: str | Path, batch_size: int = 256,
             max_new_tokens: int = 4) -> float:
    """Greedy exact-match accuracy of a Hugging Face causal LM directory on a test file (plain
    transformers: what a user of the export gets)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(test_file).read_text().splitlines() if line]
    right = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(exact_match([], texts, [r["answer"] for r in chunk]))
    return right / len(rows)


def reward_model_picks(model_dir: str | Path, test_file: str | Path, terms: int = 3) -> float:
    """The share of test problems on which a reward model (a Hugging Face sequence-classification
    directory, plain transformers) scores the right sum highest among every sum 0..9 x terms,
    each written as a completion after the prompt and ended by EOS, as `ds-ppo rm` and
    `ds-ppo train` read answers. The best a policy can do by maximising that reward model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(test_file).read_text().splitlines() if line]
    answers = [tok(str(s), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for s in range(9 * terms + 1)]
    right = 0
    for r in rows:
        prompt = tok(r["prompt"])["input_ids"]
        scores = torch.empty(len(answers))
        for width in sorted({len(a) for a in answers}):  # equal lengths: no padding
            which = [s for s, a in enumerate(answers) if len(a) == width]
            with torch.no_grad():
                scores[which] = model(input_ids=torch.tensor(
                    [prompt + answers[s] for s in which])).logits[:, 0].float()
        right += int(scores.argmax()) == int(r["answer"])
    return right / len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--terms", type=int, default=3)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--sft", type=int, default=300)
    ap.add_argument("--evaluate", metavar="MODEL_DIR")
    ap.add_argument("--test-file")
    args = ap.parse_args(argv)
    if args.evaluate:
        print(f"{evaluate(args.evaluate, args.test_file):.4f}")
        return 0
    for name, path in write_task(args.out_dir, args.seed, args.terms, args.test,
                                 args.sft).items():
        print(f"{name}: {sum(1 for _ in open(path))} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
