"""The peer side of `ds-ppo bench --peer trl`: Hugging Face TRL's GRPOTrainer on the starting
point `ds_ppo.bench.peer` prepared (run in its own process, never imported by ds_ppo's trainer).

    python -m ds_ppo.bench.peer_trl --shared DIR --out FILE.jsonl [--steps N] [--schedule ppo|brief]

DIR holds `policy/` (ds_ppo's random-init policy and tokenizer, from `materialize_arch`; with
ds_ppo's policy.path, meta.json names that directory and `tokenizer/` holds its tokenizer),
`prompts.jsonl` (ds_ppo's prompts in ds_ppo's sampling order) and `meta.json` (the ds_ppo config
numbers mirrored here: lr, warm-up, betas, eps, clip, kl_coef, max_new_tokens, batch sizes,
gradient checkpointing). The
reward is ds_ppo's own `reward.function`, called on the decoded completions.

One step = one rollout of `rollout_batch_size` prompts x `--num-generations` completions, then
  --schedule ppo (default): ds_ppo's update shape, `ppo_epochs` passes x (rollout / mini_batch)
      optimizer steps of `mini_batch_size` prompts' completions;
  --schedule brief: one optimizer step on the whole rollout (TRL's plain on-policy GRPO).
Each step is timed per phase: generation (`_generate`), scoring (the rest of
`_generate_and_score_completions`: rewards, reference and old log-probs) and update (the rest of
the step). One JSON row per step, then a summary row, go to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


class _PhaseClock:
    """Wraps a trainer's bound methods and adds up the seconds spent inside them."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def wrap(self, obj, method: str, name: str) -> None:
        inner = getattr(obj, method)

        sync = _synchronize()

        def timed(*args, **kwargs):
            sync()
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()  # on CUDA: the phase's kernels, not only their launches
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, method, timed)


