"""What a checkpoint manifest costs (docs/CHECKPOINTS.md): the write at save (every file's size
and CRC-32, engine/checkpoint/manifest.py) and the check on resume, beside the save itself.

    python tools/measure_manifest.py --checkpoint outputs/tiny/checkpoints/iter_000040
    python tools/measure_manifest.py --hidden 768 --layers 12 --out /tmp/m100

--checkpoint times an existing checkpoint; otherwise a Llama-shape policy and value model are
built from a config (random weights) and written as a gae checkpoint on one rank holds them:
per role the fp32 weights and AdamW's two moments (torch.save, DeepSpeed's stage-0 file) and
the 16-bit safetensors copy. One process, one rank: on N ranks each checksums about 1/N.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from ds_ppo.engine.checkpoint import manifest


def _build(out: Path, hidden: int, layers: int, vocab: int) -> tuple[int, float]:
    """Write the checkpoint's files; -> (parameters per role, seconds the writes took)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab,
                         intermediate_size=hidden * 8 // 3, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    seconds = 0.0
    for role, hf in (("policy", "hf"), ("value", "hf_value")):
        (out / role / "ds").mkdir(parents=True)
        (out / hf).mkdir()
        start = time.perf_counter()
        torch.save({"module": state,
                    "optimizer": {"exp_avg": {k: torch.zeros_like(v) for k, v in state.items()},
                                  "exp_avg_sq": {k: torch.zeros_like(v)
                                                 for k, v in state.items()}}},
                   out / role / "ds" / "mp_rank_00_model_states.pt")
        save_file({k: v.to(torch.bfloat16) for k, v in state.items()},
                  str(out / hf / "model.safetensors"))
        seconds += time.perf_counter() - start
    config.save_pretrained(out / "hf")
    (out / "trainer_state.json").write_text(json.dumps({"iteration": 1}))
    return n, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="time this checkpoint directory")
    ap.add_argument("--out", type=Path, default=Path("/tmp/measure_manifest"))
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    params, save_s = None, None
    if args.checkpoint is not None:
        root = args.out
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(args.checkpoint, root)
        (root / manifest.MANIFEST).unlink(missing_ok=True)
    else:
        root = args.out
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        params, save_s = _build(root, args.hidden, args.layers, args.vocab)
    files = manifest.list_files(root)
    total = sum(files.values())
    write, verify = [], []
    for _ in range(args.repeat):
        (root / manifest.MANIFEST).unlink(missing_ok=True)
        start = time.perf_counter()
        manifest.write_share(root, 0, 1)
        manifest.merge(root)
        write.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert manifest.problems(root) == []
        verify.append(time.perf_counter() - start)
    print(json.dumps({
        "checkpoint": str(args.checkpoint or f"built: hidden {args.hidden}, {args.layers} layers"),
        "params_per_role": params, "files": len(files), "bytes": total,
        "save_s": None if save_s is None else round(save_s, 2),
        "manifest_write_s": round(min(write), 3), "verify_s": round(min(verify), 3),
        "verify_GB_per_s": round(total / min(verify) / 1e9, 2)}, indent=1))
    if args.checkpoint is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
