"""Mixture-of-experts policies through every job with real DeepSpeed processes, run once per
world size and shared by the cases of tests/dist/test_moe_dist.py (as dist_checks.py is by
test_engine.py):
    python tests/support/moe_checks.py --out R.json --work DIR                   (one rank)
    deepspeed --num_gpus 2 tests/support/moe_checks.py --out R.json --work DIR   (two CPU ranks)
Tiny random-init Qwen3-MoE and Mixtral policies (2 layers, 4 experts, top-2), ZeRO-3 on two
ranks (each MoE block one ZeRO-3 leaf; the `ep` scenarios: expert parallelism, 2 experts per
rank; `qwen_ep_tp_replay`: its generation replica split over the two ranks). Rank 0 writes one
JSON object of results.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_checks import (GROUP_BASE, GROUP_KEYS, LOSS_KEYS, cfg_for, first_update,  # noqa: E402
                         group_update, run_scenarios, scenario_args, supervised_steps)

from ds_ppo.engine import dist  # noqa: E402
from ds_ppo.trainer import train  # noqa: E402

sys.modules.setdefault("moe_checks", sys.modules[__name__])

_SIZES = ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=4",
          "num_key_value_heads=2", "head_dim=8", "num_experts_per_tok=2",
          "max_position_embeddings=128", "tie_word_embeddings=false", "intermediate_size=64"]
QWEN = ["policy.arch.model_type=qwen3_moe", "policy.arch.num_experts=4",
        "policy.arch.moe_intermediate_size=32"] + [f"policy.arch.{s}" for s in _SIZES]
MIXTRAL = ["policy.arch.model_type=mixtral", "policy.arch.num_local_experts=4"] + [
    f"policy.arch.{s}" for s in _SIZES if not s.startswith("head_dim")]
DENSE_VALUE = ["value.arch.model_type=llama", "value.arch.hidden_size=32",
               "value.arch.intermediate_size=64", "value.arch.num_hidden_layers=2",
               "value.arch.num_attention_heads=4", "value.arch.num_key_value_heads=2",
               "value.arch.max_position_embeddings=128"]
# the load-balancing loss of a micro-batch depends on which rows share it (as transformers
# computes it), so the world-size comparisons leave it out; the `_aux` scenarios have it
NO_AUX = ["policy.moe_aux_loss_coef=0", "value.moe_aux_loss_coef=0"]
MOE_KEYS = LOSS_KEYS + ("policy/moe_aux_loss", "value/moe_aux_loss")
REPLAY_KEYS = LOSS_KEYS + ("rollout/route_flip_frac", "rollout/logprob_abs_diff_max")
SUPERVISED = {"sft": ("loss/sft", "sft/grad_norm", "eval/loss", "sft/moe_aux_loss"),
              "rm": ("loss/rm", "rm/accuracy", "rm/grad_norm", "eval/loss", "rm/moe_aux_loss")}
EP = ["deepspeed.policy.expert_parallel_size=2", "deepspeed.value.expert_parallel_size=2"]
RESUME_KEYS = LOSS_KEYS + ("policy/moe_aux_loss", "value/moe_aux_loss")
RESUME_BASE = QWEN + ["generation.temperature=0", "ppo.micro_batch_size=4", "checkpoint.every=1",
                      "checkpoint.keep_last=3"]


def skipped_experts(work: Path) -> dict:
    """Rank 1's routers send every token to experts 0 and 1 (their top-2 forced), rank 0's
    route as they do, so under ZeRO-3 rank 1 never runs experts 2 and 3 while rank 0 does: the
    iteration completes (each MoE block is one ZeRO-3 leaf, its experts gathered together).
    Returns the leaf classes the engine set and the first update's losses."""
    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q

    leaves: list[str] = []
    set_leaves, forward = dist.set_zero3_leaf_modules, q.Qwen3MoeTopKRouter.forward

    def record(model, classes):
        leaves.extend(c.__name__ for c in classes)
        set_leaves(model, classes)

    def forced(self, hidden_states):
        logits, _, _ = forward(self, hidden_states)
        chosen = torch.tensor([0, 1], device=logits.device).expand(logits.shape[0], 2)
        weights = torch.softmax(logits.float(), -1).gather(1, chosen).to(logits.dtype)
        return logits, weights, chosen

    dist.set_zero3_leaf_modules = record
    if dist.rank() == 1:
        q.Qwen3MoeTopKRouter.forward = forced
    try:
        out = first_update(work, "skip", QWEN + NO_AUX + ["ppo.micro_batch_size=4"])
    finally:
        dist.set_zero3_leaf_modules, q.Qwen3MoeTopKRouter.forward = set_leaves, forward
    return {"leaf_classes": sorted(set(leaves)), **out}


