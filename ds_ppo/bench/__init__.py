"""`ds-ppo bench` (or `python -m ds_ppo.bench`): time one PPO iteration's phases on one device.

Builds the four roles (policy, value, reference, reward model) of one Llama-shape architecture
with random weights (`--shape 1b`: a 0.85B model, hidden 2048, 16 layers, GQA 16/4 heads, vocab
32000; `--shape tiny` for CPU/CI), feeds random-token prompts of a fixed length, and runs a
warm-up iteration and then `--iterations` PPO iterations through the trainer's own
`run_iteration` (ds_ppo/ppo/iteration.py: the code `ds-ppo train` runs). Then, on the same batch and
the same weights, three greedy generations: HF generate through the ZeRO-3 hooks (generation mode
`zero3`), plain HF generate on the gathered replica with the default dynamic cache, and ours
(mode `gathered` with the configured cache / compile). It prints one markdown table and one JSON
line (also written to `--json FILE`).

Counting (each formula in flops.FlopModel):
- tokens: generation = new tokens; scoring and training = sequence tokens (prompt + response),
  each of which goes through 3-4 models (scoring) or 2 models x ppo_epochs (training).
- FLOPs are model FLOPs (MFU, not hardware FLOPs: no recomputation is counted): 2 per
  non-embedding parameter per token, plus causal attention, plus the output head where logits
  are computed; backward = 2x forward.
- MFU = achieved TFLOP/s / the peak this run measures itself (a large matmul in the compute
  dtype), or `--device-peak-tflops`.

Responses always have exactly `--new-tokens` tokens (min_new_tokens = max_new_tokens), so every
run of a shape does the same work. Nothing here imports mlflow or datasets (tracking is off and
prompts are random ids), so it runs on an image that has neither.

The parts:
- workload.py: model shapes, the ds_ppo config built from the flags, stand-in tokenizer, prompts
- flops.py: the FLOP model; measure.py: timing, peak memory, the device's matmul peak
- run.py: one run (roles, PPO iterations, generation baselines); results.py: rates and tables
- cli.py: the flags and `main` (also `python -m ds_ppo.bench`)
- peer.py, peer_trl.py: `ds-ppo bench --peer trl`, ds_ppo beside TRL's GRPOTrainer
"""
from __future__ import annotations

from ds_ppo.bench.cli import main
from ds_ppo.bench.flops import FlopModel, flop_model

__all__ = ["FlopModel", "flop_model", "main"]
