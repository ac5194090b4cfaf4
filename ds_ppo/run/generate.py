"""`ds-ppo generate --model DIR PROMPT...`: responses of a trained policy, for a quick look.

DIR is a Hugging Face model directory (an export: `output_dir/final`, `ds-ppo export --out`), a
checkpoint directory (`output_dir/checkpoints/iter_000040`, whose `hf/` holds the policy's
safetensors, or a LoRA policy's PEFT adapter over its base) or a run's output_dir (its latest
checkpoint). The prompt goes through the tokenizer's chat template as a user turn when the
tokenizer has one (`--no-chat-template`: as plain text, as prompts from `data.prompt_key` are
trained); decoding is greedy unless `--temperature` > 0.

Before anything loads, the files are checked against their manifest (a checkpoint's `hf/`
against the checkpoint's, an export against its own; a LoRA adapter's base too when it is an
export): a damaged file is one line naming it, never garbage text. `--no-verify` skips that,
with a warning.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ds_ppo.errors import UserError


def model_dir(spec: str) -> Path:
    """The directory to load: DIR itself when it holds a model (config.json) or a PEFT adapter,
    else the `hf/` of the checkpoint DIR names (DIR, or the latest under an output_dir)."""
    p = Path(spec).expanduser()
    if not p.is_dir():
        raise UserError(f"--model {spec}: no such directory")
    if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
        return p
    from ds_ppo.engine.checkpoint.files import resolve_checkpoint

    hf = resolve_checkpoint(p) / "hf"
    if not any((hf / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json",
                                             "adapter_config.json")):
        raise UserError(f"{hf} holds no weights (checkpoint.save_hf_weights was false): write "
                        f"them with `ds-ppo export --checkpoint {spec} --out DIR`, then "
                        "`ds-ppo generate --model DIR`")
    return hf


def check_files(path: Path, verify: bool = True) -> None:
    """The files `path` (from `model_dir`) loads, against their manifest; `verify` false: a
    warning instead.

    Raises:
        CheckpointError: a file is missing, cut off or changed since it was saved (named).
    """
    import json
    import sys

    from ds_ppo.engine.checkpoint.files import is_export, verify_export, verify_files

    # a checkpoint's hf/: known by either of its two records (deleting one switches nothing off)
    ckpt = path.parent if any((path.parent / f).is_file()
                              for f in ("trainer_state.json", "manifest.json")) else None
    if not verify:
        print(f"ds-ppo generate: --no-verify: the files of {path} are NOT checked against "
              "their manifest (a damaged file may give wrong text)", file=sys.stderr, flush=True)
        return
    if ckpt is not None:
        verify_files(ckpt, "generate", (f"{path.name}/",))
    elif is_export(path):
        verify_export(path, "--model")
    if (path / "adapter_config.json").is_file():
        try:
            base = json.loads((path / "adapter_config.json").read_text())[
                "base_model_name_or_path"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # the loader names what is wrong with it
        if isinstance(base, str) and is_export(Path(base)):
            verify_export(Path(base), "the adapter's base model")


def load(path: Path):
    """(model in eval mode, tokenizer); a PEFT adapter directory loads with its base, merged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (path / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(path)).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path))
    return model.float().eval(), AutoTokenizer.from_pretrained(str(path))


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, chat: bool = True) -> str:
    """One response to `prompt` (the text after it, special tokens dropped)."""
    import torch

    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    sampled = {"do_sample": True, "temperature": temperature, "top_p": top_p} \
        if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
                             if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                             **sampled)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(args: argparse.Namespace) -> int:
    from ds_ppo.run.log_setup import quiet_libraries

    quiet_libraries("info")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    path = model_dir(args.model)
    check_files(path, not args.no_verify)
    model, tokenizer = load(path)
    for prompt in args.prompts:
        response = generate(model, tokenizer, prompt, args.max_new_tokens, args.temperature,
                            args.top_p, chat=not args.no_chat_template)
        print(response if len(args.prompts) == 1 else f"{prompt!r} -> {response!r}", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="responses of a trained policy (an export, a checkpoint "
                       "or a run's output_dir) to prompts")
    p.add_argument("--model", required=True,
                   help="an exported model dir, a checkpoint dir, or a run's output_dir")
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="for sampled decoding")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check of the model's files against their manifest (sizes and "
                   "CRC-32, docs/CHECKPOINTS.md), with a warning")
    p.add_argument("--no-chat-template", action="store_true",
                   help="the prompt as plain text, even when the tokenizer has a chat template")
    p.set_defaults(func=main)
