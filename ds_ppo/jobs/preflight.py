"""What `ds-ppo train` checks after the config parses and before anything heavy imports: the
data's columns (read from the first rows of a local file) and the reward function's signature
(every start), and with `--dry-run` also that local paths exist. No torch, no DeepSpeed: a dry
run takes about a second.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ds_ppo.config.paths import is_placeholder, missing_paths, placeholders
from ds_ppo.errors import ConfigError, DataError

if TYPE_CHECKING:
    from ds_ppo.config import Config


def data_column_problems(cfg: Config) -> list[str]:
    """data.prompt_key / data.messages_key and data.reward_keys against the columns of the
    training file (and of data.eval_split when that is a file); [] where the columns cannot be
    read cheaply (hub names, save_to_disk directories: the real start checks those)."""
    from ds_ppo.data.readers import SINGLE_SPLIT, is_file_spec, parse_split, peek_columns
    from ds_ppo.data.validate import column_problems

    d = cfg.data
    if d.path is None:
        return []
    sources = []
    try:
        sources.append((d.path, d.format, parse_split(d.split)[0]))
        if d.eval_split is not None and is_file_spec(d.eval_split):
            sources.append((d.eval_split, "auto", SINGLE_SPLIT))
    except DataError:
        pass  # a malformed split spec: the real start's message says how to write it
    problems = []
    for path, fmt, split in sources:
        peek = peek_columns(path, fmt, split)
        if peek is not None:
            problems += column_problems(peek[0], peek[1], d)
    return problems


def placeholder_problem(cfg: Config, sections: tuple[str, ...] | None = None) -> str:
    """The settings that still hold a preset's /path/to/... placeholder, as one problem."""
    return "\n    ".join(["paths still to fill in (the preset's placeholders; every other "
                          "setting is checked):", *placeholders(cfg, sections)])


def ptx_problems(cfg: Config) -> list[str]:
    """data.ptx_path's rows, read and checked as the run reads them (with ppo.ptx_coef > 0)."""
    if cfg.ppo.ptx_coef <= 0 or cfg.data.ptx_path is None:
        return []
    from ds_ppo.data.validate import read_ptx

    try:
        read_ptx(cfg.data.ptx_path, cfg.data.ptx_format, cfg.data.prompt_key)
    except DataError as e:
        return [str(e)]
    return []


def preflight(cfg: Config, paths: bool = False) -> None:
    """Raise one ConfigError listing every problem found: local paths that do not exist (with
    `paths`, the dry run), missing data columns, a reward function that cannot be imported or
    called with data.reward_keys; with `paths`, a distillation teacher's vocabulary against the
    student's (its tokenizers load: the only dry-run check that imports transformers). Columns come before the signature, so a misspelt
    data.reward_keys entry is reported as the column it does not name."""
    problems = missing_paths(cfg) if paths else []
    if placeholders(cfg):  # a preset's settings are checked before its paths are filled in
        problems.append(placeholder_problem(cfg))
    data_missing = (any(p.startswith("data.path ") for p in problems)
                    or is_placeholder(cfg.data.path))
    columns = [] if data_missing else data_column_problems(cfg)
    problems += columns
    if paths and not any(p.startswith("data.ptx_path ") for p in problems):
        problems += ptx_problems(cfg)
    if paths and cfg.teacher.path is not None and not placeholders(cfg, ("teacher", "policy")) \
            and not any(p.startswith(("teacher.", "policy.")) for p in problems):
        from pathlib import Path

        from ds_ppo.data.tokenizer import teacher_problem

        problem = teacher_problem(cfg, Path(cfg.output_dir))
        if problem is not None:
            problems.append(problem)
    keys_ok = not any("(data.reward_keys)" in p for p in columns)
    if cfg.reward.function is not None and keys_ok:
        from ds_ppo.rewards.call import load_reward_function

        try:
            load_reward_function(cfg.reward.function, cfg.data.reward_keys)
        except ConfigError as e:
            problems.append(str(e))
    raise_problems(problems)


# what `ds-ppo sft` / `ds-ppo rm` read of the config's paths: their data and the policy section
JOB_SECTIONS = ("data", "policy")


def job_preflight(cfg: Config, job: str) -> None:
    """`ds-ppo sft|rm --dry-run`: local paths that do not exist and placeholders still to fill
    in (one ConfigError listing them), then the rows of the training and evaluation files, read
    and checked as the job reads them."""
    problems = missing_paths(cfg, job=job)
    if placeholders(cfg, JOB_SECTIONS):
        problems.append(placeholder_problem(cfg, JOB_SECTIONS))
    raise_problems(problems)
    from ds_ppo.data.supervised_rows import check_rows

    check_rows(cfg, job)
    if cfg.data.eval_split is not None:
        check_rows(cfg, job, cfg.data.eval_split)


def raise_problems(problems: list[str]) -> None:
    """One ConfigError: the problem, or `N problems:` and each on a line of its own."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("\n  ".join([f"{len(problems)} problems:", *problems]))
