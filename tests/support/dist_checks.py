"""Engine checks that need real DeepSpeed processes, run once per world size and shared by many
test cases (DeepSpeed start-up costs tens of seconds per process).

Run by tests/dist/test_engine.py as
    python tests/support/dist_checks.py --out R.json                       (one rank)
    deepspeed --num_gpus 2 tests/support/dist_checks.py --out R.json       (two CPU ranks, gloo)
Each scenario builds the engines of a small config, runs what it checks, and rank 0 writes one
JSON object of results that the pytest cases compare.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_ppo.algo.choices import POLICY_LOSSES  # noqa: E402
from ds_ppo.config import load_config, validate  # noqa: E402
from ds_ppo.engine import dist  # noqa: E402
from ds_ppo.engine.dist import init_distributed  # noqa: E402
from ds_ppo.trainer import train  # noqa: E402

# reward.function=dist_checks:group_reward must find this module when it runs as a script
sys.modules.setdefault("dist_checks", sys.modules[__name__])

BASE = [
    "tracking.enabled=false", "checkpoint.every=0", "checkpoint.save_at_end=false",
    "checkpoint.export_at_end=false", "generation.max_new_tokens=8", "ppo.rollout_batch_size=16",
    "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "ppo.ppo_epochs=1", "resume=never", "log_every=1",
]


# two optimizer steps per iteration: the second step's losses depend on the first update
LOSS_KEYS = ("loss/policy", "loss/value", "policy/approx_kl", "policy/clip_frac",
             "score/mean", "kl/sequence_mean", "policy/entropy", "response/length_mean")

PADDING_KEYS = ("padding/scoring_positions_per_token", "padding/update_positions_per_token")


def cfg_for(work: Path, name: str, extra: list[str]):
    cfg = load_config(None, BASE + [f"output_dir={work / name}"] + extra)
    validate(cfg, dist.world_size())
    return cfg


def gathered(module) -> dict[str, torch.Tensor]:
    """Full copy of a (ZeRO-3) module's parameters (collective)."""
    import deepspeed

    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone().float().cpu()
    return out


def first_update(work: Path, name: str, extra: list[str], keys=LOSS_KEYS) -> dict:
    """Losses of the first PPO update on greedy rollouts (identical inputs in every variant);
    keys=None: all its metrics."""
    cfg = cfg_for(work, name, ["iterations=1", "generation.temperature=0"] + extra)
    h = train(cfg).history[0]
    return dict(h) if keys is None else {k: h[k] for k in keys}


GROUP = 4
# critic-free: 4 prompts x 4 responses, two optimizer steps of 2 prompts (1 per rank on two)
GROUP_BASE = ["ppo.rollout_batch_size=4", f"ppo.samples_per_prompt={GROUP}",
              "reward.function=dist_checks:group_reward"]
GROUP_KEYS = tuple(k for k in LOSS_KEYS if k != "loss/value") + (
    "loss/kl", "score/group_std_mean", "group/zero_std_frac")
DISTILL = GROUP_BASE + [
    "ppo.advantage_estimator=distill", "ppo.kl_loss_coef=0.1", "distill.reward_coef=0.5",
    "deepspeed.teacher.offload_param=false", "teacher.arch.model_type=llama",
    "teacher.arch.hidden_size=64", "teacher.arch.intermediate_size=128",
    "teacher.arch.num_hidden_layers=2", "teacher.arch.num_attention_heads=4",
    "teacher.arch.num_key_value_heads=2", "teacher.arch.initializer_range=0.3"]
DISTILL_KEYS = GROUP_KEYS + ("distill/reverse_kl", "distill/teacher_logprob",
                             "distill/top1_match")


def group_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """positive_words plus 0.1 x the response's place in its group (a rank's rows are whole
    groups, in order); 0 for prompts starting with "you" (the first of the first iteration),
    whose group is constant (ppo.filter_zero_std_groups drops it)."""
    from ds_ppo.rewards.functions import positive_words

    return [0.0 if p.strip().startswith("you") else s + 0.1 * (i % GROUP)
            for i, (p, s) in enumerate(zip(prompts, positive_words(prompts, responses)))]


