"""Reporting one iteration: its metrics reduced across ranks, then (rank 0) the progress line,
`metrics.jsonl`, MLflow metrics and the samples table."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ds_ppo.algo import explained_variance, group_score_stats, kl_clamped
from ds_ppo.config import Config
from ds_ppo.engine import dist
from ds_ppo.metrics import Accumulator, std_from_moments
from ds_ppo.ppo.episodes import format_transcript
from ds_ppo.progress import Eta, format_duration, format_signed
from ds_ppo.rewards.encode import readable_responses

if TYPE_CHECKING:
    from ds_ppo.engine.roles import Engines

log = logging.getLogger("ds_ppo")


def iteration_metrics(acc: Accumulator, exp, engines: Engines, kl_ctl,
                      t_iter: float, group_size: int = 1, kl_estimator: str = "k1",
                      kl_clip: float | None = None, kl_in_reward: bool = True
                      ) -> dict[str, float]:
    """Add this iteration's rollout statistics to `acc` and reduce everything across ranks
    (kl_estimator, kl_clip: ppo.kl_estimator and ppo.kl_clip, for kl/clamped_frac;
    kl_in_reward: ppo.kl_in_reward, without which kl_coef acts nowhere and is not logged)."""
    mask = exp.mask.float()
    n = float(len(exp))
    scores = exp.episode_scores.float()  # an episode's: its turn rewards and score
    acc.add_mean("score/mean", float(scores.sum()), n)
    acc.add_mean("score/sq_mean", float((scores ** 2).sum()), n)
    seq_reward = (exp.rewards * mask).sum(1)
    acc.add_mean("reward/mean", float(seq_reward.sum()), n)
    acc.add_mean("reward/sq_mean", float((seq_reward ** 2).sum()), n)
    seq_kl = (exp.kl * mask).sum(1)
    acc.add_mean("kl/sequence_mean", float(seq_kl.sum()), n)
    acc.add_tensor_mean("kl/token_mean", exp.kl, mask)
    acc.add_tensor_mean("kl/clamped_frac", kl_clamped(exp.old_logprobs, exp.ref_logprobs,
                                                      kl_estimator, kl_clip).float(), mask)
    if exp.teacher_logprobs is not None:  # on-policy distillation, per token over all ranks
        acc.add_tensor_mean("distill/reverse_kl", exp.old_logprobs - exp.teacher_logprobs, mask)
        acc.add_tensor_mean("distill/teacher_logprob", exp.teacher_logprobs, mask)
        if exp.teacher_top1 is not None:
            acc.add_tensor_mean("distill/top1_match", exp.teacher_top1, mask)
    if exp.entropy is not None:  # else the update's first epoch measured it
        acc.add_tensor_mean("policy/entropy", exp.entropy, mask)
    lengths = mask.sum(1)
    acc.add_mean("response/length_mean", float(lengths.sum()), n)
    acc.add_max("response/length_max", float(lengths.max()))
    acc.add_mean("response/eos_rate", float(exp.rollout.ended.float().sum()), n)
    if exp.reward_cut is not None:
        acc.add_mean("reward/input_cut_rate", float(exp.reward_cut.sum()), n)
    acc.add_max("time/reward_s", exp.reward_s)
    acc.add_mean("padding/scoring_positions_per_token", *exp.scoring_positions)
    if exp.rollout.response_routes is not None:  # a mixture-of-experts policy, our loop
        acc.add_mean("rollout/route_flip_frac", *exp.route_flips)
    if exp.reward_retries is not None:
        acc.add_sum("reward/retries", exp.reward_retries)
    if exp.old_values is not None:
        # over all ranks' valid tokens (its own all-reduces): the same value on every rank
        acc.add_replicated("value/explained_variance",
                           float(explained_variance(exp.old_values, exp.returns, exp.mask,
                                                    group=dist.dp_group())))
    if exp.advantages is not None:  # a response with advantage 0 on every token adds no gradient
        silent = ((exp.advantages == 0) | ~exp.mask).all(dim=1)
        acc.add_mean("advantage/zero_frac", float(silent.sum()), n)
    if group_size > 1:  # ppo.samples_per_prompt: the spread of each prompt's scores
        std, constant = group_score_stats(exp.episode_scores, group_size)
        acc.add_mean("score/group_std_mean", float(std.sum()), float(std.numel()))
        acc.add_mean("group/zero_std_frac", float(constant.sum()), float(constant.numel()))
    acc.add_sum("response/tokens_total", float(mask.sum()))
    acc.add_max("time/iteration_s", time.perf_counter() - t_iter)
    if torch.cuda.is_available():
        acc.add_max("memory/peak_gib", torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
    else:
        import resource

        acc.add_max("memory/peak_rss_gib",
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    m = acc.reduce()
    total_tokens = m["response/tokens_total"]
    m["score/std"] = std_from_moments(m["score/mean"], m.pop("score/sq_mean"))
    m["reward/std"] = std_from_moments(m["reward/mean"], m.pop("reward/sq_mean"))
    # response tokens of the whole job per second of each phase (the slowest rank's time)
    for phase in ("generation", "scoring", "update"):
        m[f"tokens_per_s/{phase}"] = total_tokens / max(m[f"time/{phase}_s"], 1e-9)
    m["tokens_per_s/iteration"] = total_tokens / max(m["time/iteration_s"], 1e-9)
    if kl_in_reward:
        m["kl_coef"] = float(kl_ctl.value)
    m["lr/policy"] = engines.policy.lr()
    if engines.value is not None:
        m["lr/value"] = engines.value.lr()
    ema_distance = engines.policy.ema_distance()  # collective under ZeRO-3
    if ema_distance is not None:
        m["ema/distance"] = ema_distance
    return m


@dataclass(frozen=True)
class ReportSettings:
    """Everything the report reads from the config."""

    iterations: int  # the run's total (the progress line's N/total, the ETA)
    log_every: int  # a progress line every N iterations
    log_samples_every: int  # tracking.log_samples_every: a samples table (0: never)
    num_samples: int  # tracking.num_samples: rows of each samples table
    schedule: str  # ppo.schedule (named in the progress line's staleness)
    reward_max_len: int  # reward.max_len (named in the input-cut warning)


def report_settings(cfg: Config) -> ReportSettings:
    """The report's settings from the config."""
    return ReportSettings(cfg.iterations, cfg.log_every, cfg.tracking.log_samples_every,
                          cfg.tracking.num_samples, cfg.ppo.schedule, cfg.reward.max_len)


