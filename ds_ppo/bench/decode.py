"""`python -m ds_ppo.bench.decode`: our decoding loop alone (`ds_ppo.engine.generation.loop.decode`, the
function `generation.loop=own` calls) on a random-init model of a bench shape, against the
memory bound of its step; optionally the kernel table of its steps and the fp32 greedy check.

    python -m ds_ppo.bench.decode --shape 1b --rows 64 256 --json decode.json     # one GPU
    python -m ds_ppo.bench.decode --shape tiny --rows 4 --new-tokens 8              # CPU check

For each row count and step variant (eager step; `generation.compile_step`: the step's forward
compiled by inductor), sampled at temperature 1 with every row running all new tokens: the
second call's seconds (the first compiles and captures), ms per step, tok/s, and the share of
the memory bound: the bytes a step must read (16-bit weights of every layer and the output
head, plus the K and V of the mean context, prompt + half the new tokens) over the device's
bandwidth (`--hbm-tb-s`, 4.8 for an H200). `--greedy-check`: in fp32, the greedy tokens of the
eager step, the compiled step and HF generate (plain model) on 8 rows x 32 tokens.

`--experts eager batched_mm grouped_mm` (a mixture-of-experts shape, e.g. 30b_a3b_2l): the eager
step without and with the CUDA graph (`generation.cuda_graph`), recording the expert choices as
`ppo.router_replay` does, for each experts implementation of transformers
(`config._experts_implementation`; those the installed transformers lacks are reported and
skipped): tok/s and whether the step's graph captured (else why it fell back).

    python -m ds_ppo.bench.decode --shape 30b_a3b_2l --rows 64 --experts eager batched_mm grouped_mm
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ds_ppo.bench.workload import SHAPES


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(SHAPES[shape]["arch"])
    arch["max_position_embeddings"] = 4096
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def step_bytes(model, rows: int, context: float) -> float:
    """Bytes one decoding step must read: the 16-bit (or model dtype) weights of every layer,
    the final norm and the output head (not the input embedding: a step reads `rows` of it),
    and the K and V of `context` tokens of every row."""
    c = model.config
    size = next(model.parameters()).element_size()
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() for p in model.parameters()) - embed.numel()
    if model.get_output_embeddings().weight is embed:  # tied: the head reads it whole
        weights += embed.numel()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * context * rows
    return float((weights + kv) * size)


def _decode(model, ids, mask, new_tokens: int, temperature: float, compile_step: bool,
            cuda_graph: bool = True, routes: bool = False):
    from ds_ppo.engine.generation.loop import decode

    return decode(model, ids, mask, max_new_tokens=new_tokens, eos_ids=[2], pad_id=0,
                  min_new_tokens=new_tokens if temperature > 0 else 0,
                  temperature=temperature, suppress_ids=[0], cuda_graph=cuda_graph,
                  compile_step=compile_step, routes=routes)


def experts_implementations() -> list[str]:
    """The experts implementations the installed transformers offers ("eager" always)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ["eager"]
    return ["eager"] + sorted(ALL_EXPERTS_FUNCTIONS.keys())


def set_experts(model, name: str) -> str:
    """Switch the model's experts to implementation `name`; returns the one it then runs."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    else:
        model.config._experts_implementation = name
    return model.config._experts_implementation


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, rows: int, prompt_len: int, new_tokens: int, compile_step: bool,
            hbm_bytes_s: float | None, profile_dir: Path | None = None,
            cuda_graph: bool = True, routes: bool = False) -> dict:
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    t0 = time.perf_counter()
    _decode(model, ids, mask, new_tokens, 1.0, compile_step, cuda_graph, routes)  # captures
    _sync(device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = _decode(model, ids, mask, new_tokens, 1.0, compile_step, cuda_graph, routes)
    _sync(device)
    seconds = time.perf_counter() - t0
    res = {"rows": rows, "compile_step": compile_step, "cuda_graph": cuda_graph,
           "routes": out.response_routes is not None, "seconds": seconds, "first_call_s": first,
           "steps": out.stats.steps, "graph": out.stats.graph,
           "graph_error": out.stats.graph_error,
           "ms_per_step": 1000 * seconds / out.stats.steps,
           "tokens_per_s": rows * out.stats.steps / seconds}
    bound = step_bytes(model, rows, prompt_len + new_tokens / 2)
    res["bound_bytes_per_step"] = bound
    if hbm_bytes_s:
        res["bound_ms_per_step"] = 1000 * bound / hbm_bytes_s
        res["of_bound"] = res["bound_ms_per_step"] / res["ms_per_step"]
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            _decode(model, ids, mask, min(new_tokens, 16), 1.0, compile_step)
            _sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        name = f"decode_profile_{rows}{'_compiled' if compile_step else ''}.txt"
        (profile_dir / name).write_text(prof.key_averages().table(sort_by=key, row_limit=30))
        res["profile"] = name
    return res


def greedy_check(shape: str, device: torch.device, rows: int = 8, prompt_len: int = 32,
                 new_tokens: int = 32) -> dict:
    """fp32: the eager step's greedy tokens == the compiled step's == HF generate's."""
    model = build_model(shape, device, torch.float32, seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    eager = _decode(model, ids, mask, new_tokens, 0.0, False).response_ids
    compiled = _decode(model, ids, mask, new_tokens, 0.0, True).response_ids
    hf = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new_tokens,
                        do_sample=False, eos_token_id=[2], pad_token_id=0,
                        suppress_tokens=[0])[:, prompt_len:]
    width = min(eager.shape[1], compiled.shape[1], hf.shape[1])
    same = lambda a, b: bool(a.shape == b.shape and torch.equal(a, b))  # noqa: E731
    return {"rows": rows, "new_tokens": new_tokens, "compiled_equals_eager": same(compiled, eager),
            "eager_equals_hf": same(eager, hf),
            "token_match_compiled_vs_hf": float((compiled[:, :width] == hf[:, :width])
                                                .float().mean())}