def group_update(work: Path, name: str, extra: list[str], keys=GROUP_KEYS) -> dict:
    """`first_update` for a critic-free estimator. Identical greedy responses in a group would
    cancel every group-centred advantage in the gradient, and sampling depends on the world
    size; so the decoding loop picks argmax(logits + noise[k]) for the k-th response of each
    group: different responses in a group, the same ones at any world size or micro-batch
    split (generation keeps a rank's rows in group order: all prompts of a group are equal)."""
    from ds_ppo.engine.generation import loop as decode

    noise: dict[int, torch.Tensor] = {}

    from ds_ppo.algo.logits import logprobs_from_logits

    def next_tokens_with_logprobs(logits, temperature, top_k=0, top_p=1.0, generator=None):
        V = logits.shape[-1]
        if V not in noise:
            noise[V] = 4.0 * torch.randn(GROUP, V, generator=torch.Generator().manual_seed(0))
        rows = torch.arange(logits.shape[0]) % GROUP
        chosen = (logits.float() + noise[V][rows].to(logits.device)).argmax(dim=-1)
        return chosen, logprobs_from_logits(logits.float()[:, None], chosen[:, None])[:, 0]

    original = decode.next_tokens_with_logprobs
    decode.next_tokens_with_logprobs = next_tokens_with_logprobs
    try:
        return first_update(work, name, extra, keys)
    finally:
        decode.next_tokens_with_logprobs = original


PTX_KEYS = LOSS_KEYS + ("loss/ptx", "ema/distance")


def ptx_ema_update(work: Path, name: str, extra: list[str]) -> dict:
    """`first_update` with PPO-ptx (text rows) and the policy's EMA: the LM loss of each
    optimizer step and the EMA's distance from the weights after the two steps, reduced over
    the ranks (each rank wrote the same rows into a file of its own)."""
    return first_update(work, name, extra + [f"data.ptx_path={ptx_file(work)}",
                                             "ppo.ptx_coef=0.5", "policy.ema_decay=0.5"],
                        PTX_KEYS)


def ptx_file(work: Path) -> Path:
    """PPO-ptx text rows, the same in a file of each rank's own."""
    ptx = work / f"ptx_rank{dist.rank()}.jsonl"
    ptx.write_text("".join(json.dumps({"text": t}) + "\n" for t in (
        "the cat sat on the mat", "a good day for a walk", "we love the sea and the sun",
        "my aunt is happy today", "the dog runs in the park", "i like warm bread and tea",
        "you are kind", "they sing in the morning", "he reads a long book")))
    return ptx


def ema_swap(work: Path) -> dict:
    """policy.ema_decay on ZeRO-3 (forced, also on one rank): one iteration through the stages,
    then the EMA swapped in is, gathered, the EMA assembled from every rank's pieces (persistent
    small parameters, norms, included), and swapped out the weights are back bit for bit; a
    fresh EMA loaded from a save equals it."""
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.engine.ema import ParamEMA
    from ds_ppo.ppo.train_job import ppo_engines

    cfg = cfg_for(work, "ema", ["iterations=1", "policy.ema_decay=0.5",
                                "deepspeed.policy.zero_stage=3"])
    tok = load_tokenizer("builtin:tiny", work / "ema")
    engines = ppo_engines(cfg, tok, torch.device("cpu"))
    ema = engines.policy.ema
    _stages(cfg, engines, tok, 0, "gathered")
    after = gathered(engines.policy.module)
    pieces = dist.gather_objects([(n, int(st[f"at.{n}"][0]), st[f"ema.{n}"])
                                  for st in [_ema_state(ema)] for n in ema.names])
    full = {}
    for rank_pieces in pieces:
        for name, offset, t in rank_pieces:
            full.setdefault(name, []).append((offset, t.reshape(-1)))
    with ema.swapped_in():
        swapped = gathered(engines.policy.module)
    back = gathered(engines.policy.module)
    wrong = []
    for name, parts in full.items():
        flat = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])])
        want = flat[:after[name].numel()].view_as(after[name])
        if not torch.equal(swapped[name], want):
            wrong.append(name)
    (work / "ema_save").mkdir(exist_ok=True)
    ema.save(work / "ema_save")
    dist.barrier()
    other = ParamEMA(engines.policy.module, 0.5)
    other.load(work / "ema_save", same_world=True)
    persistent = [n for n, p in engines.policy.module.named_parameters()
                  if getattr(p, "ds_persist", False)]
    return {"swapped_wrong": wrong, "persistent": len(persistent),
            "restored": all(torch.equal(after[k], back[k]) for k in after),
            "ema_differs": any(not torch.equal(after[k], swapped[k]) for k in after),
            "reloaded_equal": all(torch.equal(a, b) for a, b in zip(ema.shadow, other.shadow))}


