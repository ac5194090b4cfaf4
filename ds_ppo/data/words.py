"""Word lists of the tiny default task (imports nothing).

The tiny default rewards a response by the fraction of its words that are in
``POSITIVE_WORDS``; ``tiny_corpus.txt`` uses each of them often enough that each is one
SentencePiece piece ("▁good") in the builtin tokenizer, so the policy can learn to emit
them in a single step.
"""
from __future__ import annotations

POSITIVE_WORDS: tuple[str, ...] = (
    "good", "great", "happy", "love", "nice", "wonderful", "best", "kind", "joy", "bright",
    "fun", "beautiful", "amazing", "friendly", "warm", "calm", "glad", "lovely", "sweet", "brave",
)

# Also frequent in the corpus, so the untrained policy has something to move away from.
NEGATIVE_WORDS: tuple[str, ...] = (
    "bad", "sad", "angry", "terrible", "awful", "ugly", "cold", "mean", "boring", "dark",
    "tired", "scared", "lonely", "rude", "dull", "upset", "horrible", "sick", "poor", "wrong",
    "hate", "worst",
)
