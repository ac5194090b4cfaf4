"""What a rank pays at start-up before it trains: DeepSpeed's import, its op probes, the
collections while loading."""
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


def test_cpu_start_probes_no_deepspeed_op_until_one_is_read(monkeypatch):
    """DeepSpeed probes every op (compiling test programs, ~1 s) the first time its table of
    compatible ops is read. Marking the CPU shared-memory comm op off must not read it: the
    table then probes an op when that op is read, and only then."""
    import deepspeed.ops
    from deepspeed.ops.op_builder import builder

    from ds_ppo.engine.extensions import SHM_COMM, skip_cpu_shm_comm

    probed = []
    monkeypatch.setattr(builder, "probe_is_compatible", lambda b: probed.append(b.NAME) or True)
    monkeypatch.delitem(vars(deepspeed.ops), "__compatible_ops__", raising=False)
    assert skip_cpu_shm_comm("cpu")
    table = deepspeed.ops.__compatible_ops__
    assert probed == [] and table.get(SHM_COMM, True) is False
    assert table.get("no_such_op", "absent") == "absent" and probed == []
    assert table.get("cpu_adam", False) is True and table["cpu_adam"] is True
    assert probed == ["cpu_adam"]


def test_loading_collects_without_rescanning_the_imported_libraries(monkeypatch):
    """The collection after each ZeRO load (`_zero_init_for`) scans only what the run made: the
    objects that exist before the first load (the imported libraries) are frozen once."""
    import gc

    from ds_ppo.engine import roles

    collects = []
    monkeypatch.setattr(roles.gc, "get_freeze_count", lambda: len(collects) and 1)
    monkeypatch.setattr(roles.gc, "collect", lambda: collects.append("collect"))
    monkeypatch.setattr(roles.gc, "freeze", lambda: collects.append("freeze"))
    for _ in range(3):
        with roles._zero_init_for({"zero_optimization": {"stage": 0}, "train_batch_size": 1}):
            pass
    assert collects == ["collect", "freeze", "collect", "collect", "collect"]
    assert gc.isenabled()