def _ema_state(ema) -> dict:
    """This rank's EMA as `save` writes it (names, offsets, pieces)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ema.save(Path(d))
        return torch.load(next(Path(d).glob("rank_*.pt")), weights_only=True)


def value_from_reward_model(work: Path) -> dict:
    """value.path = a reward model's export (LlamaForSequenceClassification, num_labels 1) with
    the same model as reward.model, on ZeRO-3: before any training, the value model's value
    before a row's last token equals the reward engine's score of the row without that token
    (the same hidden state, the same score head)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from ds_ppo.data.ptx import lm_rollout
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.ppo.train_job import ppo_engines

    tok = load_tokenizer("builtin:tiny", work / "vrm")
    rm_dir = work / "rm_export"

    def build():
        if (rm_dir / "config.json").exists():
            return
        torch.manual_seed(3)
        rm = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_labels=1,
            pad_token_id=tok.pad_token_id))
        rm.save_pretrained(work / "rm_export.tmp")
        tok.save_pretrained(work / "rm_export.tmp")
        (work / "rm_export.tmp").rename(rm_dir)
    dist.main_does(build, work, "building the reward model export")
    cfg = cfg_for(work, "vrm", ["reward.function=null", f"reward.model={rm_dir}",
                                f"value.path={rm_dir}"])
    engines = ppo_engines(cfg, tok, torch.device("cpu"))
    rows = [tok(t).input_ids for t in ("the cat sat on", "my aunt is happy", "a good day")]
    rollout = lm_rollout([r[:2] for r in rows], [r[2:] for r in rows], tok.pad_token_id,
                         torch.device("cpu"))
    with torch.no_grad():
        values = engines.value.values(rollout)
        short = rollout.slice(list(range(len(rows))))
        short.mask = rollout.mask.clone()
        last = torch.tensor(rollout.response_lens) - 1
        short.mask[torch.arange(len(rows)), last] = False
        scores = engines.reward.scores(short.input_ids, short.attention_mask)
    picked = values[torch.arange(len(rows)), last]
    return {"values": picked.tolist(), "scores": scores.tolist(),
            "max_diff": float((picked - scores).abs().max())}

# multi-turn episodes (env.function): two turns, the first answered with an observation
ENV_BASE = ["env.function=dist_checks:two_turns", "env.max_turns=2"]
ENV_KEYS = LOSS_KEYS + ("env/turns_mean", "env/observation_tokens_mean", "env/model_tokens_mean")


def two_turns(prompt: str, actions: list[str]) -> dict:
    """A deterministic environment: each turn's reward is its share of positive words; the
    first turn is answered with an observation, the second ends the episode."""
    from ds_ppo.rewards.functions import positive_words

    reward = positive_words([prompt], [actions[-1]])[0]
    if len(actions) == 1:
        return {"observation": " you are good and", "reward": reward, "done": False}
    return {"observation": None, "reward": reward, "done": True}


def critic_free_engines(work: Path) -> dict:
    """A critic-free estimator builds no value engine."""
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.ppo.train_job import ppo_engines

    cfg = cfg_for(work, "critic_free", GROUP_BASE + ["ppo.advantage_estimator=rloo"])
    engines = ppo_engines(cfg, load_tokenizer("builtin:tiny", work / "critic_free"),
                          torch.device("cpu"))
    return {"value_is_none": engines.value is None, "ds_configs": sorted(engines.ds_configs)}


def _stages(cfg, engines, tok, iteration: int, mode: str):
    """One iteration through the public stage functions, on this rank's shard."""
    from ds_ppo.data.prompts import load_prompts
    from ds_ppo.metrics import Accumulator
    from ds_ppo.ppo.rollout import make_rollout, rollout_settings, stop_token_ids
    from ds_ppo.ppo.advantages import add_advantages, advantage_settings
    from ds_ppo.ppo.scoring import (reward_settings, score, scoring_settings,
                                    timed_reward_scores)
    from ds_ppo.ppo.update import ppo_update, update_settings

    from ds_ppo.ppo.train_job import prompt_sampler as _sampler

    prompts = load_prompts(cfg.data, tok)
    rollout, _ = make_rollout(prompts, _sampler(cfg, len(prompts.input_ids)).indices(iteration),
                              engines, rollout_settings(cfg), tok, mode,
                              stop_token_ids(tok, cfg.generation.stop_tokens))
    scored = score(rollout, engines, scoring_settings(cfg),
                   lambda: timed_reward_scores(rollout, engines, reward_settings(cfg), None))
    exp = add_advantages(scored,
                         advantage_settings(cfg, cfg.ppo.kl_coef))
    ppo_update(exp, engines, update_settings(cfg), iteration, Accumulator())
    return rollout


def varied_lengths(work: Path, mode: str) -> dict:
    """Many stop tokens make response lengths differ between ranks: no rank may hang, in the
    whole loop (train) and stage by stage (each rank's own response widths recorded)."""
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.ppo.train_job import ppo_engines

    tok = load_tokenizer("builtin:tiny", work / f"varied_{mode}")
    pieces = sorted(v for v in tok.get_vocab() if v.startswith("▁"))[:150]
    stops = "[" + ",".join(json.dumps(p) for p in pieces) + "]"
    cfg = cfg_for(work, f"varied_{mode}", [f"generation.mode={mode}", "iterations=2",
                                            f"generation.stop_tokens={stops}",
                                            "generation.max_new_tokens=12"])
    t0 = time.time()
    res = train(cfg)
    engines = ppo_engines(cfg, tok, torch.device("cpu"))
    widths = [_stages(cfg, engines, tok, it, mode).response_ids.shape[1] for it in range(3)]
    return {"seconds": time.time() - t0, "iterations": len(res.history),
            "widths_per_rank": dist.gather_objects(widths)}


