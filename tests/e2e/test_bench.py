"""`ds-ppo bench` on CPU with the tiny shape: the table and the JSON, the baselines and their
ratios, greedy outputs equal to plain HF generate, and a run without mlflow or datasets (as on
the GPU image, where neither is installed). Plus the FLOP formulas, worked by hand."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_cli
from test_bench_peer import HAVE_TRL, PEER_TINY, check_peer_run
from ds_ppo.bench import FlopModel, flop_model, main

# Runs `python -m ds_ppo.bench ARGS` with mlflow and datasets made unfindable, as if not installed
# (DeepSpeed's autotuner tries `import mlflow` and copes when it is missing). Every attempt to
# import them is recorded with the file that asked, so the test can tell DeepSpeed's guarded
# probe from a ds_ppo import.
_AS_ON_GPU_IMAGE = r"""
import atexit, importlib.machinery, json, runpy, sys

BLOCKED = ("mlflow", "datasets")
attempts = []

class _NotInstalled(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                         or "importlib" in frame.f_code.co_filename):
                frame = frame.f_back
            attempts.append({"module": name,
                             "from": frame.f_code.co_filename if frame else "?"})
            return None
        return super().find_spec(name, path, target)

sys.meta_path = [_NotInstalled if f is importlib.machinery.PathFinder else f
                 for f in sys.meta_path]
