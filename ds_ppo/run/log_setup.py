"""Logging of a training run: rank-tagged lines on stdout, the libraries' notices and progress
bars quiet unless log_level = debug."""
from __future__ import annotations

import logging
import sys
import warnings



# Loggers whose INFO lines say nothing a user acts on: MLflow creating (and migrating) the
# embedded store's tables at a run's start
_QUIET_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration")


def quiet_notices(log_level: str) -> None:
    """Cheap (no library import), before DeepSpeed or MLflow are imported: unless log_level =
    debug, no DeepSpeed accelerator notice (printed at every DeepSpeed import) and no MLflow
    database-creation lines. The command line calls it first thing."""
    if log_level == "debug":
        return
    logging.getLogger("DeepSpeed").addFilter(_no_accelerator_notice)  # a set: added once
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # transformers' deprecation notices about its own internals (e.g. arguments DeepSpeed or
    # peft pass it), which a user of ds_ppo cannot act on
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")


def quiet_libraries(log_level: str) -> None:
    """Before DeepSpeed is imported: unless log_level = debug, `quiet_notices` and no per-save
    "Writing model shards" progress bars from transformers."""
    if log_level == "debug":
        return
    quiet_notices(log_level)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _no_accelerator_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Setting accelerator to")


class _StdoutHandler(logging.StreamHandler):
    """Writes to sys.stdout as it is when a record comes, not as it was at set-up (a stream
    swapped or closed since, as a test's captured output is, would lose the line or raise)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(log_level: str = "info") -> None:
    """Every record as `[ds_ppo rank R] message` on stdout: INFO on rank 0, WARNING elsewhere, DEBUG
    everywhere with log_level = debug."""
    from ds_ppo.engine import dist

    level = logging.INFO if dist.is_main() else logging.WARNING
    if log_level == "debug":
        level = logging.DEBUG
    logging.basicConfig(level=level, format="[ds_ppo rank %(rank)s] %(message)s",
                        handlers=[_StdoutHandler()], force=True)
    old_factory = logging.getLogRecordFactory()
    rank = dist.rank()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.INFO if log_level == "debug" else logging.WARNING)
    # DeepSpeed 0.19 calls collectives that torch 2.13 marks deprecated, once per call
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated")
    import transformers

    if log_level != "debug":
        transformers.logging.set_verbosity_error()  # e.g. the value head "MISSING" load report