def replica_and_roles(work: Path) -> dict:
    """One iteration through the public stages; then: reference unchanged, policy changed, and
    the generation replica built after the update equals the trained policy."""
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.engine.generation import build_replica
    from ds_ppo.ppo.train_job import ppo_engines

    from ds_ppo.data.prompts import load_prompts
    from ds_ppo.ppo.rollout import make_rollout, rollout_settings, stop_token_ids

    cfg = cfg_for(work, "replica", ["iterations=1", "generation.keep_replica=true"])
    tok = load_tokenizer("builtin:tiny", work / "replica")
    engines = ppo_engines(cfg, tok, torch.device("cpu"))
    ref0, pol0 = gathered(engines.reference.module), gathered(engines.policy.module)
    _stages(cfg, engines, tok, 0, "gathered")
    kept = engines.replica
    ref1, pol1 = gathered(engines.reference.module), gathered(engines.policy.module)
    # the next rollout refreshes the kept replica in place with the updated weights
    prompts = load_prompts(cfg.data, tok)
    make_rollout(prompts, [0, 1], engines, rollout_settings(cfg), tok, "gathered",
                 stop_token_ids(tok, cfg.generation.stop_tokens))
    kept_ok = engines.replica is kept and all(
        torch.equal(p.detach().float(), pol1[n]) for n, p in kept.named_parameters())

    replica = build_replica(engines.policy.module, torch.float32, torch.device("cpu"))
    replica_out, zero3_out = _greedy_replica_and_zero3(tok, replica, engines)
    return {
        "reference_unchanged": all(torch.equal(ref0[k], ref1[k]) for k in ref0),
        "policy_changed": any(not torch.equal(pol0[k], pol1[k]) for k in pol0),
        "policy_max_change": max(float((pol0[k] - pol1[k]).abs().max()) for k in pol0),
        "replica_equal_params": all(torch.equal(p.detach().float(), pol1[n])
                                    for n, p in replica.named_parameters()),
        "kept_replica_refreshed": kept_ok,
        "replica_out": replica_out,
        "zero3_out": zero3_out,
    }


def lora_roles(work: Path) -> dict:
    """LoRA policy and value on ZeRO-3, one iteration through the stages. Then: only adapters and
    the value head changed; the reference (the policy engine, adapters off) still gives the
    untouched base model's log-probs; the merged replica computes what the adapted policy does
    and decodes as zero3 mode does through the adapters; a replica synced with the adapters only
    after the update (`build_replica`'s bases) equals one rebuilt whole."""
    from transformers import AutoModelForCausalLM

    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.engine.generation import build_replica
    from ds_ppo.ppo.train_job import ppo_engines
    from ds_ppo.engine.forward import response_logprobs

    cfg = cfg_for(work, "lora", ["iterations=1", "policy.lora.r=8", "value.lora.r=8"])
    tok = load_tokenizer("builtin:tiny", work / "lora")
    engines = ppo_engines(cfg, tok, torch.device("cpu"))
    roles = {"policy": engines.policy.module, "value": engines.value.module}
    trained = {r: sorted(n for n, p in m.named_parameters() if p.requires_grad)
               for r, m in roles.items()}
    before = {r: gathered(m) for r, m in roles.items()}
    # a schedule's replica: the whole model at the first sync, the adapters only after it
    bases: dict = {}
    synced = build_replica(engines.policy.module, torch.float32, torch.device("cpu"),
                           own_config=True, bases=bases)
    rollout = _stages(cfg, engines, tok, 0, "gathered")
    after = {r: gathered(m) for r, m in roles.items()}
    sums: dict = {}
    build_replica(engines.policy.module, torch.float32, torch.device("cpu"), into=synced,
                  sums=sums, bases=bases)
    changed = {r: sorted(n for n in before[r] if not torch.equal(before[r][n], after[r][n]))
               for r in roles}
    temp, mask = cfg.generation.temperature, rollout.mask
    base = AutoModelForCausalLM.from_pretrained(engines.policy_path, dtype=torch.float32)
    replica = build_replica(engines.policy.module, torch.float32, torch.device("cpu"))
    full = replica.state_dict()

    def diff(a, b) -> float:
        return float((a - b).abs().masked_fill(~mask, 0).max())

    with torch.no_grad():
        ref = engines.reference.logprobs(rollout, temp)[0]
        plain = response_logprobs(base, rollout, temp)[0]
        policy = engines.policy.logprobs(rollout, temp)[0]
        merged = response_logprobs(replica, rollout, temp)[0]
    replica_out, zero3_out = _greedy_replica_and_zero3(tok, replica, engines)
    return {
        "trained": trained, "changed": changed,
        "reference_engine_built": "reference" in engines.ds_configs,
        "reference_equal_base": bool(torch.equal(ref.masked_fill(~mask, 0),
                                                 plain.masked_fill(~mask, 0))),
        "reference_vs_base_max": diff(ref, plain),
        "policy_vs_base_max": diff(policy, plain),
        "merged_replica_vs_policy_max": diff(merged, policy),
        "adapter_sync_equals_full": all(torch.equal(w, full[n])
                                        for n, w in synced.state_dict().items()),
        "adapter_sync_weights": len(sums), "adapted_layers": len(bases),
        "replica_out": replica_out, "zero3_out": zero3_out,
    }


