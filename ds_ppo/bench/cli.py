"""The command line of `ds-ppo bench` (and `python -m ds_ppo.bench`): its flags, its logging, the
table and the JSON line it prints."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ds_ppo.bench.results import format_table, summary_table
from ds_ppo.bench.run import run
from ds_ppo.bench.workload import SHAPES

MODES = """modes:
  ds-ppo bench [FLAGS]                  one PPO iteration's phases and the generation baselines
  ds-ppo bench --schedule sync,async    ... and ppo.schedule settings compared in one run
  ds-ppo bench --summarize A.json B.json
                                        run nothing: one comparison row per earlier --json
  ds-ppo bench --peer trl [PEER FLAGS] [key=value ...]
                                        ds_ppo beside TRL's GRPOTrainer from the same weights
                                        (ds-ppo bench --peer trl --help)
  python -m ds_ppo.bench.decode --help  the decoding loop alone, against its memory bound"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ds-ppo bench", description="Time a PPO iteration's phases (generation, scoring, "
        "training) and generation baselines on one device; prints one table and a JSON line.",
        epilog=MODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=["trl"], default=None,
                   help="run ds_ppo beside a peer trainer instead (TRL's GRPOTrainer, from the "
                   "same starting weights: policy.arch or policy.path); its own flags: "
                   "ds-ppo bench --peer trl --help")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape (default: 1b on a GPU, tiny on CPU)")
    p.add_argument("--prompts", type=int, help="prompts per iteration (1b: 64, tiny: 4)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (1b: 256, tiny: 8)")
    p.add_argument("--new-tokens", type=int, help="response tokens (1b: 256, tiny: 8)")
    p.add_argument("--iterations", type=int, help="timed PPO iterations (1b: 3, tiny: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first (compile, "
                   "allocator, cuBLAS heuristics)")
    p.add_argument("--micro-batch", type=int, help="ppo.micro_batch_size (1b: 16, tiny: 2)")
    p.add_argument("--score-micro-batch", type=int,
                   help="ppo.score_micro_batch_size (1b: 32, tiny: 4)")
    p.add_argument("--mini-batch", type=int, help="ppo.mini_batch_size (default: --prompts, "
                   "one optimizer step per epoch)")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--gen-loop", choices=["own", "hf"], default="own",
                   help="generation.loop of our gathered generation: own (static cache, CUDA "
                   "graph, no per-token sync) or hf (HF generate)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="generation.cuda_graph (--gen-loop own, CUDA only)")
    p.add_argument("--gen-cache", choices=["dynamic", "static"], default=None,
                   help="--gen-loop hf: KV cache (default: static on GPU, dynamic on CPU)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="--gen-loop hf: generation.compile (default: on with a GPU)")
    p.add_argument("--attn", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa",
                   help="attention kernel of every role")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="policy and value recompute activations in backward")
    p.add_argument("--zero-stage", type=lambda v: v if v == "auto" else int(v),
                   choices=[0, 1, 2, 3, "auto"], default=3,
                   help="ZeRO stage of every role; auto: chosen by fit as `ds-ppo train` does "
                   "(the hooks baseline needs 3)")
    p.add_argument("--persistence-threshold", type=float, default=None,
                   help="deepspeed.<role>.zero3.persistence_threshold of every role (default: "
                   "the template's; 1e9 keeps every parameter whole on one GPU)")
    p.add_argument("--prefetch-bucket-size", type=float, default=None,
                   help="deepspeed.<role>.zero3.prefetch_bucket_size of every role (default: "
                   "the template's)")
    p.add_argument("--max-live-parameters", type=float, default=None,
                   help="deepspeed.<role>.zero3.max_live_parameters of every role (default: "
                   "the template's)")
    p.add_argument("--compile-step", action="store_true",
                   help="generation.compile_step (with keep_replica): our loop's decoding step "
                   "compiled by inductor")
    p.add_argument("--reward", choices=["model", "function"], default="model",
                   help="model: a 4th model of the same shape; function: a free Python reward")
    p.add_argument("--reward-latency", type=float, default=0.0, metavar="S",
                   help="with --reward function: each reward call answers after S seconds")
    p.add_argument("--schedule", default=None, metavar="NAMES",
                   help="compare ppo.schedule settings in one run, comma-separated (sync, "
                   "one_step_off, async or async:N for max_staleness N, each optionally "
                   "followed by +KEY=VALUE overrides of its own, e.g. sync+reward.stream=false): "
                   "the timed iterations of each on fresh engines, their iterations per hour "
                   "against the first's; every schedule runs with ppo.rollout_correction=tis")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any ds_ppo config override, e.g. --set ppo.ppo_epochs=2 (repeatable)")
    p.add_argument("--device-peak-tflops", type=float, default=None,
                   help="MFU denominator; skips the matmul measurement")
    p.add_argument("--baseline-new-tokens", type=int, default=None,
                   help="new tokens of the slow hooks baseline (default: min(new tokens, 32)); "
                   "tok/s is what is compared")
    p.add_argument("--skip-baselines", action="store_true",
                   help="no hooks / plain generation baselines (and no greedy match check)")
    p.add_argument("--output-dir", default=None,
                   help="keep the random-init weights here and reuse them in later runs of the "
                   "same shape (default: a temporary directory, removed at the end)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                   help="run nothing: print one comparison row per earlier --json result")
    return p.parse_args(argv)


def _setup_logging() -> None:
    import warnings

    logging.basicConfig(level=logging.INFO, format="[bench] %(message)s", stream=sys.stderr,
                        force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated")
    import transformers

    transformers.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `ds-ppo bench -- --shape tiny`: the CLI passes the separator on
        argv = argv[1:]
    from ds_ppo.errors import UserError

    if any(a == "--peer" or a.startswith("--peer=") for a in argv):  # bench/peer.py
        from ds_ppo.bench.peer import main as peer_main

        try:
            return peer_main(argv)
        except UserError as e:
            return _failed(e)
    args = parse_args(argv)
    args._argv = argv
    if args.summarize:
        print(summary_table([(Path(f).stem, json.loads(Path(f).read_text()))
                             for f in args.summarize]))
        return 0
    _setup_logging()
    try:
        result = run(args)
    except UserError as e:  # e.g. --prompts not divisible by --micro-batch
        return _failed(e)
    print(format_table(result), flush=True)
    line = json.dumps(result, default=float)
    if args.json_path:
        Path(args.json_path).write_text(line + "\n")
    print(line, flush=True)
    return 0


def _failed(e) -> int:
    print(f"ds-ppo bench: error: {e}", file=sys.stderr)
    return e.exit_code
