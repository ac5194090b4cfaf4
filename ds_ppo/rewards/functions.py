"""Built-in reward functions: the tiny default's task and a verifiable final-answer check.

A reward function takes the batch's prompts and responses as text and returns one float per
response: `f(prompts: list[str], responses: list[str]) -> list[float]`. With
`data.reward_keys: [answer]` it also gets each response's dataset value of that column:
`f(prompts, responses, answer=[...])` (a reference answer for a verifiable reward).
"""
from __future__ import annotations

import re

_WORD = re.compile(r"[a-z']+")


def positive_words(prompts: list[str], responses: list[str]) -> list[float]:
    """The tiny default's task: the share of a response's words that are positive words
    (good, happy, love, ...; ds_ppo.data.words.POSITIVE_WORDS). A random policy says few of them;
    PPO teaches it to speak positively. Range [0, 1]; an empty response scores 0."""
    from ds_ppo.data.words import POSITIVE_WORDS

    positive = set(POSITIVE_WORDS)
    scores = []
    for text in responses:
        words = _WORD.findall(text.lower())
        scores.append(sum(w in positive for w in words) / len(words) if words else 0.0)
    return scores


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _final_answer(text: str) -> str | None:
    """The last \\boxed{...} of a response, else its last number; None when it has neither."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(answer: str) -> str:
    a = answer.strip().strip("$").replace(",", "").rstrip(".")
    try:
        return repr(float(a))  # 3, 3.0 and 3.00 are the same answer
    except ValueError:
        return " ".join(a.lower().split())


def final_answer_match(prompts: list[str], responses: list[str], answer: list) -> list[float]:
    """A verifiable reward (data.reward_keys: [answer]): 1.0 when the response's final answer
    (its last \\boxed{...}, else its last number) equals the row's reference answer (numbers
    compared as numbers, text without case or extra spaces), else 0.0."""
    scores = []
    for response, reference in zip(responses, answer):
        found = _final_answer(response)
        scores.append(float(found is not None and _normalise(found) == _normalise(str(reference))))
    return scores
