"""What a rank pays at start-up before it trains: DeepSpeed's import."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


def test_deepspeed_is_imported_without_its_autotuners_mlflow():
    """DeepSpeed's autotuner imports mlflow if it can (seconds per rank, for a feature ds_ppo
    never runs): `dist.import_deepspeed` keeps it out, and mlflow still imports afterwards."""
    pytest.importorskip("mlflow")
    code = ("import sys\n"
            "from ds_ppo.engine.dist import import_deepspeed\n"
            "import_deepspeed()\n"
            "from deepspeed.autotuning import autotuner\n"
            "assert 'mlflow' not in sys.modules and not autotuner.has_mlflow\n"
            "import mlflow\n"
            "assert mlflow.log_metric\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