class Reporter:
    """Rank 0's view of the run's progress: the ETA and the warnings given once per process.
    Created by `train()`; `report` is called once per iteration on every rank (the samples
    table is gathered from all ranks)."""

    def __init__(self, s: ReportSettings, tracker, out: Path, tokenizer):
        self.s, self.tracker, self.out = s, tracker, out
        self.tokenizer = tokenizer  # the policy's: the samples' response text
        self.eta = Eta()  # rank 0's time left, from the mean of recent iterations
        self.warned_cut = False  # the reward-input cut is reported once per process

    def report(self, metrics: dict[str, float], iteration: int, exp,
               eval_samples: list[tuple] | None = None) -> None:
        """Rank 0: progress line (and an eval line when this iteration evaluated),
        metrics.jsonl (always, independent of MLflow), samples.jsonl, MLflow."""
        s, tracker = self.s, self.tracker
        tables = {}  # "samples" (training) / "eval_samples": rows of every rank, collective
        every = s.log_samples_every
        if every and iteration % every == 0:
            k = s.num_samples
            r = exp.rollout
            rows = [sample_row(p, resp, s, extra, chat) for p, resp, s, extra, chat in
                    zip(r.prompts[:k], readable_responses(self.tokenizer, r, k),
                        exp.episode_scores[:k].tolist(), r.extras[:k],
                        r.messages[:k] if r.messages is not None else [None] * k)]
            if r.transcripts is not None:  # an episode: each turn with its reward
                for row, turns in zip(rows, r.transcripts[:k]):
                    row["turns"] = format_transcript(turns)
            # collective: every rank; one list per data-parallel rank (an SP group shares rows)
            tables["samples"] = sum(dist.gather_objects(rows, data_parallel=True), [])[:k]
        if eval_samples is not None:
            tables["eval_samples"] = _gather_rows(eval_samples, s.num_samples)
        if not dist.is_main():
            return
        self.eta.tick(iteration, metrics["time/iteration_s"])
        self._warn_reward_cut(metrics, iteration)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        tracker.log_metrics(metrics, step=iteration)
        self._log_samples(tables, iteration)
        if iteration % s.log_every == 0 or iteration == s.iterations:
            print(self.progress_line(metrics, iteration), flush=True)
        if "eval/score_mean" in metrics:  # every evaluation, whatever log_every says
            print(self.eval_line(metrics, iteration), flush=True)

    def _log_samples(self, tables: dict[str, list[dict]], iteration: int) -> None:
        """Each table into output_dir/samples.jsonl (one line per row, with its iteration and
        split: the rows of the MLflow table) and into MLflow."""
        lines = [json.dumps({"iteration": iteration,
                             "split": "eval" if name == "eval_samples" else "train", **row},
                            default=str)
                 for name, rows in tables.items() for row in rows]
        if lines:
            with open(self.out / "samples.jsonl", "a") as f:
                f.write("".join(line + "\n" for line in lines))
        for name, rows in tables.items():
            if rows:
                self.tracker.log_samples(rows, step=iteration, name=name)

    def eval_line(self, metrics: dict[str, float], iteration: int) -> str:
        """`eval iter   20/40 | score +0.1234 (std 0.0812) | len 11.2 | eos 0.25`: greedy
        responses to the evaluation prompts (data.eval_split)."""
        return (f"eval {iteration:>4}/{self.s.iterations} "
                f"| score {metrics['eval/score_mean']:+.4f} (std {metrics['eval/score_std']:.4f}) "
                f"| len {metrics['eval/length_mean']:.1f} | eos {metrics['eval/eos_rate']:.2f}")

    def progress_line(self, metrics: dict[str, float], iteration: int) -> str:
        s = self.s
        return (f"iter {iteration:>4}/{s.iterations} | score {metrics['score/mean']:+.4f} "
                f"| kl/tok {format_signed(metrics['kl/token_mean'])} "
                f"| entropy {metrics['policy/entropy']:.3f} "
                + (f"| pg {format_signed(metrics['loss/policy'])} " if "loss/policy" in metrics
                   else "| pg critic warm-up ") +
                (f"| ptx {metrics['loss/ptx']:.4f} " if "loss/ptx" in metrics else "")
                + (f"| vf {metrics['loss/value']:.4f} " if "loss/value" in metrics else "") +
                f"| len {metrics['response/length_mean']:.1f} "
                # by token: with partial rollouts a sequence's tokens differ in staleness
                + (f"| {s.schedule} stale {metrics['async/token_staleness_mean']:.1f} "
                   if "async/token_staleness_mean" in metrics else "") +
                f"| gen {metrics['time/generation_s']:.1f}s "
                f"| iter {metrics['time/iteration_s']:.1f}s "
                f"| eta {format_duration(self.eta.left(s.iterations - iteration))}")

    def _warn_reward_cut(self, metrics: dict[str, float], iteration: int) -> None:
        if metrics.get("reward/input_cut_rate", 0.0) > 0 and not self.warned_cut:
            self.warned_cut = True
            log.warning("iteration %d: %.1f%% of the reward model's inputs were longer than "
                        "reward.max_len = %d and lost the start of their prompt (metric "
                        "reward/input_cut_rate); raise reward.max_len if the reward model takes "
                        "longer inputs", iteration, 100 * metrics["reward/input_cut_rate"],
                        self.s.reward_max_len)


def _gather_rows(samples, k: int) -> list[dict]:
    """Collective: the first k sample rows over every rank's (prompt, response, score,
    data.reward_keys values, chat messages or None), rank 0's first."""
    rows = [sample_row(*sample) for sample in samples][:k]
    return sum(dist.gather_objects(rows, data_parallel=True), [])[:k]


def sample_row(prompt: str, response: str, score: float, extra: dict,
               messages: list | None = None) -> dict:
    """One row of the samples table, with the prompt's chat `messages` (a chat prompt only: the
    chat `ds-ppo samples` shows) and data.reward_keys values (e.g. the reference answer); a key
    named like a fixed column gets a `data/` prefix."""
    row = {"prompt": prompt, "response": response, "score": float(score)}
    if messages is not None:
        row["messages"] = messages
    row.update({(f"data/{k}" if k in row else k): v for k, v in extra.items()})
    return row
