"""Prompts, tokenizers and re-encoding for the reward model.

Importing this package imports neither ``datasets`` nor ``transformers``: each function
imports what it needs, so the builtin prompts work where ``datasets`` is not installed.
"""
from ds_ppo.data.words import NEGATIVE_WORDS, POSITIVE_WORDS

__all__ = ["POSITIVE_WORDS", "NEGATIVE_WORDS"]