def moe_runs(model, rows: list[int], prompt_len: int, new_tokens: int,
             implementations: list[str]) -> list[dict]:
    """`--experts`: for each implementation the installed transformers offers, the eager step
    without and with the CUDA graph, recording the expert choices (module docstring). An
    implementation it lacks, or one that fails, is a row with its error."""
    offered, runs = experts_implementations(), []
    for name in implementations:
        if name not in offered:
            runs.append({"experts": name,
                         "error": f"not in this transformers ({', '.join(offered)})"})
            continue
        try:
            running = set_experts(model, name)
        except (ValueError, ImportError, RuntimeError) as e:
            runs.append({"experts": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        for n in rows:
            for graph in (False, True):
                try:
                    r = measure(model, n, prompt_len, new_tokens, False, None, cuda_graph=graph,
                                routes=True)
                except Exception as e:  # noqa: BLE001  (a kernel an implementation lacks here)
                    r = {"rows": n, "cuda_graph": graph, "error": f"{type(e).__name__}: {e}"[:200]}
                runs.append({"experts": running, **r})
                print(f"[decode] experts {running} rows {n} {'CUDA graph' if graph else 'eager'}: "
                      + (f"{r['tokens_per_s']:,.0f} tok/s, graph {r['graph']}"
                         if "error" not in r else r["error"]), flush=True)
    return runs


def moe_summary(result: dict) -> str:
    lines = ["| decode MoE | rows | experts | step | ms/step | tok/s | routes | CUDA graph |",
             "|---|---:|---|---|---:|---:|---|---|"]
    for r in result["moe_runs"]:
        if "seconds" not in r:
            lines.append(f"| {result['shape']} | {r.get('rows', '-')} | {r['experts']} | "
                         f"{'CUDA graph' if r.get('cuda_graph') else 'eager'} | - | - | - | "
                         f"error: {r['error']} |")
            continue
        graph = ("captured" if r["graph"] else
                 f"failed: {r['graph_error']}" if r["graph_error"] else
                 "off" if not r["cuda_graph"] else "not used")
        lines.append(f"| {result['shape']} | {r['rows']} | {r['experts']} | "
                     f"{'CUDA graph' if r['cuda_graph'] else 'eager'} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {'recorded' if r['routes'] else 'none'} | "
                     f"{graph} |")
    return "\n".join(lines)


def summary(result: dict) -> str:
    lines = ["| decode | rows | step | ms/step | tok/s | of memory bound | first call s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        share = f"{100 * r['of_bound']:.0f}%" if "of_bound" in r else "-"
        lines.append(f"| {result['shape']} | {r['rows']} | "
                     f"{'compiled' if r['compile_step'] else 'eager'}"
                     f"{' + CUDA graph' if r['graph'] else ''} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {share} | {r['first_call_s']:.1f} |")
    if result.get("greedy_fp32"):
        g = result["greedy_fp32"]
        lines.append(f"greedy fp32 ({g['rows']} rows x {g['new_tokens']} tokens): compiled == "
                     f"eager: {'yes' if g['compiled_equals_eager'] else 'NO'}; eager == HF "
                     f"generate: {'yes' if g['eager_equals_hf'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_ppo.bench.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape (default: 1b on a GPU, tiny on CPU)")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=None, help="(default: the shape's)")
    p.add_argument("--new-tokens", type=int, default=None, help="(default: the shape's)")
    p.add_argument("--steps", choices=["eager", "compiled", "both"], default="both")
    p.add_argument("--hbm-tb-s", type=float, default=None,
                   help="memory bandwidth for the bound (default: 4.8 on CUDA, none on CPU)")
    p.add_argument("--profile-dir", default=None,
                   help="write the kernel table of 16 steps per run here")
    p.add_argument("--greedy-check", action="store_true",
                   help="fp32 greedy: eager step == compiled step == HF generate")
    p.add_argument("--experts", nargs="+", default=None, metavar="IMPL",
                   help="a mixture-of-experts shape: these experts implementations, each "
                        "without and with the CUDA graph, expert choices recorded")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("1b" if device.type == "cuda" else "tiny")
    prompt_len = args.prompt_len or SHAPES[shape]["prompt_len"]
    new_tokens = args.new_tokens or SHAPES[shape]["new_tokens"]
    hbm = (args.hbm_tb_s or (4.8 if device.type == "cuda" else None))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(shape, device, dtype)
    profile_dir = Path(args.profile_dir) if args.profile_dir else None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    if args.experts:
        result = {"shape": shape, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                  "prompt_len": prompt_len, "new_tokens": new_tokens,
                  "moe_runs": moe_runs(model, args.rows, prompt_len, new_tokens, args.experts)}
        print(moe_summary(result), flush=True)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(result) + "\n")
        return 0
    variants = {"eager": [False], "compiled": [True], "both": [False, True]}[args.steps]
    runs = []
    for rows in args.rows:
        for compiled in variants:
            runs.append(measure(model, rows, prompt_len, new_tokens, compiled,
                                hbm * 1e12 if hbm else None, profile_dir))
            print(f"[decode] rows {rows} {'compiled' if compiled else 'eager'}: "
                  f"{runs[-1]['ms_per_step']:.2f} ms/step, {runs[-1]['tokens_per_s']:,.0f} tok/s",
                  flush=True)
    del model
    result = {"shape": shape, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
              "prompt_len": prompt_len, "new_tokens": new_tokens, "hbm_tb_s": hbm, "runs": runs,
              "greedy_fp32": greedy_check(shape, device) if args.greedy_check else None}
    print(summary(result), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