def supervised(work: Path, job: str, name: str, extra: list[str]) -> dict:
    from dist_checks import SUPERVISED_KEYS

    SUPERVISED_KEYS[job] = SUPERVISED[job]
    return supervised_steps(work, job, name, ["deepspeed.policy.zero_stage=3",
                                              f"{job}.micro_batch_size=4"] + extra)


def resume_and_export(work: Path) -> dict:
    """Two iterations in one go, and one then a resume to two (checkpoints every iteration,
    aux loss on): the resumed iteration's metrics; rank 0 then loads the uninterrupted run's
    export with plain transformers and compares its logits with the policy's weights read
    from the DeepSpeed checkpoint by DeepSpeed's own tools (zero_to_fp32)."""
    whole = train(cfg_for(work, "whole", RESUME_BASE + [
        "iterations=2", "checkpoint.export_at_end=true"])).history
    train(cfg_for(work, "split", RESUME_BASE + ["iterations=1"]))
    resumed = train(cfg_for(work, "split", RESUME_BASE + ["iterations=2", "resume=auto"])
                    ).history
    out = {"whole": {k: whole[1][k] for k in RESUME_KEYS},
           "resumed": {k: resumed[0][k] for k in RESUME_KEYS},
           "resumed_iterations": len(resumed)}
    if dist.is_main():
        out["export"] = _export_vs_checkpoint(work / "whole")
    dist.barrier()
    return out


def ep_resume_and_export(work: Path) -> dict:
    """`resume_and_export`'s split run with expert parallelism for both roles, the policy's
    optimizer offloaded to CPU (after `resume_and_export`: its `whole` run is the reference):
    iteration 1, then a resume to 2 that exports at the end. The resumed iteration's metrics,
    the EP sizes its checkpoint recorded, and (rank 0) the export's logits against those of
    the `whole` run's export."""
    ep = RESUME_BASE + EP + ["deepspeed.policy.offload_optimizer=true"]  # as the 30b-a3b preset
    train(cfg_for(work, "ep_split", ep + ["iterations=1"]))
    resumed = train(cfg_for(work, "ep_split", ep + [
        "iterations=2", "resume=auto", "checkpoint.export_at_end=true"])).history
    state = work / "ep_split" / "checkpoints" / "iter_000002" / "trainer_state.json"
    out = {"resumed": {k: resumed[0][k] for k in RESUME_KEYS},
           "resumed_iterations": len(resumed),
           "expert_parallel": json.loads(state.read_text())["expert_parallel"]}
    if dist.is_main():
        out["export"] = _export_vs_export(work / "ep_split", work / "whole")
    dist.barrier()
    return out


def ep_grow_resume(work: Path) -> dict:
    """A checkpoint saved with AutoEP's layers at EP 1 resumed at EP 2 (after
    `ep_resume_and_export`): a copy of its EP 2 run goes on to iteration 3 at EP 1 (its
    checkpoint records EP 1); that checkpoint is then resumed to iteration 4 at EP 2 (the
    universal checkpoint hands each rank its experts again) and, in a copy, at EP 1 (a
    same-size resume, exact: the reference). Both iterations 4 and the EP sizes the grown
    run's checkpoints recorded. (The reference runs at EP 1 because EP 1 and EP 2 differ in
    float noise, which Adam turns into updates of its full step size where a gradient is near
    0: after iterations at different sizes the losses differ by percents.)"""
    import shutil

    ep = RESUME_BASE + EP + ["deepspeed.policy.offload_optimizer=true"]
    one = RESUME_BASE + ["deepspeed.policy.offload_optimizer=true"]  # expert_parallel_size 1

    def copy(src: str, dst: str) -> None:
        if dist.is_main():
            shutil.copytree(work / src, work / dst)
        dist.barrier()
    copy("ep_split", "ep_grow")
    train(cfg_for(work, "ep_grow", one + ["iterations=3", "resume=auto"]))
    copy("ep_grow", "ep_stay")
    grown = train(cfg_for(work, "ep_grow", ep + ["iterations=4", "resume=auto"])).history
    stay = train(cfg_for(work, "ep_stay", one + ["iterations=4", "resume=auto"])).history
    states = [json.loads((work / "ep_grow" / "checkpoints" / f"iter_00000{i}" /
                          "trainer_state.json").read_text())["expert_parallel"] for i in (3, 4)]
    return {"grown": [{k: h[k] for k in RESUME_KEYS} for h in grown],
            "stay": [{k: h[k] for k in RESUME_KEYS} for h in stay], "expert_parallel": states}


