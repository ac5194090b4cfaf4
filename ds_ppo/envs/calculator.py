"""The built-in example environment: a calculator tool (preset `calculator`).

Task (`data.path: builtin:calculator`, ds_ppo/data/calculator.jsonl): questions such as
"what is 3 + 4 ?" with a one-digit answer in the row's `answer` column. The policy cannot do
arithmetic; it can call the calculator. A model turn that contains `=` is a tool call (the
preset's `env.stop: ["="]` ends the turn there): the calculator evaluates the last arithmetic
expression written before it (the model's own, or else the question's) and answers with the
result as the observation (" 7"). Any other turn is the answer: its first number is compared
with the row's answer.

Rewards: CALL_REWARD for the first tool call of an episode; on the answer turn (which ends the
episode) FORMAT_REWARD if it holds a number, plus 1 if that number is the answer. A random policy stumbles on `=` in a few percent of its first turns and on the
right digit rarely; PPO makes both common (docs/GUIDE.md "Environments and tools"). Step.info
reports `tool_call` (the episode called the calculator) and `correct` on the answer turn: metrics
env/tool_call and env/correct.
"""
from __future__ import annotations

import re

from ds_ppo.envs.base import Step

CALL_REWARD = 0.2
FORMAT_REWARD = 0.1
_EXPR = re.compile(r"(\d+)\s*([-+*])\s*(\d+)")
_NUMBER = re.compile(r"-?\d+")


def evaluate(text: str) -> int | None:
    """The value of the last `a op b` (op one of + - *, a and b integers) in `text`; None if
    there is none."""
    found = _EXPR.findall(text)
    if not found:
        return None
    a, op, b = found[-1]
    a, b = int(a), int(b)
    return a + b if op == "+" else a - b if op == "-" else a * b


class Calculator:
    """One episode of the calculator task (env.function: ds_ppo.envs.calculator:Calculator)."""

    def reset(self, prompt: str, answer: str) -> None:
        self.context, self.answer, self.calls = prompt, str(answer).strip(), 0

    def step(self, action: str) -> Step:
        self.context += action
        if "=" in action and self.calls == 0:  # a tool call
            self.calls += 1
            result = evaluate(self.context.rsplit("=", 1)[0])
            observation = " error" if result is None else f" {result}"
            self.context += observation
            return Step(observation, reward=CALL_REWARD)
        numbers = _NUMBER.findall(action)
        correct = bool(numbers) and numbers[0] == self.answer
        return Step(None, reward=FORMAT_REWARD * bool(numbers) + float(correct), done=True,
                    info={"tool_call": float(self.calls > 0), "correct": float(correct)})


def tasks(limit: int = 9) -> list[dict[str, str]]:
    """Every `a + b` and `a - b` with a, b and the result in 0..limit (the packaged data)."""
    rows = []
    for a in range(limit + 1):
        for b in range(limit + 1):
            if a + b <= limit:
                rows.append({"prompt": f"what is {a} + {b} ?", "answer": str(a + b)})
            if a - b >= 0:
                rows.append({"prompt": f"what is {a} - {b} ?", "answer": str(a - b)})
    return rows
