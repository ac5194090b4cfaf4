"""`deepspeed.<role>.zero_stage: auto` chosen by fit (ds_ppo/plan/stages.py), checked against the
planner's own numbers for the presets at several world sizes and GPU memories, and the engine's
start-up path calling the same function as `ds-ppo plan`."""
from __future__ import annotations

import types

import pytest
import torch

from ds_ppo import plan as P
from ds_ppo.config import load_config
from ds_ppo.engine.ds_config import build_ds_config, describe_stages
from ds_ppo.plan.fit import zero_stages
from ds_ppo.plan.phases import choose_zero_stages
from ds_ppo.plan.stages import AUTO_HEADROOM, rungs

GiB = 2**30
ROLES = ("policy", "value", "reference", "reward")
CLUSTERS = [(1, 1), (1, 8), (8, 8)]  # (nodes, GPUs per node)
MEMORIES = [24, 40, 80, 141]  # GiB per GPU


def _peak(cfg, cluster, shapes, stages) -> int:
    return P.compute_plan(cfg, shapes, cluster, stages=stages, notes=False).peak_gpu_bytes


@pytest.mark.parametrize("name", ["tiny", "1b", "8b", "70b"])
def test_auto_is_the_least_sharded_choice_that_fits_by_the_plan(name):
    """For every cluster and GPU memory: each auto role's stage is on its ladder, the chosen
    stages fit the budget unless no further sharding lowers the peak, and no auto role could be
    one rung less sharded and still fit (the planner's peaks decide, not a second estimate)."""
    cfg = load_config(name)
    shapes = P.resolve_shapes(cfg)
    for (nodes, gpus), mem in ((c, m) for c in CLUSTERS for m in MEMORIES):
        cluster = P.Cluster(nodes, gpus, mem * GiB)
        choice = choose_zero_stages(cfg, cluster, shapes)
        assert choice.auto == {r for r in choice.stages}, "presets leave every stage to auto"
        budget = int(mem * GiB * (1 - AUTO_HEADROOM))
        peak = _peak(cfg, cluster, shapes, choice.stages)
        ladders = {r: rungs(r, getattr(cfg.deepspeed, r)) for r in choice.auto}
        for role, stage in choice.stages.items():
            assert stage in ladders[role], (name, nodes, gpus, mem, role)
            i = ladders[role].index(stage)
            if i > 0:  # one rung less sharded would not fit
                lower = {**choice.stages, role: ladders[role][i - 1]}
                assert _peak(cfg, cluster, shapes, lower) > budget, (name, nodes, gpus, mem, role)
            if peak > budget and i + 1 < len(ladders[role]):  # over: more sharding cannot help
                higher = {**choice.stages, role: ladders[role][i + 1]}
                assert _peak(cfg, cluster, shapes, higher) >= peak, (name, nodes, gpus, mem, role)
        # the plan `ds-ppo plan` prints uses the same stages
        assert P.plan(cfg, cluster, shapes).stage_choice.stages == choice.stages


@pytest.mark.parametrize("name", ["1b", "8b", "70b"])
def test_more_gpu_memory_never_shards_more(name):
    cfg = load_config(name)
    shapes = P.resolve_shapes(cfg)
    for nodes, gpus in CLUSTERS:
        chosen = [choose_zero_stages(cfg, P.Cluster(nodes, gpus, m * GiB), shapes).stages
                  for m in MEMORIES]
        for smaller, larger in zip(chosen, chosen[1:]):
            assert all(larger[r] <= smaller[r] for r in smaller), (name, nodes, gpus, chosen)


def test_preset_choices_on_their_clusters():
    """The layouts the presets' comments describe. 1b on one 80 GB GPU: every role fits
    unsharded (2 x 20 bytes/param of the trained roles + 2 x 2 of the frozen ones, ~58 GiB);
    8b on 8 x 80 GB: 2 x 34 GB of ZeRO-2 trained states alone are over 72 GiB, so the policy,
    value and reference go to ZeRO-3, the 16 GB reward replica stays; on 141 GB GPUs ZeRO-2 and
    replicas fit; 70b: no 16-bit copy (141 GB) fits any GPU, ZeRO-3 for every role."""
    def stages(name, nodes, gpus, mem):
        return choose_zero_stages(load_config(name), P.Cluster(nodes, gpus, mem * GiB)).stages

    assert stages("1b", 1, 1, 80) == {"policy": 2, "value": 2, "reference": 0, "reward": 0}
    assert stages("8b", 1, 8, 80) == {"policy": 3, "value": 3, "reference": 3, "reward": 0}
    assert stages("8b", 1, 8, 141) == {"policy": 2, "value": 2, "reference": 0, "reward": 0}
    assert set(stages("70b", 8, 8, 80).values()) == {3}
    assert set(stages("70b", 8, 8, 141).values()) == {3}
    # the 70b preset's plan is the one it was laid out with explicit ZeRO-3 stages
    explicit = load_config("70b", [f"deepspeed.{r}.zero_stage=3" for r in ROLES])
    cluster = P.Cluster(8, 8, 80 * GiB)
    assert P.plan(load_config("70b"), cluster).peak_gpu_bytes == \
        P.plan(explicit, cluster).peak_gpu_bytes


