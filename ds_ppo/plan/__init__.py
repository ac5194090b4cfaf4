"""`ds-ppo plan`: GPU and CPU memory of a PPO run, per role, per rank and per phase, before any
GPU is touched.

Each role's model is built on the meta device (no weights, no download) from its `arch` or from
the config.json under its `path`, to count parameters and find the largest layer. Everything
below is arithmetic on those counts; every rank holds the same amounts (ZeRO data parallelism,
no pipeline or tensor parallelism), so "per rank" means any rank.

Sources of the formulas:
- Model states of trained roles: DeepSpeed's own estimators,
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (ZeRO-3) and
  ``stage_1_and_2.estimate_zero2_model_states_mem_needs`` (ZeRO-2), reproduced term by term:
  2 bytes/param of 16-bit weights plus 16 bytes/param of fp32 master weights, gradients and
  Adam moments, partitioned over the data-parallel ranks, a largest-layer gather buffer of
  4 bytes/param, and CPU memory scaled by DeepSpeed's additional_buffer_factor 1.5.
- Activations: the per-layer accounting of Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", sec. 4.1, 34*s*b*h + 5*a*s^2*b bytes for GPT),
  redone for a Llama-style layer (see `layer_activation_bytes`).
- KV cache: 2 (K and V) * layers * kv_heads * head_dim * tokens * batch * 2 bytes.
- LoRA (policy.lora / value.lora): the frozen base as a frozen role's 16-bit weights, and the
  trained-role formulas above applied to the adapter parameters (r x (in + out) per adapted
  Llama projection) plus a value model's head; with the reference read from the policy's base
  there is no reference role.

The parts, in the order a plan is made:
- shapes.py: each role's model shape (meta-device build) and the parameter counts derived from it
- states.py: model states of trained and frozen roles (DeepSpeed's estimators)
- stages.py: `zero_stage: auto`, each role's ZeRO stage chosen by fit on the plan's peaks (the
  engine's choice too)
- activations.py: activations, logits and KV cache
- phases.py: the plan itself: states per role, the peak per GPU over generation, scoring and
  training (the generation mode from ds_ppo.engine.generation.choice, the engine's own decision)
- levers.py: the greedy lever search and the node count that fits; `plan` puts it together
- report.py: the table, the JSON and the `ds-ppo plan` command (`main`)
- fit.py: a run's ZeRO stages, this cluster measured and the plan's choice made on it (the jobs
  call it and hand the choice to the engine builders; not imported here: it needs torch)

Besides ds_ppo.config, ds_ppo.algo.choices, ds_ppo.engine.generation.choice and ds_ppo.role_names
it imports only torch and transformers (lazily), never deepspeed (fit.py: ds_ppo.engine.dist).
"""
from __future__ import annotations

from ds_ppo.plan.activations import (kv_cache_bytes, layer_activation_bytes, logits_bytes,
                                     prefill_activation_bytes, train_activation_bytes)
from ds_ppo.plan.levers import (_with_overrides, candidate_levers, find_levers,
                                min_nodes_that_fit, plan)
from ds_ppo.plan.phases import (RUNTIME_OVERHEAD_BYTES, Cluster, Lever, LeverEffect, Phase, Plan,
                                RolePlan, choose_zero_stages, compute_plan,
                                expert_all_to_all_bytes, expert_parallel_states)
from ds_ppo.plan.report import format_plan, main, to_json
from ds_ppo.plan.shapes import (ModelShape, RoleShapes, _hf_config, lora_params, model_shape,
                                resolve_shapes, tp_shard_params)
from ds_ppo.plan.states import (BUFFER_FACTOR, GiB, ModelStates, inference_states, train_states,
                                zero3_train_states)
