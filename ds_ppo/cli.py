"""The `ds-ppo` command line: train, sft, rm, config, plan, export, generate, samples, tokenizer
and bench.

Each sub-command imports its heavy modules lazily, so `ds-ppo config` or a config error never
waits for DeepSpeed to import. User errors (config, data, paths) print one message and exit 2
with no traceback.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from ds_ppo.errors import UserError


def _load(args: argparse.Namespace):
    """The config of a command, saying once per job which of the file's keys the command line
    replaced (policy.path given for a preset that sets policy.arch, ...)."""
    from ds_ppo.config import load_config

    notes: list[str] = []
    cfg = load_config(args.config, args.overrides, notes)
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"ds-ppo: {note}", file=sys.stderr)
    return cfg


def _world_size(args: argparse.Namespace) -> int:
    """The ranks the config is checked for: the launcher's WORLD_SIZE, or a dry run's
    --world-size (a preset for 8 GPUs checked on a laptop)."""
    from ds_ppo.config import world_size_from_env
    from ds_ppo.errors import ConfigError

    if args.world_size is None:
        return world_size_from_env()
    if not args.dry_run:
        raise ConfigError("--world-size only applies to --dry-run (a run takes its ranks from "
                          "the launcher)")
    if args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: must be at least 1")
    return args.world_size


def _run_job(args: argparse.Namespace) -> int:
    """A training command (`ds-ppo train`, `sft`, `rm`: the registry's rows, jobs/contract.py): the
    job's config and checks, then the run driver with it."""
    from ds_ppo.jobs import by_command

    spec = by_command(args.command)
    _hide_secrets([o.split("=", 1)[-1] for o in args.overrides])
    cfg, world = spec.configure(_load(args)), _world_size(args)
    _hide_secrets([cfg.reward.url, cfg.tracking.uri, cfg.env.url])
    spec.check(cfg, world, args.dry_run)
    if args.dry_run:
        print(f"config OK for world size {world}")
        return 0
    done = spec.finished(cfg)
    if done is not None:  # a re-run of a finished run: stop before torch even imports
        if os.environ.get("RANK", "0") == "0":
            print(done)
        return 0
    from ds_ppo.run.preemption import Preempted
    from ds_ppo.trainer import run_job

    try:
        run_job(cfg, spec.name)
    except Preempted as e:  # saved, or given up at the last checkpoint: 128 + signal, not finished
        print(f"ds-ppo: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the loop started, or a second one within it
        print("ds-ppo: interrupted; nothing saved after the last checkpoint", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


def _hide_secrets(urls: list[str | None]) -> None:
    """The credentials of these URLs (and of $MLFLOW_TRACKING_URI) are hidden in everything this
    process prints or logs from now on (ds_ppo/redaction.py)."""
    from ds_ppo.redaction import redact_output, register_url

    for url in [*urls, os.environ.get("MLFLOW_TRACKING_URI")]:
        if url and "://" in url:
            register_url(url)
    redact_output()


def _config(args: argparse.Namespace) -> int:
    import yaml

    from ds_ppo.config import describe

    if args.describe:
        print("\n".join(describe()))
        return 0
    from ds_ppo.redaction import redact_tree

    _hide_secrets([o.split("=", 1)[-1] for o in args.overrides])
    cfg = _load(args)
    _hide_secrets([cfg.reward.url, cfg.tracking.uri, cfg.env.url])
    # as the run shows it (its MLflow params, config.yaml): no password, no query token
    print(yaml.safe_dump(redact_tree(cfg.to_dict()), sort_keys=False), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from ds_ppo.plan import main as plan_main

    return plan_main(args)


def _export(args: argparse.Namespace) -> int:
    from ds_ppo.run.export import main as export_main

    return export_main(args)


def _tokenizer_train(args: argparse.Namespace) -> int:
    from ds_ppo.data.tokenizer import train_tokenizer

    out = train_tokenizer(args.input, args.vocab_size, args.out, model_type=args.model_type)
    print(f"tokenizer saved to {out}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ds_ppo.bench import main as bench_main  # --peer trl too (bench/cli.py)

    return bench_main(args.bench_args)


_WORLD_SIZE_HELP = ("with --dry-run: check the config for this many ranks (default: "
                    "$WORLD_SIZE, else 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-ppo")  # its description: below, from the commands
    # The deepspeed launcher appends --local_rank=N; the rank is read from LOCAL_RANK instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    from ds_ppo.jobs import JOBS

    for spec in JOBS.values():  # the training commands: one per registered job
        p = sub.add_parser(spec.command, help=spec.help)
        p.add_argument("--config", default=None,
                       help="YAML config file or preset name (default: the tiny preset)")
        p.add_argument("--dry-run", action="store_true", help="validate the config and stop")
        p.add_argument("--world-size", type=int, default=None, help=_WORLD_SIZE_HELP)
        p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                       help=argparse.SUPPRESS)
        p.add_argument("overrides", nargs="*",
                       help=f"dotted key=value overrides, e.g. {spec.example}")
        p.set_defaults(func=_run_job)

    p = sub.add_parser("config", help="print the resolved config, or describe every key")
    p.add_argument("--config", default=None)
    p.add_argument("--describe", action="store_true", help="list every key with its doc")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_config)

    p = sub.add_parser("plan", help="memory plan per role and rank for a config and cluster")
    p.add_argument("--config", default=None)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--gpu-mem-gib", type=float, default=80.0)
    p.add_argument("--cpu-mem-gib", type=float, default=None,
                   help="CPU memory per node (default: unchecked)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    commands = [spec.command for spec in JOBS.values()]
    p.add_argument("--job", choices=commands, default=commands[0],
                   help="the training command to plan: " + ", ".join(
                       f"`ds-ppo {c}`" for c in commands) + f" (default {commands[0]})")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_plan)

    p = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face directory")
    p.add_argument("--checkpoint", required=True, help="a checkpoint dir (or an output_dir)")
    p.add_argument("--out", required=True)
    p.add_argument("--value", action="store_true", help="also export the value model")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="weight dtype of the export (default auto: the dtype the policy trained "
                   "in, as the checkpoint records it)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if it holds something other than a ds_ppo export")
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA policy: write its PEFT adapter directory (load with "
                   "PeftModel.from_pretrained(base, dir)) instead of the merged model")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check of the checkpoint's files against its manifest (sizes "
                   "and CRC-32, docs/CHECKPOINTS.md)")
    p.set_defaults(func=_export)

    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = tsub.add_parser("train", help="train a SentencePiece tokenizer, save it as HF directory")
    t.add_argument("--input", required=True, help="text corpus, one sentence per line")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--model-type", choices=["unigram", "bpe"], default="bpe")
    t.set_defaults(func=_tokenizer_train)

    from ds_ppo.run.generate import add_parser as add_generate  # both import torch lazily
    from ds_ppo.run.samples import add_parser as add_samples

    add_generate(sub)
    add_samples(sub)

    p = sub.add_parser("bench", help="GPU/CPU benchmark of one PPO iteration's phases "
                       "(ds-ppo bench --help for its flags); --peer trl: ds_ppo beside TRL "
                       "(ds-ppo bench --peer trl --help)", add_help=False)
    p.set_defaults(func=_bench)
    names = list(sub.choices)
    parser.description = ("RLHF for language models on DeepSpeed (PPO, supervised fine-tuning, "
                          f"reward models) and its tools: the commands {', '.join(names[:-1])} "
                          f"and {names[-1]} (`ds-ppo COMMAND --help` for each).")
    return parser


def main(argv: list[str] | None = None) -> int:
    from ds_ppo.run.log_setup import quiet_notices  # no library import

    argv = sys.argv[1:] if argv is None else argv
    quiet_notices("debug" if "log_level=debug" in argv else "info")
    from ds_ppo.run.tracking import quiet_mlflow

    quiet_mlflow()  # before anything imports mlflow (deepspeed does, for its monitor)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra  # the benchmark parses its own flags
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is seen below, not at exit
        return rc
    except UserError as e:
        print(f"ds-ppo: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `ds-ppo config --describe | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