def _optimizer(model, meta: dict):
    """ds_ppo's policy optimizer (engine/roles.py): AdamW without weight decay, lr x (step+1)/warmup
    for the first warm-up steps, then constant (the tiny default's schedule)."""
    import torch

    warm = max(1, meta["warmup_steps"])
    opt = torch.optim.AdamW(model.parameters(), lr=meta["lr"], betas=tuple(meta["betas"]),
                            eps=meta["eps"], weight_decay=meta["weight_decay"], foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else 1.0)
    return opt, sched


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ds_ppo.bench.peer_trl", description=__doc__.split("\n")[0])
    ap.add_argument("--shared", required=True, help="the directory ds_ppo.bench.peer prepared")
    ap.add_argument("--out", required=True, help="JSONL: one row per step, then a summary row")
    ap.add_argument("--steps", type=int, default=None, help="rollouts (default: meta iterations)")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per forward/backward (default: ds_ppo's micro x generations)")
    ap.add_argument("--schedule", choices=("ppo", "brief"), default="ppo")
    return ap.parse_args(argv)


def _dataset(shared: Path, tok, need: int):
    """The first `need` prepared prompts as a datasets.Dataset, after checking that TRL's
    tokenisation of their text gives the ids ds_ppo trained on."""
    from datasets import Dataset

    rows = [json.loads(line) for line in (shared / "prompts.jsonl").read_text().splitlines()]
    bad = [r for r in rows[:64] if tok(r["prompt"])["input_ids"] != r["prompt_ids"]]
    if bad:  # TRL tokenises the text itself: it must see the ids ds_ppo sees
        sys.exit(f"peer_trl: tokenizer differs from ds_ppo's on {len(bad)} prompts, e.g. {bad[0]}")
    if len(rows) < need:
        sys.exit(f"peer_trl: {shared}/prompts.jsonl has {len(rows)} rows, {need} needed")
    return Dataset.from_dict({"prompt": [r["prompt"] for r in rows[:need]]})


def _schedule(args: argparse.Namespace, meta: dict, seqs: int) -> tuple[int, int, int, int]:
    """(sequences per optimizer step, TRL num_iterations, optimizer steps per rollout, micro-batch)
    of --schedule."""
    g = args.num_generations
    if args.schedule == "brief":
        per_opt, num_iterations, opt_per_step = seqs, 1, 1
    else:
        per_opt = meta["mini_batch_size"] * g
        num_iterations = meta["ppo_epochs"]
        opt_per_step = num_iterations * (seqs // per_opt)
    micro = args.micro_batch or min(per_opt, meta["micro_batch_size"] * g)
    if per_opt % micro:
        sys.exit(f"peer_trl: --micro-batch {micro} must divide {per_opt}")
    return per_opt, num_iterations, opt_per_step, micro


def _reward(spec: str, log: list[float]):
    """ds_ppo's reward.function as a TRL reward function; each call's mean score goes to `log`."""
    from ds_ppo.rewards.call import load_reward_function

    score_fn = load_reward_function(spec)

    def reward(prompts, completions, **kwargs):
        scores = [float(s) for s in score_fn(list(prompts), list(completions))]
        log.append(statistics.fmean(scores))
        return scores

    reward.__name__ = "ds_ppo_reward"
    return reward


def _config(args: argparse.Namespace, meta: dict, steps: int, seqs: int):
    """TRL's GRPOConfig mirroring the prepared ds_ppo numbers; and optimizer steps per rollout."""
    from trl import GRPOConfig

    per_opt, num_iterations, opt_per_step, micro = _schedule(args, meta, seqs)
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "_trl",
        max_steps=steps * opt_per_step, per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_opt // micro, generation_batch_size=seqs,
        num_generations=args.num_generations, num_iterations=num_iterations,
        max_completion_length=meta["max_new_tokens"], temperature=meta["temperature"],
        top_p=meta["top_p"], top_k=meta["top_k"] or 0,
        generation_kwargs={"suppress_tokens": [meta["pad_token_id"]]},  # as ds_ppo samples
        learning_rate=meta["lr"], max_grad_norm=meta["grad_clip"], beta=meta["kl_coef"],
        # TRL's default is on (a recomputed forward per backward); ds_ppo's policy.* setting
        gradient_checkpointing=meta.get("gradient_checkpointing", False),
        # the device ds_ppo's run takes (a GPU when there is one); fp32 as the tiny default
        shuffle_dataset=False, use_vllm=False, use_cpu=not _cuda(), bf16=False, fp16=False,
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        seed=meta["seed"], dataloader_num_workers=0)
    return config, opt_per_step


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _synchronize():
    """A function that waits for the GPU's queued work (nothing on CPU)."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def _step_timer(clock: _PhaseClock, opt_per_step: int, seqs: int, reward_log: list[float],
                out_rows: list[dict]):
    """A TrainerCallback that appends one row per rollout to `out_rows` (once its optimizer
    steps are done): seconds in all, and per phase from `clock`."""
    from transformers import TrainerCallback

    marks: list[tuple[float, dict]] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            marks.append((time.perf_counter(), dict(clock.total)))

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % opt_per_step:
                return  # the rollout's updates are not all done yet
            now, totals = time.perf_counter(), dict(clock.total)
            t0, before = marks[-1]
            marks.append((now, totals))
            gen = totals.get("gen", 0.0) - before.get("gen", 0.0)
            both = totals.get("gen_score", 0.0) - before.get("gen_score", 0.0)
            secs = now - t0
            out_rows.append({"step": len(out_rows) + 1, "score": reward_log[-1],
                             "seconds": secs, "generation_s": gen, "scoring_s": both - gen,
                             "update_s": secs - both, "sequences": seqs,
                             "optimizer_steps": opt_per_step})

    return StepTimer()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    shared = Path(args.shared)
    meta = json.loads((shared / "meta.json").read_text())
    steps = args.steps or meta["iterations"]
    seqs = meta["rollout_batch_size"] * args.num_generations
    tok = AutoTokenizer.from_pretrained(meta["tokenizer"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(meta["policy"], dtype=torch.float32)
    dataset = _dataset(shared, tok, steps * meta["rollout_batch_size"])
    reward_log: list[float] = []
    config, opt_per_step = _config(args, meta, steps, seqs)
    clock, out_rows = _PhaseClock(), []
    opt, sched = _optimizer(model, meta)
    trainer = GRPOTrainer(model=model, reward_funcs=_reward(meta["reward"], reward_log),
                          args=config, train_dataset=dataset, processing_class=tok,
                          callbacks=[_step_timer(clock, opt_per_step, seqs, reward_log, out_rows)],
                          optimizers=(opt, sched))
    clock.wrap(trainer, "_generate", "gen")
    clock.wrap(trainer, "_generate_and_score_completions", "gen_score")
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    with open(args.out, "w") as f:
        for r in out_rows:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps({"summary": True, "train_s": total, "schedule": args.schedule,
                            "num_generations": args.num_generations,
                            "micro_batch": config.per_device_train_batch_size,
                            "optimizer_steps_per_step": opt_per_step, "trl": trl.__version__,
                            "transformers": transformers.__version__,
                            "torch": torch.__version__, "threads": torch.get_num_threads()})
                + "\n")
    print(f"peer_trl: {len(out_rows)} steps in {total:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