def tensor_parallel(work: Path) -> dict:
    """generation.mode=tensor_parallel over all ranks: training runs; greedy rows equal the
    gathered replica's for each rank's own prompts (ranks with different prompt counts and
    lengths); sampled tokens are the same on every rank of the group."""
    from ds_ppo.data.prompts import left_pad, load_prompts
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.engine import generation as gen
    from ds_ppo.ppo.train_job import ppo_engines
    from ds_ppo.ppo.rollout import stop_token_ids

    world, rank = dist.world_size(), dist.rank()
    cfg = cfg_for(work, "tp", ["iterations=2", "generation.mode=tensor_parallel",
                               f"generation.tp_size={world}", "generation.max_new_tokens=10"])
    history = train(cfg).history
    tok = load_tokenizer("builtin:tiny", work / "tp")
    engines = ppo_engines(cfg, tok, torch.device("cpu"))
    prompts = load_prompts(cfg.data, tok)
    mine = [prompts.input_ids[i][:6 + 3 * rank] for i in range(5 * rank, 5 * rank + 3 + rank)]
    ids, am = left_pad(mine, tok.pad_token_id)
    am = am.bool()
    eos, pad = stop_token_ids(tok, cfg.generation.stop_tokens), tok.pad_token_id
    greedy = cfg.generation.model_copy(update={"temperature": 0.0})
    tp_ids = gen.generate(engines.policy, ids, am, greedy, "tensor_parallel", eos, pad,
                          torch.float32).response_ids
    full_ids = gen.generate(engines.policy, ids, am, greedy, "gathered", eos, pad,
                            torch.float32).response_ids
    group_outputs = []
    stack_chunks = gen._stack_chunks

    def recording(outs, pad_id):  # the group's responses, before each rank takes its rows
        stacked = stack_chunks(outs, pad_id)
        group_outputs.append(stacked.tolist())
        return stacked

    gen._stack_chunks = recording
    try:
        sampled = gen.generate(engines.policy, ids, am, cfg.generation, "tensor_parallel", eos,
                               pad, torch.float32)
    finally:
        gen._stack_chunks = stack_chunks
    width = min(tp_ids.shape[1], full_ids.shape[1])
    return {
        "iterations": len(history),
        "losses_finite": all(h[k] == h[k] for h in history for k in LOSS_KEYS),
        "greedy_equal": dist.gather_objects(bool(
            torch.equal(tp_ids[:, :width], full_ids[:, :width])
            and (tp_ids[:, width:] == pad).all() and (full_ids[:, width:] == pad).all())),
        "rows": dist.gather_objects(int(sampled.response_ids.shape[0])),
        "group_outputs_equal": len({json.dumps(o) for o in dist.gather_objects(group_outputs)})
        == 1,
        "sampled_tokens": int(sampled.mask.sum()),
    }


def _greedy_replica_and_zero3(tok, replica, engines) -> tuple[list, list]:
    """Greedy tokens of two prompts from the replica and through the ZeRO-3 hooks (synced)."""
    from ds_ppo.data.prompts import left_pad

    ids, am = left_pad([tok("the cat").input_ids, tok("my aunt is").input_ids], tok.pad_token_id)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
              eos_token_id=tok.eos_token_id)
    replica_out = replica.generate(input_ids=ids, attention_mask=am, **kw).tolist()
    module = engines.policy.module
    module.eval()
    module.config.use_cache = True
    zero3_out = module.generate(input_ids=ids, attention_mask=am,
                                synced_gpus=dist.world_size() > 1, **kw).tolist()
    return replica_out, zero3_out