report, sys.argv = sys.argv[1], ["ds_ppo.bench"] + sys.argv[2:]
atexit.register(lambda: open(report, "w").write(json.dumps(attempts)))
runpy.run_module("ds_ppo.bench", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    out, attempts = work / "out.json", work / "imports.json"
    args = ["--shape", "tiny", "--prompts", "4", "--prompt-len", "8", "--new-tokens", "8",
            "--iterations", "1", "--json", str(out)]
    # a generous timeout: a test must never kill a process that may be JIT-building an extension
    # (its lock would stall every later start); on CPU nothing is built (ds_ppo.engine.extensions)
    proc = subprocess.run([sys.executable, "-c", _AS_ON_GPU_IMAGE, str(attempts), *args],
                          cwd=work, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), (
        f"bench exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout, json.loads(out.read_text()), json.loads(attempts.read_text())


def test_prints_one_table_and_the_json_line(tiny_run):
    stdout, result, _ = tiny_run
    assert stdout.count("| phase | seconds | tokens | tok/s | TFLOP/s | MFU |") == 1
    for label in ("generation (gathered", "scoring (", "training (", "end-to-end",
                  "greedy gen: hooks path", "greedy gen: plain HF generate", "greedy gen: ours"):
        assert f"| {label}" in stdout
    assert json.loads(stdout.strip().splitlines()[-1]) == result  # the last line is the JSON


def test_phases_have_time_rates_and_flops(tiny_run):
    _, result, _ = tiny_run
    s = result["settings"]
    assert (s["shape"], s["prompts"], s["prompt_len"], s["new_tokens"]) == ("tiny", 4, 8, 8)
    assert result["peak_tflops"] > 0
    for name in ("generation", "scoring", "training", "end_to_end"):
        ph = result["phases"][name]
        assert ph["seconds"] > 0 and ph["tokens_per_s"] > 0, name
        assert math.isfinite(ph["tflop"]) and ph["tflop"] > 0, name
        assert math.isfinite(ph["tflops"]) and math.isfinite(ph["mfu"]) and ph["mfu"] > 0, name
    assert result["phases"]["generation"]["tokens"] == 4 * 8  # every response is 8 tokens
    assert result["phases"]["training"]["tokens"] == 4 * 16
    timed = [r for r in result["iterations"] if not r["warmup"]]
    assert len(timed) == 1 and len(result["iterations"]) == 2
    # the policy's full parameter count (the role's num_params: ZeRO-3 partitions counted whole)
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = {k: v for k, v in result["model"]["arch"].items() if k != "model_type"}
    assert result["model"]["params_total"] == LlamaForCausalLM(LlamaConfig(**arch)).num_parameters()


def test_baselines_ratios_and_greedy_match(tiny_run):
    _, result, _ = tiny_run
    cmp_ = result["generation_compare"]
    for key in ("hooks", "plain", "ours"):
        assert cmp_[key]["seconds"] > 0 and cmp_[key]["tokens_per_s"] > 0, key
        assert cmp_[key]["new_tokens"] == 4 * cmp_[key]["width"], key
    assert cmp_["ratio_vs_hooks"] == pytest.approx(
        cmp_["ours"]["tokens_per_s"] / cmp_["hooks"]["tokens_per_s"])
    assert cmp_["ratio_vs_plain"] == pytest.approx(
        cmp_["ours"]["tokens_per_s"] / cmp_["plain"]["tokens_per_s"])
    assert cmp_["greedy_match"] is True and cmp_["greedy_match_fraction"] == 1.0
    assert cmp_["common_prefix"] == cmp_["ours"]["width"]
    assert cmp_["greedy_fp32"]["greedy_match"] is True
    # ours is our own decoding loop; the baselines are HF generate; CPU: no CUDA graph
    assert (cmp_["ours"]["loop"], cmp_["plain"]["loop"], cmp_["hooks"]["loop"]) == (
        "own", "hf", "hf")
    assert result["iterations"][-1]["generation"]["loop"] == "own"
    assert not cmp_["ours"]["cuda_graph"] and cmp_["ours"]["graph_error"] is None
    assert set(result["targets"]) == {"generation_vs_hooks", "generation_vs_plain",
                                      "training_mfu", "end_to_end_mfu"}


def test_runs_without_mlflow_or_datasets(tiny_run):
    _, result, attempts = tiny_run
    assert result["imported_mlflow"] is False and result["imported_datasets"] is False
    from_ds_ppo = [a for a in attempts if "/ds_ppo/" in a["from"]]
    assert not from_ds_ppo, from_ds_ppo


def test_summarize_prints_one_row_per_result(tiny_run, tmp_path, capsys):
    _, result, _ = tiny_run
    skipped = dict(result, generation_compare=None)
    (tmp_path / "main.json").write_text(json.dumps(result))
    (tmp_path / "nobase.json").write_text(json.dumps(skipped))
    assert main(["--summarize", str(tmp_path / "main.json"), str(tmp_path / "nobase.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3  # header + 2 runs
    main_row = rows[1].split(" | ")
    assert main_row[0] == "| main" and "own loop" in main_row[1]
    ratio = result["generation_compare"]["ratio_vs_plain"]
    assert f"{ratio:.2f}x" in rows[1] and "yes (yes)" in rows[1]
    assert rows[2].startswith("| nobase |") and " - | - |" in rows[2]


def test_hf_generate_loop_runs(tmp_path):
    # a process of its own (forked by run_cli): the bench initialises torch.distributed, which
    # must not leak into pytest
    proc = run_cli(["bench", "--shape", "tiny", "--prompts", "2", "--prompt-len", "4",
                    "--new-tokens", "4", "--iterations", "1", "--warmup", "0", "--gen-loop", "hf",
                    "--skip-baselines", "--json", str(tmp_path / "r.json")], cwd=tmp_path)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["settings"]["gen_loop"] == "hf"
    assert result["iterations"][0]["generation"]["loop"] == "hf"
    assert "HF generate, dynamic cache" in proc.stdout


def test_help_goes_through_the_cli_separator(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--", "--help"])  # `ds-ppo bench -- --help`
    assert e.value.code == 0
    assert "--device-peak-tflops" in capsys.readouterr().out


# --------------------------------------------------------------------------- FLOPs by hand
FM = FlopModel(body_params=10, layers=2, attn_width=4, hidden=3, vocab=5)


def test_forward_flops_by_hand():
    # 2*10*3 body + 2*2*4*3*(3+1) causal attention + 2*3*5*1 head
    assert FM.forward(3, 1, 5) == 60 + 192 + 30


def test_generate_flops_by_hand_and_as_one_forward():
    assert FM.generate(3, 1) == FM.forward(3, 1, 5)  # one new token: the prefill only
    # P=2, T=3: prefill 2*10*2 + 2*2*4*2*3 + 2*3*5 = 166; 2 steps of 2*10 + 2*3*5 = 100;
    # they attend to 3 and 4 keys: 4*2*4*(3+4) = 224
    assert FM.generate(2, 3) == 166 + 100 + 224
    assert FM.generate(2, 3) == FM.forward(4, 3, 5)  # the cache saves work, not counted work
    assert FM.generate(2, 0) == 0.0


def test_scoring_and_training_flops():
    S, T = 6, 2
    policy, value = FM.forward(S, T + 1, 5), FM.forward(S, S, 1)
    assert FM.scoring(4, 2, reward_model=False) == 2 * policy + value
    assert FM.scoring(4, 2, reward_model=True) == 2 * policy + value + FM.forward(S, 1, 1)
    assert FM.training(4, 2, ppo_epochs=2) == 2 * 3 * (policy + value)


def test_flop_model_counts_body_parameters_of_a_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    fm = flop_model(model)
    layers = sum(p.numel() for p in model.model.layers.parameters())
    assert fm.body_params == layers + model.model.norm.weight.numel()
    assert (fm.layers, fm.attn_width, fm.hidden, fm.vocab) == (2, 16, 16, 50)


def test_gpu_session_script_runs_the_variants_and_prints_the_summary_last(tmp_path):
    """launch/bench_gpu.sh (the one script the GPU session runs), on CPU with the tiny shape: the
    preset's row (zero_stage auto), ZeRO-3 with its knobs, the decode run (eager and compiled
    step, fp32 greedy check), the MoE decode run (one experts implementation, eager and CUDA
    graph, expert choices recorded), sync against one_step_off, the peer step; one tarball of
    every result; the summaries last."""
    import tarfile

    from conftest import REPO

    env = clean_env(BENCH_SHAPE="tiny", BENCH_RUNS="preset z3_knobs decode moe schedule peer",
                    BENCH_MODELS=str(tmp_path / "models"),
                    BENCH_FLAGS="--prompts 4 --prompt-len 8 --new-tokens 8 --iterations 1",
                    DECODE_FLAGS="--rows 2 --new-tokens 6", PEER_FLAGS=" ".join(PEER_TINY),
                    MOE_FLAGS="--rows 2 --new-tokens 6 --experts eager")
    res = tmp_path / "res"
    proc = subprocess.run(["bash", str(REPO / "launch" / "bench_gpu.sh"), str(res), "900"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    lines = out.strip().splitlines()
    table = lines.index(next(line for line in lines if line.startswith("| run |")))
    assert lines[table + 2].startswith("| preset | ZeRO auto 0/0/0/0, micro 2")  # CPU: stage 0
    assert lines[table + 3].startswith("| z3_knobs | ZeRO-3, ") and "persistence 1e+06" in \
        lines[table + 3] and "live 3e+09" in lines[table + 3]
    schedules = [line.split("|")[1].strip() for line in lines
                 if line.startswith(("| sync |", "| one_step_off |"))]
    assert schedules == ["sync", "one_step_off"], out[-3000:]
    decode = [line for line in lines if line.startswith("| tiny | 2 |")]
    assert [line.split("|")[3].strip() for line in decode] == ["eager", "compiled"], decode
    assert "greedy fp32 (8 rows x 32 tokens): compiled == eager: yes; eager == HF generate: yes" \
        in out
    moe = [line.split("|")[3:5] + line.split("|")[7:9] for line in lines
           if line.startswith("| tiny_moe | 2 |")]
    assert [[c.strip() for c in row] for row in moe] == [
        ["eager", "eager", "recorded", "off"], ["eager", "CUDA graph", "recorded", "not used"]]
    assert lines[-4].startswith("decode: exit 0 |")
    assert lines[-3].startswith("moe: exit 0 |")
    assert lines[-2].startswith("schedule: exit 0 | | one_step_off |")
    if HAVE_TRL:  # the peer bench's one run in the suite (its checks: test_bench_peer.py)
        assert lines[-1].startswith("peer: exit 0 |"), lines[-1]
        check_peer_run(res / "peer", json.loads((res / "peer.json").read_text())["results"],
                       (res / "peer.log").read_text())
    else:
        assert lines[-1].startswith("peer: skipped (trl is not installed")
    preset = json.loads((res / "preset.json").read_text())["settings"]
    assert preset["zero_stage"] == "auto" and preset["zero_stages"] == {
        "policy": 0, "value": 0, "reference": 0, "reward": 0}
    with tarfile.open(res / "bench_gpu_results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"preset.json", "z3_knobs.json", "decode.json", "decode.log", "moe.json",
            "decode_profile_2.txt", "decode_profile_2_compiled.txt"} <= names
    bad = subprocess.run(["bash", str(REPO / "launch" / "bench_gpu.sh"), str(tmp_path / "r2")],
                         env=dict(env, BENCH_RUNS="nonsense"), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown run nonsense" in bad.stdout


def test_bench_and_trainer_run_one_iteration_function():
    """The benchmark times the code `ds-ppo train` runs: the iteration's stages (and the reward
    model's input encoder) are called from ds_ppo/ppo/iteration.py only, which both call."""
    import ast

    from conftest import REPO

    stages = {"make_rollout", "score", "add_advantages", "ppo_update", "rollout_for_reward",
              "encode_rollout_for_reward"}
    allowed = {"ppo/iteration.py": stages,
               "ppo/train_job.py": {"make_rollout"},  # evaluation generates
               "rewards/encode.py": {"rollout_for_reward", "encode_rollout_for_reward"}}
    calls = {}
    for path in sorted((REPO / "ds_ppo").rglob("*.py")):
        rel = str(path.relative_to(REPO / "ds_ppo"))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                calls.setdefault(rel, set()).add(node.func.id)
    strays = {rel: sorted(names & stages - allowed.get(rel, set()))
              for rel, names in calls.items() if names & stages - allowed.get(rel, set())}
    assert not strays, strays
    assert {"run_iteration", "reward_encoder"} <= calls["bench/run.py"]
    assert "run_iteration" in calls["ppo/train_job.py"]


def test_gpu_checks_script_runs_its_steps_and_prints_a_summary(tmp_path):
    """launch/gpu_checks.sh (the checks a GPU session runs after the bench), on CPU: every step
    runs and exits 0, and the summary names each with its last line."""
    from conftest import REPO

    env = clean_env(GPU_CHECKS_DEVICE="cpu", GPU_CHECKS_PACKING_FLAGS=(
        "--rows 8 --layers 1 --hidden 64 --vocab 512 --repeats 1 --tokens 256"),
        GPU_CHECKS_EXACT_FLAGS="--tiny --dtype fp32")
    proc = subprocess.run(["bash", str(REPO / "launch" / "gpu_checks.sh"), str(tmp_path / "res")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-4:]
    assert [line.split(":")[0] for line in summary] == ["packed_equal", "packed_time",
                                                         "tp_nccl_graph", "exactness"], summary
    assert all(": exit 0 |" in line for line in summary), summary
    assert "passed" in summary[0] and "/ rows" in summary[1] and "skipped" in summary[2]
    exact = json.loads((tmp_path / "res" / "exactness.json").read_text())
    assert exact["batch_invariant"]["logprob_abs_diff_max"] == 0.0  # exact on CPU in fp32
    assert exact["plain"]["tokens"] > 0 and exact["batch_invariant"]["scoring_s"] > 0
