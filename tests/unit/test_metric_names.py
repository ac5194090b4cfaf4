"""ds_ppo.metric_names (what tracking.alarms.watch and checkpoint.keep_best may name) lists the
metrics docs/METRICS.md describes, job by job: the end-to-end runs check that every metric they
log is in docs/METRICS.md, so a metric added to the code and the docs but not here fails."""
from __future__ import annotations

import re

from conftest import REPO
from ds_ppo.metric_names import ENV_PREFIX, PPO_METRICS, SUPERVISED_METRICS, is_logged


def _table_keys(text: str) -> set[str]:
    """The backticked names of the first column of a page's tables."""
    rows = re.findall(r"^\| (.*?) \|", text, re.M)
    return {k for row in rows for k in re.findall(r"`([^`]+)`", row)}


def test_every_job_lists_the_metrics_docs_describe():
    doc = (REPO / "docs" / "METRICS.md").read_text()
    ppo, supervised = doc.split("## Supervised jobs", 1)
    assert _table_keys(ppo) == PPO_METRICS | {f"{ENV_PREFIX}<key>"}
    table = _table_keys(supervised)
    sft_eval, rest = supervised.split("for `ds-ppo rm`", 1)
    rm_eval, dpo_eval = rest.split("for `ds-ppo dpo`", 1)
    evals = {"sft": set(re.findall(r"`(eval/[a-z_]+)`", sft_eval)),
             "rm": {"eval/loss", *re.findall(r"`(eval/[a-z_]+)`", rm_eval)},
             "dpo": {"eval/loss", *re.findall(r"`(eval/[a-z_]+)`", dpo_eval)}}
    assert set(SUPERVISED_METRICS) == set(evals)
    for job in evals:
        others = set(evals) - {job}
        own = {k for k in table if not others & set(re.split(r"[/_]", k))}
        assert SUPERVISED_METRICS[job] == own | evals[job], job


def test_an_environment_names_its_own_metrics():
    assert is_logged("env/correct_3", "ppo") and is_logged("score/mean", "ppo")
    assert not is_logged("env/", "ppo") and not is_logged("env/correct", "sft")
    assert not is_logged("score/mean", "rm") and is_logged("rm/accuracy", "rm")
