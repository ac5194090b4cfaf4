"""Sequence parallelism on 2 CPU ranks (gloo): one row's log-probs, entropies, PPO loss and
gradients with SP = 2 (DeepSpeed Ulysses through engine/sequence_parallel.py) equal SP = 1's
(fp32); the registration leaves plain forwards alone; without the exchange they would not."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, clean_env, free_port


def test_sp2_equals_sp1_logprobs_loss_and_gradients():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(REPO / "tests" / "support" / "sp_checks.py")],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 and r["loss"] < 1e-6, r
        assert r["grads"] < 1e-5 * max(1.0, r["grad_scale"]), r
        assert r["unsharded_after"] == 0.0 and r["masked_zero"], r
        assert r["ulysses_shapes"] == 1, r  # the sharded forward went through Ulysses
        assert r["without_exchange"] > 1e-3, r  # and the test can fail