def plain_to_ep_resume(work: Path) -> dict:
    """`resume_and_export`'s iteration-1 checkpoint (saved without expert parallelism, ZeRO-3)
    resumed to iteration 2 with expert parallelism for both roles (after `resume_and_export`:
    its resumed run, from the same checkpoint without expert parallelism, is the reference):
    the resumed iteration's metrics, the EP sizes its checkpoint records, the universal copy
    under AutoEP's names it went through, and (rank 0) its export's logits against those of
    the `whole` run's export (iteration 2 of the run without expert parallelism)."""
    import shutil

    if dist.is_main():
        shutil.copytree(work / "split", work / "plain_ep")
        ckpts = work / "plain_ep" / "checkpoints"
        shutil.rmtree(ckpts / "iter_000002")
        (ckpts / "latest").write_text("iter_000001\n")
    dist.barrier()
    resumed = train(cfg_for(work, "plain_ep", RESUME_BASE + EP + [
        "iterations=2", "resume=auto", "checkpoint.export_at_end=true"])).history
    ckpts = work / "plain_ep" / "checkpoints"
    out = {"resumed": {k: resumed[0][k] for k in RESUME_KEYS},
           "resumed_iterations": len(resumed),
           "expert_parallel": json.loads((ckpts / "iter_000002" / "trainer_state.json"
                                          ).read_text())["expert_parallel"],
           "autoep_copy": sorted(p.name for p in (ckpts / "iter_000001" / "policy" /
                                                  "ds_universal_autoep" / "zero").iterdir()
                                 if ".layers.0.mlp." in p.name)}
    if dist.is_main():
        out["export"] = _export_vs_export(work / "plain_ep", work / "whole")
        out["copy_vs_universal"] = _autoep_copy_vs_universal(ckpts / "iter_000001")
    dist.barrier()
    return out


def _autoep_copy_vs_universal(ckpt: Path) -> dict:
    """Every tensor (weights and Adam's moments) of the universal copy under AutoEP's names
    against the universal checkpoint it came from, mapped back: the largest difference and the
    tensors compared, per role."""
    import torch

    from ds_ppo.engine.moe import autoep_tensors

    def read(path: Path):
        t = torch.load(path, weights_only=False)
        return t["param"] if isinstance(t, dict) else t
    out = {}
    for role in ("policy", "value"):
        src = ckpt / role / "ds_universal" / "zero"
        dst = ckpt / role / "ds_universal_autoep" / "zero"
        shapes = {n: tuple(s) for group in torch.load(
            next((ckpt / role / "ds_universal").glob("*model_states.pt")),
            weights_only=False)["param_shapes"] for n, s in group.items()}
        diff, count = 0.0, 0
        for name in shapes:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                full = read(src / name / f"{key}.pt")
                for new, t in autoep_tensors(name, full, shapes) or [(name, full)]:
                    copy = read(dst / new / f"{key}.pt")
                    diff = max(diff, float((copy.reshape(t.shape) - t).abs().max()))
                    count += 1
        out[role] = {"max_abs_diff": diff, "tensors": count}
    return out


def _export_vs_export(run: Path, other: Path) -> dict:
    """Loads `run`'s export with plain transformers: its logits against `other`'s export's."""
    import torch
    from transformers import AutoModelForCausalLM

    a, b = (AutoModelForCausalLM.from_pretrained(r / "final", dtype=torch.float32).eval()
            for r in (run, other))
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max()
    names = json.loads((run / "final" / "config.json").read_text())
    return {"max_abs_diff": float(diff), "architectures": names["architectures"],
            "per_expert_keys": _per_expert_keys(run / "final"),
            "keys_equal": _keys(run / "final") == _keys(other / "final")}


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        return sorted(f.keys())


