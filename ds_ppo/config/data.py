"""The `data` section: prompt files, splits, columns, evaluation prompts and ptx rows."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ppo.config.section_base import Section


class DataConfig(Section):
    path: str | None = Field(
        None, description="Prompt dataset: a JSON/JSONL/CSV/Parquet file, a save_to_disk "
        "directory or a hub name; null = the prompts shipped with the tiny default.")
    format: Literal["auto", "json", "jsonl", "csv", "parquet", "disk", "hub"] = Field(
        "auto", description="How to read `path`; auto decides by file ending.")
    prompt_key: str = Field("prompt", description="Column holding plain-text prompts.")
    messages_key: str = Field(
        "messages", description="Column holding chat messages (list of {role, content}), rendered "
        "with the tokenizer's chat template; used when prompt_key is absent.")
    split: str = Field("train", description="Dataset split for training prompts.")
    eval_split: str | None = Field(
        None, description="Optional evaluation prompts: a split spec (test, train[90%:]) or a "
        "file; scored with greedy responses every data.eval_every iterations.")
    eval_every: int = Field(10, ge=0, description="Evaluate every N iterations (0: never).")
    eval_size: int = Field(64, gt=0, description="Evaluation prompts used (at most; rounded down "
                           "to a multiple of the world size).")
    max_prompt_len: int = Field(256, gt=0, description="Longest prompt in tokens.")
    truncation: Literal["left", "drop"] = Field(
        "left", description="Prompts over max_prompt_len: keep their end (left) or drop them.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed row stops before training (error) or is counted and "
        "skipped (skip).")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch with the run's seed.")
    ptx_path: str | None = Field(
        None, description="PPO-ptx rows (ppo.ptx_coef): a JSON/JSONL/CSV/Parquet file (read as "
        "data.path is) whose rows hold `text` (pretraining text: the loss on every token after "
        "the first) or data.prompt_key + `completion` (SFT rows: the loss on the completion and "
        "its EOS).")
    ptx_format: Literal["auto", "json", "jsonl", "csv", "parquet", "disk", "hub"] = Field(
        "auto", description="How to read data.ptx_path; auto decides by file ending.")
    ptx_max_len: int = Field(512, gt=1, description="Longest ptx row in tokens: a text keeps "
                             "its start, a prompt its end, a completion its start.")
    reward_keys: list[str] = Field(
        default_factory=list, description="Dataset columns passed to reward.function as keyword "
        "arguments (to reward.url as JSON lists), one value per response, e.g. [answer] for a "
        "reference answer: f(prompts, responses, answer=[...]). Every row must have them.")