SUPERVISED_KEYS = {"sft": ("loss/sft", "sft/grad_norm", "eval/loss"),
                   "rm": ("loss/rm", "rm/accuracy", "rm/margin_mean", "rm/grad_norm", "eval/loss",
                          "eval/margin_mean"),
                   "dpo": ("loss/dpo", "dpo/reward_accuracy", "dpo/reward_margin",
                           "dpo/chosen_logp", "dpo/grad_norm", "eval/loss", "eval/reward_margin")}


def supervised_data(work: Path) -> Path:
    """Rank 0 writes (once) SFT rows of varied lengths and preference pairs with margins."""
    import json
    import random

    data = work / "supervised"
    if dist.is_main() and not data.exists():
        tmp = work / "supervised.tmp"
        tmp.mkdir()
        rng = random.Random(0)
        words = "the cat sat on a mat and my aunt is happy good love sun".split()
        sft, pairs = [], []
        for i in range(32):
            prompt = " ".join(rng.choice(words) for _ in range(1 + i % 5))
            answer = " ".join(rng.choice(words) for _ in range(1 + (i * 7) % 6))
            sft.append({"prompt": prompt, "completion": answer})
            pairs.append({"prompt": prompt, "chosen": answer, "rejected": answer[::-1],
                          "margin": (i % 3) * 0.5})
        (tmp / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
        (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
        tmp.rename(data)
    dist.barrier()
    return data


def supervised_steps(work: Path, job: str, name: str, extra: list[str]) -> dict:
    """Each step's loss statistics of two optimizer steps of `ds-ppo sft` / `rm` / `dpo` (the
    second step's depend on the first update) and the evaluation after them."""
    from ds_ppo.config import validate_job
    from ds_ppo.trainer import run_supervised

    data = supervised_data(work)
    rows = "sft.jsonl" if job == "sft" else "pairs.jsonl"
    cfg = load_config(None, [
        "tracking.enabled=false", "checkpoint.every=0", "checkpoint.save_at_end=false",
        "checkpoint.export_at_end=false", "resume=never", f"output_dir={work / name}",
        f"data.path={data / rows}", f"data.eval_split={data / rows}", "data.eval_size=8",
        f"{job}.steps=2", f"{job}.batch_size=8", "rm.margin_key=margin"] + extra)
    validate_job(cfg, job, dist.world_size())
    history = run_supervised(cfg, job).history
    return {f"{k}@{i}": h[k] for i, h in enumerate(history) for k in SUPERVISED_KEYS[job]
            if k in h}


# deepspeed.sequence_parallel_size through `ds-ppo train`: rows of at least 16 tokens (of 11-20)
# split across the SP group, the others whole; saved after each iteration; the policy's EMA (its
# distance sums ZeRO-3 partitions of all ranks) and PPO-ptx (its rows whole on every rank)
SP_BASE = ["iterations=2", "generation.temperature=0", "ppo.micro_batch_size=4",
           "deepspeed.sequence_parallel_min_tokens=16", "checkpoint.every=1",
           "checkpoint.keep_last=2", "policy.ema_decay=0.5", "ppo.ptx_coef=0.5"]
SP_KEYS = LOSS_KEYS + ("ema/distance", "loss/ptx")


def sp_train(work: Path) -> dict:
    """SP = the world size. One rank (SP = 1): two iterations, each one's SP_KEYS. Two ranks
    (SP = 2: one data-parallel rank, as one rank is): the first iteration, the two ranks
    decoding together (generation.mode=tensor_parallel), with the rows each rank brought to the
    decoding; then its checkpoint resumed with SP = 1 on the same 2 ranks (2 data-parallel
    ranks), iteration 2. The split rows counted (forwards of a split row on this rank)."""
    from ds_ppo.engine import role_objects
    from ds_ppo.ppo import rollout

    world = dist.world_size()
    original, calls = role_objects.row_logprobs, []
    generate, brought = rollout.generate, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def bringing(policy, ids, *args, **kwargs):
        brought.append(int(ids.shape[0]))
        return generate(policy, ids, *args, **kwargs)

    role_objects.row_logprobs, rollout.generate = counting, bringing
    base = SP_BASE + [f"data.ptx_path={ptx_file(work)}"]
    extra = ["iterations=1", "generation.mode=tensor_parallel", "generation.tp_size=2"]
    try:
        cfg = cfg_for(work, "sptrain", base + [f"deepspeed.sequence_parallel_size={world}"]
                      + (extra if world == 2 else []))
        history = train(cfg).history
        out = {f"{k}@{i + 1}": h[k] for i, h in enumerate(history) for k in SP_KEYS}
        out["split_forwards"] = len(calls)
        out["rows_brought"] = dist.gather_objects(brought)  # [rank][iteration]
        if world == 2:
            ckpt = Path(cfg.output_dir) / "checkpoints" / "iter_000001"
            resumed = train(cfg_for(work, "spresume", base + [
                "deepspeed.sequence_parallel_size=1", f"resume={ckpt}"])).history
            out["resumed_iterations"] = len(resumed)
            out.update({f"resumed_{k}@2": resumed[0][k] for k in SP_KEYS})
        return out
    finally:
        role_objects.row_logprobs, rollout.generate = original, generate
        dist.set_sequence_parallel(1)


def sequence_parallel() -> dict:
    """One row with SP = 2 (DeepSpeed Ulysses) against SP = 1: largest differences over both
    ranks (sp_checks.compare)."""
    import sp_checks

    return sp_checks.compare()


def policy_loss_update(work: Path, name: str, base: list[str]) -> dict:
    """`group_update` with ppo.policy_loss = `name` (its default aggregation): on one rank with
    row micro-batches and tiled logits (4 positions), on two packed (at most 30 tokens) and
    tiled (the ranks' packs differ in length, so their tile counts do), so one comparison covers
    the paths and the world size. The policy's losses and statistics."""
    tiled = ["ppo.tiled_logits=true", "ppo.logits_tile_tokens=4"]
    paths = tiled if dist.world_size() == 1 else tiled + ["ppo.micro_batch_tokens=30"]
    h = group_update(work, f"loss_{name}", base + [f"ppo.policy_loss={name}",
                                                    "ppo.micro_batch_size=4", *paths], None)
    # (policy/grad_norm: DeepSpeed reports it on some layouts only)
    return {k: v for k, v in h.items()
            if k.startswith(("loss/", "policy/")) and k != "policy/grad_norm"}


def run_scenarios(scenarios: dict, args, tag: str) -> None:
    """Each scenario of `scenarios` (name -> function returning its results) that `args.only`
    names (all without it), on every rank; rank 0 writes {name: results} (and the world size)
    to `args.out`. A scenario that raises is recorded as an error, so it hides no other."""
    results: dict = {"world_size": dist.world_size()}
    for name, fn in scenarios.items():
        if args.only and name not in args.only.split(","):
            continue
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as e:  # recorded, so one failing scenario does not hide the others
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        if dist.is_main():
            print(f"[{tag}] {name} done in {time.time() - t0:.1f}s", flush=True)
    if dist.is_main():
        Path(args.out).write_text(json.dumps(results, indent=1))


def scenario_args() -> tuple[argparse.Namespace, Path]:
    """A scenario script's arguments (--out, --work, --only; the launcher's --local_rank) and
    its work directory, with the process group started."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated scenarios (development)")
    args = parser.parse_args()
    init_distributed()
    return args, Path(args.work)


def main() -> None:
    args, work = scenario_args()
    grpo = GROUP_BASE + ["ppo.advantage_estimator=grpo", "ppo.kl_loss_coef=0.1",
                         "ppo.kl_estimator=k3", "ppo.loss_aggregation=seq_mean_token_mean"]
    # the policy losses' own default aggregation (seq_mean_token_mean but for cispo's)
    group = GROUP_BASE + ["ppo.advantage_estimator=grpo", "ppo.kl_loss_coef=0.1",
                          "ppo.kl_estimator=k3"]
    rloo = GROUP_BASE + ["ppo.advantage_estimator=rloo", "ppo.kl_loss_coef=0.1",
                         "ppo.loss_aggregation=seq_mean_token_sum_norm",
                         "ppo.filter_zero_std_groups=true", "ppo.clip_eps_high=0.28",
                         "ppo.dual_clip=3", "ppo.entropy_coef=0.01"]
    scenarios = {
        "grpo_micro4": lambda: group_update(work, "grpo4", grpo + ["ppo.micro_batch_size=4"]),
        "grpo_micro2": lambda: group_update(work, "grpo2", grpo + ["ppo.micro_batch_size=2"]),
        "rloo_micro4": lambda: group_update(work, "rloo4", rloo + ["ppo.micro_batch_size=4"],
                                            GROUP_KEYS + ("loss/entropy",)),
        "critic_free_engines": lambda: critic_free_engines(work),
        # on-policy distillation: a ZeRO-3 teacher (random-init, peaked), the reward's group
        # advantage mixed in, a KL loss toward the reference
        "distill_micro4": lambda: group_update(work, "distill4", DISTILL + [
            "ppo.micro_batch_size=4"], DISTILL_KEYS),
        # every other ppo.policy_loss: tiled on one rank, packed and tiled on two
        **{f"policy_loss_{name}": (lambda name=name: policy_loss_update(work, name, group))
           for name in POLICY_LOSSES if name != "ppo"},
        "zero3_micro4": lambda: first_update(work, "z3m4", ["ppo.micro_batch_size=4"]),
        "zero3_micro2": lambda: first_update(work, "z3m2", ["ppo.micro_batch_size=2"]),
        # packed micro-batches of at most 30 tokens (rows of 11-20): 1-2 rows each, a count
        # that differs between mini-batches and ranks
        "zero3_packed": lambda: first_update(work, "z3pk", [
            "ppo.micro_batch_size=4", "ppo.micro_batch_tokens=30"], LOSS_KEYS + PADDING_KEYS),
        "zero2_packed": lambda: first_update(work, "z2pk", [
            "ppo.micro_batch_size=4", "ppo.micro_batch_tokens=30",
            "deepspeed.policy.zero_stage=2", "deepspeed.value.zero_stage=2"]),
        "grpo_packed": lambda: group_update(work, "grpopk", grpo + [
            "ppo.micro_batch_size=4", "ppo.micro_batch_tokens=30"]),
        "zero2_micro4": lambda: first_update(work, "z2m4", [
            "ppo.micro_batch_size=4", "deepspeed.policy.zero_stage=2",
            "deepspeed.value.zero_stage=2"]),
        # tiled logits (the head 4 positions at a time): ZeRO reduces the head's gradient once,
        # after its last tile's backward (ds_grad_is_ready), and the update equals the untiled one
        "zero3_tiled": lambda: first_update(work, "z3tl", [
            "ppo.micro_batch_size=4", "ppo.tiled_logits=true", "ppo.logits_tile_tokens=4"]),
        "zero2_tiled": lambda: first_update(work, "z2tl", [
            "ppo.micro_batch_size=4", "ppo.tiled_logits=true", "ppo.logits_tile_tokens=4",
            "deepspeed.policy.zero_stage=2", "deepspeed.value.zero_stage=2"]),
        "varied_zero3": lambda: varied_lengths(work, "zero3"),
        "varied_gathered": lambda: varied_lengths(work, "gathered"),
        "replica": lambda: replica_and_roles(work),
        "tensor_parallel": lambda: tensor_parallel(work),
        "zero3_lora": lambda: first_update(work, "z3lora", [
            "ppo.micro_batch_size=4", "policy.lora.r=8", "value.lora.r=8"]),
        "zero3_lora_packed": lambda: first_update(work, "z3lorapk", [
            "ppo.micro_batch_size=4", "policy.lora.r=8", "value.lora.r=8",
            "ppo.micro_batch_tokens=30"]),
        "lora": lambda: lora_roles(work),
        # the RLHF recipe's extras: PPO-ptx with the EMA; the critic from a reward
        # model's export
        "zero3_ptx_ema": lambda: ptx_ema_update(work, "z3ptx", ["ppo.micro_batch_size=4"]),
        "value_from_rm": lambda: value_from_reward_model(work),
        "ema_swap": lambda: ema_swap(work),
        # supervised jobs, ZeRO-3: 4 rows per micro-batch (one rank: 2 accumulated), or packed
        "sft_micro4": lambda: supervised_steps(work, "sft", "sft4", [
            "sft.micro_batch_size=4", "deepspeed.policy.zero_stage=3"]),
        "sft_packed": lambda: supervised_steps(work, "sft", "sftpk", [
            "sft.micro_batch_size=4", "sft.micro_batch_tokens=20",
            "deepspeed.policy.zero_stage=3"]),
        "rm_micro4": lambda: supervised_steps(work, "rm", "rm4", [
            "rm.micro_batch_size=4", "deepspeed.policy.zero_stage=3"]),
        # ds-ppo dpo: the policy on ZeRO-3, its reference (ZeRO-3, offloaded) beside it
        "dpo_micro4": lambda: supervised_steps(work, "dpo", "dpo4", [
            "dpo.micro_batch_size=4", "deepspeed.policy.zero_stage=3", "dpo.beta=0.5"]),
        "env_micro4": lambda: first_update(work, "env4", ENV_BASE + ["ppo.micro_batch_size=4"],
                                           ENV_KEYS),
        "env_packed": lambda: first_update(work, "envpk", ENV_BASE + [
            "ppo.micro_batch_size=4", "ppo.micro_batch_tokens=40"], ENV_KEYS + PADDING_KEYS),
        "env_lora": lambda: first_update(work, "envlora", ENV_BASE + [
            "ppo.micro_batch_size=4", "policy.lora.r=8", "value.lora.r=8"], ENV_KEYS),
        # ds-ppo train with sequence parallelism (SP = world size), and its resume at SP = 1
        "sp_train": lambda: sp_train(work),
        # last: it registers the Ulysses attention (switched off outside its own forwards)
        "sequence_parallel": lambda: sequence_parallel() if dist.world_size() == 2 else {},
    }
    run_scenarios(scenarios, args, "dist_checks")


if __name__ == "__main__":
    main()