def _export_vs_checkpoint(run: Path) -> dict:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    export = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()
    ckpt = run / "checkpoints" / "iter_000002" / "policy"
    if list((ckpt / "ds").glob("zero_pp_rank_*")):  # ZeRO-3 partitions (several ranks)
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="ds")
    else:  # one rank: ZeRO-0, the whole module
        state = torch.load(ckpt / "ds" / "mp_rank_00_model_states.pt",
                           weights_only=False)["module"]
    # the checkpoint's weights in the dtype the export wrote (checkpoint.export_dtype: the
    # training dtype by default), computed in float32 on both sides
    names = json.loads((run / "final" / "config.json").read_text())
    written = getattr(torch, names.get("dtype") or names.get("torch_dtype") or "float32")
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run / "final"),
                                                 dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(
        {k: v.to(written).float() for k, v in state.items()}, strict=False)
    reference.eval()
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = export(input_ids=ids).logits, reference(input_ids=ids).logits
    return {"max_abs_diff": float((a - b).abs().max()), "missing": sorted(missing),
            "unexpected": sorted(unexpected), "architectures": names["architectures"],
            "per_expert_keys": _per_expert_keys(run / "final")}


def _per_expert_keys(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        return sum(".experts.0." in k for k in f.keys())


def main() -> None:
    args, work = scenario_args()
    z3 = ["ppo.micro_batch_size=4"]
    grpo = GROUP_BASE + ["ppo.advantage_estimator=grpo", "ppo.kl_loss_coef=0.1",
                         "ppo.kl_estimator=k3", "ppo.loss_aggregation=seq_mean_token_mean",
                         "policy.moe_aux_loss_coef=0"]
    scenarios = {
        # PPO with an MoE critic (the value model starts from the MoE policy)
        "qwen_gae": lambda: first_update(work, "qgae", QWEN + NO_AUX + z3, MOE_KEYS),
        "qwen_gae_aux": lambda: first_update(work, "qgaeaux", QWEN + z3 + [
            "policy.moe_aux_loss_coef=0.5", "value.moe_aux_loss_coef=0.5"], MOE_KEYS),
        "qwen_replay": lambda: first_update(work, "qrep", QWEN + NO_AUX + z3 + [
            "ppo.router_replay=true"], REPLAY_KEYS),
        # a dense critic next to a Mixtral policy
        "mixtral_dense_value": lambda: first_update(work, "mixd", MIXTRAL + DENSE_VALUE +
                                                    NO_AUX + z3),
        "qwen_grpo": lambda: group_update(work, "qgrpo", QWEN + grpo + z3, GROUP_KEYS),
        "mixtral_lora": lambda: first_update(work, "mixlora", MIXTRAL + NO_AUX + z3 + [
            "policy.lora.r=8", "value.lora.r=8"]),
        "qwen_sft": lambda: supervised(work, "sft", "qsft", QWEN + ["policy.moe_aux_loss_coef=0"]),
        "qwen_rm": lambda: supervised(work, "rm", "qrm", QWEN + ["policy.moe_aux_loss_coef=0"]),
        "resume_export": lambda: resume_and_export(work),
        "skipped_experts": lambda: skipped_experts(work),
    }
    if dist.world_size() == 2:  # expert parallelism (DeepSpeed AutoEP): 2 experts per rank
        scenarios.update({
            "qwen_ep_replay": lambda: first_update(work, "qeprep", QWEN + NO_AUX + z3 + EP + [
                "ppo.router_replay=true"], REPLAY_KEYS),
            "qwen_sft_ep": lambda: supervised(work, "sft", "qsftep", QWEN + EP[:1] + [
                "policy.moe_aux_loss_coef=0"]),
            "qwen_rm_ep": lambda: supervised(work, "rm", "qrmep", QWEN + EP[:1] + [
                "policy.moe_aux_loss_coef=0"]),
            "mixtral_dense_value_ep": lambda: first_update(work, "mixdep", MIXTRAL + DENSE_VALUE
                                                           + NO_AUX + z3 + EP[:1]),
            # after resume_export (its `whole` run is the reference); aux loss on
            "ep_resume_export": lambda: ep_resume_and_export(work),
            "ep_grow_resume": lambda: ep_grow_resume(work),  # after ep_resume_export
            "plain_to_ep_resume": lambda: plain_to_ep_resume(work),  # after resume_export
            # the generation replica split over the two ranks (tensor_parallel), each holding
            # the experts AutoEP gave it, recording the expert choices router replay replays
            "qwen_ep_tp_replay": lambda: first_update(work, "qeptp", QWEN + NO_AUX + z3 + EP + [
                "ppo.router_replay=true", "generation.mode=tensor_parallel",
                "generation.tp_size=2"], REPLAY_KEYS),
        })
    run_scenarios(scenarios, args, "moe_checks")


if __name__ == "__main__":
    main()