def test_offloads_and_universal_checkpoints_limit_the_ladder():
    cfg = load_config("1b", ["deepspeed.reference.offload_param=true",
                             "deepspeed.value.offload_optimizer=true"])
    one = choose_zero_stages(cfg, P.Cluster(1, 1, 80 * GiB))
    assert one.stages["reference"] == 3 and one.stages["value"] == 2  # ZeRO-Offload first
    uni = choose_zero_stages(cfg, P.Cluster(1, 1, 80 * GiB), load_universal=True)
    assert uni.stages["policy"] == 3 and uni.stages["value"] == 3 and uni.stages["reward"] == 0
    fixed = load_config("1b", ["deepspeed.policy.zero_stage=1"])
    assert choose_zero_stages(fixed, P.Cluster(1, 1, 80 * GiB)).stages["policy"] == 1
    assert "policy" not in choose_zero_stages(fixed, P.Cluster(1, 1, 80 * GiB)).auto


def test_without_an_accelerator_auto_keeps_the_world_size_rule():
    """CPU runs (the tiny default, the gloo tests): 0 on one rank, 3 on several."""
    cfg = load_config(None)
    for ws, stage in ((1, 0), (2, 3)):
        choice = choose_zero_stages(cfg, P.Cluster(1, ws, None))
        assert choice.stages == {"policy": stage, "value": stage, "reference": stage}
        assert choice.stages == {r: getattr(cfg.deepspeed, r).stage(ws) for r in choice.stages}
        assert choice.reason.startswith("no GPU, no memory to fit")


def test_the_run_calls_the_plans_function_on_its_gpus_memory(monkeypatch):
    """The run's zero_stages (plan/fit.py) on a (pretended) 80 GB GPU gives the plan's choice,
    and the DeepSpeed configs it builds run those stages; on CPU, the world-size rule."""
    cfg = load_config("1b")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * GiB))
    choice = zero_stages(cfg, torch.device("cuda", 0))
    planned = P.plan(cfg, P.Cluster(1, 1, 80 * GiB)).stage_choice
    assert choice == planned and choice.stages["policy"] == 2
    run_cfg = choice.apply(cfg)
    assert cfg.deepspeed.policy.zero_stage == "auto"  # the run's own config is unchanged
    ds = {r: build_ds_config(run_cfg, r, 1, torch.bfloat16, 2048) for r in ROLES}
    assert {r: d["zero_optimization"]["stage"] for r, d in ds.items()} == choice.stages
    line = describe_stages(ds, 1, choice)
    assert line.startswith("ZeRO stage per role (world size 1): policy 2 (auto), value 2 (auto), "
                           "reference 0 (auto), reward 0 (auto); auto: the least-sharded")
    cpu = zero_stages(load_config(None), torch.device("cpu"))
    assert cpu.stages == {"policy": 0, "value": 0, "reference": 0}


def test_plan_says_which_stage_and_why(capsys):
    args = types.SimpleNamespace(config="8b", nodes=1, gpus_per_node=8, gpu_mem_gib=80.0,
                                 cpu_mem_gib=None, json=False, overrides=[], job="train")
    P.main(args)
    out = capsys.readouterr().out
    assert ("ZeRO stages: policy 3 (auto), value 3 (auto), reference 3 (auto), reward 0 (auto) "
            "(the least-sharded stages (policy 2, value 2, reference 0, reward 0) peak at") in out
    P.main(types.SimpleNamespace(**{**vars(args), "json": True}))
    import json

    z = json.loads(capsys.readouterr().out)["zero_stages"]
    assert z["stages"] == {"policy": 3, "value": 3, "reference": 3, "reward": 0}
    assert z["auto"] == ["policy", "reference", "reward", "value"] and "over" in z["reason"]


def test_plan_names_the_zero3_knobs_for_zero3_roles_only():
    knobs = lambda p: [n for n in p.notes if n.startswith("ZeRO-3 speed knobs")]  # noqa: E731
    on_80 = P.plan(load_config("8b"), P.Cluster(1, 8, 80 * GiB))  # policy, value, reference: 3
    assert knobs(on_80) == [knobs(on_80)[0]]
    assert knobs(on_80)[0].startswith("ZeRO-3 speed knobs (policy, value, reference): "
                                      "deepspeed.<role>.zero3.persistence_threshold")
    assert knobs(P.plan(load_config("1b"), P.Cluster(1, 1, 80 * GiB))) == []  # none at ZeRO-3


def test_supervised_jobs_choose_their_stage_by_the_job_plan(monkeypatch):
    """`ds-ppo sft` / `ds-ppo rm`: ZeRO-2 where its job plan fits the budget, else ZeRO-3; the
    run (plan/fit.py's zero_stages) and `ds-ppo plan --job` give the same."""
    from ds_ppo.plan.job import choose_job_stage, job_plan

    cfg = load_config("1b")
    budget = lambda mem: mem * GiB * (1 - AUTO_HEADROOM)  # noqa: E731
    for mem in (12, 24, 40, 80):
        cluster = P.Cluster(1, 1, mem * GiB)
        choice = choose_job_stage(cfg, "sft", cluster)
        z2 = job_plan(cfg, "sft", cluster, stage=2)["peak_gpu_bytes"]
        assert choice.stages == {"policy": 2 if z2 <= budget(mem) else 3}, mem
        assert job_plan(cfg, "sft", cluster)["zero_stage"] == choice.stages["policy"]
    assert choose_job_stage(cfg, "sft", P.Cluster(1, 1, 80 * GiB)).stages == {"policy": 2}
    assert choose_job_stage(cfg, "sft", P.Cluster(1, 1, 12 * GiB)).stages == {"policy": 3}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=12 * GiB))
    assert zero_stages(cfg, torch.device("cuda", 0), job="sft").stages == {"policy": 3}
    assert zero_stages(load_config(None), torch.device("cpu"), job="rm").stages == {"policy": 0}
    fixed = load_config("1b", ["deepspeed.policy.zero_stage=1"])
    assert choose_job_stage(fixed, "rm", P.Cluster(1, 1, 12 * GiB)).stages == {"policy": 1}
