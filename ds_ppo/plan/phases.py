"""The plan of one config on one cluster: model states per role and the peak per GPU over the
phases of an iteration (generation, scoring, training)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ds_ppo.config import (Config, lora_output_head, max_response_tokens, placement_problems,
                           reference_from_policy_base, uses_reference, validate)
from ds_ppo.errors import ConfigError
from ds_ppo.engine.forward import tile_logits
from ds_ppo.engine.generation.choice import choose_generation
from ds_ppo.plan.activations import (kv_cache_bytes, layer_activation_bytes, logits_bytes,
                                     prefill_activation_bytes, tiled_logits_bytes,
                                     train_activation_bytes)
from ds_ppo.plan.shapes import (ModelShape, RoleShapes, _params, lora_base_params, lora_params,
                               kv_shards, tp_shard_params)
from ds_ppo.plan.stages import StageChoice, resolve_stages
from ds_ppo.plan.states import GiB, ModelStates, inference_states, train_states
from ds_ppo.role_names import ROLES, TRAINED_ROLES

# CUDA context, NCCL communicators, DeepSpeed's bucket buffers and allocator fragmentation: a
# fixed per-GPU allowance, since none of them scale with the model in a way worth modelling.
RUNTIME_OVERHEAD_BYTES = 2 * GiB


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_bytes: int | None  # None: no accelerator (a CPU run's engine, plan/stages.py)
    cpu_mem_bytes: int | None = None  # per node; None = unchecked

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class RolePlan:
    role: str
    shape: ModelShape | None  # None: a reward function / the LoRA policy's base
    trained: bool
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    states: ModelStates
    expert_parallel_size: int = 1  # deepspeed.<role>.expert_parallel_size of a trained MoE role


@dataclass(frozen=True)
class Phase:
    """One moment of an iteration: the resident model states of every role plus what this
    moment adds on each GPU."""

    name: str
    transient: dict[str, int]  # term -> bytes per GPU
    # ppo.placement = split: a phase of the generation ranks, which hold none of the roles'
    # model states (only what `transient` names)
    generation_ranks: bool = False

    def total(self, resident: int) -> int:
        return (0 if self.generation_ranks else resident) + RUNTIME_OVERHEAD_BYTES \
            + sum(self.transient.values())


@dataclass(frozen=True)
class Lever:
    description: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class LeverEffect:
    lever: Lever
    saves_bytes: int  # peak GPU bytes per rank before minus after
    peak_after_bytes: int
    cpu_after_bytes: int  # CPU bytes per node after it (offloading moves memory there)
    fits_after: bool


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    roles: dict[str, RolePlan]
    seq_prompt: int
    seq_response: int
    micro_batch: int
    score_micro_batch: int
    micro_batch_tokens: int | None  # ppo.micro_batch_tokens: packed micro-batches (policy,
    # reference and value forwards), one sequence of up to max(this, longest row) tokens
    gen_batch: int
    generation_mode: str  # resolved: gathered | tensor_parallel | zero3
    generation_loop: str  # resolved: own | hf
    tp_size: int  # ranks per tensor-parallel group
    tp_unsupported: str | None  # why tensor_parallel cannot split the policy (None: it can)
    resident_bytes: int  # of every rank that trains (under split: the training ranks)
    phases: list[Phase]
    peak_gpu_bytes: int
    peak_phase: str
    cpu_bytes_per_node: int
    fits_gpu: bool
    fits_cpu: bool | None
    notes: list[str] = field(default_factory=list)
    biggest_lever: LeverEffect | None = None
    lever_path: list[LeverEffect] = field(default_factory=list)  # greedy, biggest first
    min_nodes: int | None = None  # smallest node count that fits as configured
    stage_choice: StageChoice | None = None  # the ZeRO stages and why
    placement: str = "colocated"  # ppo.placement
    generation_ranks: int = 0  # ranks that only generate (split), 0 colocated
    # the cluster the ZeRO states are partitioned over: the training ranks
    training_cluster: Cluster | None = None

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_cpu is not False

    def rank_peak(self, generation_ranks: bool) -> int:
        """The peak bytes per GPU of the generation ranks (ppo.placement = split; 0 without) or
        of the ranks that train."""
        totals = [ph.total(self.resident_bytes) for ph in self.phases
                  if ph.generation_ranks == generation_ranks]
        return max(totals, default=0)


def training_cluster(cfg: Config, cluster: Cluster) -> Cluster:
    """The ranks the trained roles' ZeRO states are partitioned over: the whole cluster, or under
    ppo.placement = split the world less the ppo.generation_ranks (the last ranks). Exact on one
    node and when the generation ranks fill whole nodes; otherwise the training ranks' whole
    nodes only (fewer ranks share the partitions: a bound from above). ConfigError when no rank
    is left to train."""
    if cfg.ppo.placement != "split":
        return cluster
    problems = placement_problems(cfg, cluster.world_size)
    if problems:
        raise ConfigError(problems[0])
    trainers = cluster.world_size - cfg.ppo.generation_ranks
    if trainers <= cluster.gpus_per_node:
        return replace(cluster, nodes=1, gpus_per_node=trainers)
    return replace(cluster, nodes=trainers // cluster.gpus_per_node)


def _lora_states(shape: ModelShape, adapters: int, cluster: Cluster, d) -> ModelStates:
    """A LoRA role: the frozen 16-bit base (as a frozen role) + the trained adapters' states."""
    base = inference_states(shape.params, shape.largest_layer_params, cluster.gpus_per_node,
                            cluster.nodes, d.zero_stage, d.offload_param)
    ad = train_states(adapters, 0, cluster.gpus_per_node, cluster.nodes, d.zero_stage,
                      d.offload_optimizer, d.offload_param)
    return ModelStates(base.gpu_bytes_per_rank + ad.gpu_bytes_per_rank, base.gather_bytes,
                       base.cpu_bytes_per_node + ad.cpu_bytes_per_node)


def _adapted_head(cfg: Config, role: str, shape: ModelShape) -> bool:
    """Whether the policy's output head gets an adapter too, as the engine decides (a tied head
    with output_head = true is refused: validation's message says so, the plan counts none)."""
    if role != "policy":
        return False
    try:
        return lora_output_head(cfg.policy.lora, cfg.policy.arch is not None, shape.tied)
    except ConfigError:
        return False


def _role_plan(cfg: Config, role: str, shape: ModelShape | None, cluster: Cluster,
               stage: int) -> RolePlan:
    d = getattr(cfg.deepspeed, role)
    d = d.model_copy(update={"zero_stage": stage})  # auto resolved (plan/stages.py)
    trained = role in TRAINED_ROLES
    lora = getattr(cfg, role).lora if trained else None
    if shape is None:
        states = ModelStates(0, 0, 0)
    elif lora is not None:  # the value head (hidden x 1) is trained fully
        states = _lora_states(shape, lora_params(shape, lora, _adapted_head(cfg, role, shape))
                              + (shape.hidden if role == "value" else 0), cluster, d)
    elif trained:
        states = (expert_parallel_states(shape, d.expert_parallel_size, cluster, d)
                  if d.expert_parallel_size > 1 and shape.experts else
                  train_states(shape.params, shape.largest_layer_params, cluster.gpus_per_node,
                               cluster.nodes, d.zero_stage, d.offload_optimizer,
                               d.offload_param))
    else:
        states = inference_states(shape.params, shape.largest_layer_params,
                                  cluster.gpus_per_node, cluster.nodes, d.zero_stage,
                                  d.offload_param)
    if role == "policy" and cfg.policy.ema_decay is not None and shape is not None:
        states = _with_ema(states, shape.params, cluster, d)
    ep = d.expert_parallel_size if trained and shape is not None and shape.experts else 1
    return RolePlan(role, shape, trained, d.zero_stage, d.offload_optimizer and trained,
                    d.offload_param, states, ep)


def expert_parallel_states(shape: ModelShape, n: int, cluster: Cluster, d) -> ModelStates:
    """Model states of a trained role with deepspeed.<role>.expert_parallel_size `n` > 1
    (AutoEP, `d` its deepspeed section with the stage resolved): each rank holds E / n experts
    of every MoE layer, their ZeRO partitions over the world / n ranks that hold the same
    experts; the rest of the model over the whole world.

    Under ZeRO-3 that leaves a rank's share of the expert states as over the whole world, but
    a layer's gather holds E / n experts (none at world = n): the largest gather is that or the
    output head / embeddings (vocab x hidden). Under ZeRO 0-2 the experts' states are those of
    a model of E / n experts' parameters on world / n GPUs (their CPU figure scaled to a node's
    GPUs), added to the rest's."""
    world = cluster.world_size
    experts = shape.layer_expert_params // n if world > n else 0
    largest = max(shape.vocab * shape.hidden, experts)
    if d.zero_stage == 3:
        return train_states(shape.params, largest, cluster.gpus_per_node, cluster.nodes, 3,
                            d.offload_optimizer, d.offload_param)
    dense = train_states(shape.params - shape.expert_params, largest, cluster.gpus_per_node,
                         cluster.nodes, d.zero_stage, d.offload_optimizer, d.offload_param)
    group = max(1, world // n)
    own = train_states(shape.expert_params // n, experts, group, 1, d.zero_stage,
                       d.offload_optimizer, d.offload_param)
    return ModelStates(dense.gpu_bytes_per_rank + own.gpu_bytes_per_rank, dense.gather_bytes,
                       dense.cpu_bytes_per_node
                       + own.cpu_bytes_per_node * cluster.gpus_per_node // group)


def expert_all_to_all_bytes(shape: ModelShape, n: int, tokens: int) -> int:
    """The all-to-all buffers of one AutoEP layer in a micro-batch's forward (backward alike):
    each of the `tokens` tokens goes to top-k experts, as a 16-bit hidden-size row sent and one
    received in the dispatch, and again in the combine. 0 without expert parallelism."""
    if n <= 1 or not shape.experts:
        return 0
    return 4 * tokens * shape.top_k * shape.hidden * 2


def _moe_notes(cfg: Config, roles: dict[str, RolePlan], world: int) -> list[str]:
    """What the plan says of a mixture-of-experts role: total against active parameters (states
    scale with the first, FLOPs per token with the second), the whole-block ZeRO-3 gather, and
    the sampler's recorded routes (ppo.router_replay)."""
    notes = []
    for role, rp in roles.items():
        s = rp.shape
        if s is None or not s.experts:
            continue
        gather = (f"; ZeRO-3 gathers each MoE block whole (one leaf module: every expert of "
                  f"the layer, {2 * s.layer_expert_params / GiB:.2f} GiB of 16-bit weights, "
                  "whichever experts the rank's tokens use)" if rp.zero_stage == 3 else "")
        n = rp.expert_parallel_size
        if n > 1:
            gather = (f"; expert parallelism {n} (AutoEP): {s.experts // n} experts of each layer "
                      f"per rank, a token's hidden state sent to its experts' ranks and back "
                      f"(all-to-all), " + (f"ZeRO-3 gathers a layer's {s.experts // n} experts "
                      f"over {world // n} ranks ({2 * s.layer_expert_params / n / GiB:.2f} "
                      "GiB of 16-bit weights)" if rp.zero_stage == 3 and world > n else
                      "no expert weight gathered"))
        notes.append(f"{role}: mixture of experts, {s.experts} experts x {s.moe_layers} layers, "
                     f"top-{s.top_k}: {_params(s.params)} params held and (if trained) trained, "
                     f"{_params(s.active_params)} active per token (compute per token: "
                     f"{s.active_params / s.params:.1%} of a dense model of this size){gather}")
    pol = roles.get("policy")
    if cfg.ppo.router_replay and pol is not None and pol.shape is not None and pol.shape.experts:
        s = pol.shape
        n = cfg.ppo.rollout_batch_size * cfg.ppo.samples_per_prompt
        per_token = 2 * s.moe_layers * s.top_k  # int16 per layer and choice
        notes.append(f"ppo.router_replay: the recorded expert choices take {per_token} bytes per "
                     f"token on the device (int16 x {s.moe_layers} layers x top-{s.top_k}), "
                     f"{per_token * (cfg.data.max_prompt_len + cfg.generation.max_new_tokens) / 2**20:.2f}"
                     f" MiB per sequence of the longest length; {n} sequences per rollout "
                     "over all ranks")
    return notes


def ema_bytes_per_rank(params: int, world_size: int, zero_stage: int) -> int:
    """policy.ema_decay (engine/ema.py): a float32 EMA of each rank's own partition, 4 bytes per
    parameter divided by the ZeRO-3 group; without ZeRO-3 every rank holds the whole."""
    return 4 * params // (world_size if zero_stage == 3 else 1)


def _with_ema(states: ModelStates, params: int, cluster: Cluster, d) -> ModelStates:
    """The policy's states plus its EMA: on the GPU beside its partitions, or with
    offload_param (the partitions on CPU) in each node's CPU memory."""
    per_rank = ema_bytes_per_rank(params, cluster.world_size, d.zero_stage)
    if d.offload_param and d.zero_stage == 3:
        return replace(states, cpu_bytes_per_node=states.cpu_bytes_per_node
                       + per_rank * cluster.gpus_per_node)
    return replace(states, gpu_bytes_per_rank=states.gpu_bytes_per_rank + per_rank)


def _forward_gather(rp: RolePlan) -> int:
    """A forward-only pass gathers 16-bit weights: 2 bytes per param of the largest layer."""
    return 2 * rp.shape.largest_layer_params if rp.zero_stage == 3 else 0


def choose_zero_stages(cfg: Config, cluster: Cluster, shapes: RoleShapes | None = None,
                       load_universal: bool = False) -> StageChoice:
    """Each role's ZeRO stage on `cluster`, `auto` chosen by fit on this plan's peaks
    (plan/stages.py); a run calls it at start-up (plan/fit.py's zero_stages) with its
    GPU's memory (`gpu_mem_bytes` None on CPU). `shapes`: read from the config when None."""
    if shapes is None and cluster.gpu_mem_bytes is not None:
        from ds_ppo.plan.shapes import resolve_shapes

        try:
            shapes = resolve_shapes(cfg)
        except ConfigError:  # e.g. a hub name not yet downloaded: the world-size rule
            shapes = None
    peak = None if shapes is None else (
        lambda stages: compute_plan(cfg, shapes, cluster, stages=stages,
                                    notes=False).peak_gpu_bytes)
    return resolve_stages(cfg, cluster, peak, load_universal)


def compute_plan(cfg: Config, shapes: RoleShapes, cluster: Cluster,
                 stages: dict[str, int] | None = None, notes: bool = True) -> Plan:
    """Model states per role and the peak per GPU over generation, scoring and training.
    `stages`: each role's ZeRO stage (None: as the engine chooses them, plan/stages.py);
    `notes`: False leaves out the notes (and the validation they run), for the searches that
    only read the peak."""
    stage_choice = None
    if stages is None:
        stage_choice = choose_zero_stages(cfg, cluster, shapes)
        stages = stage_choice.stages
    trainers = training_cluster(cfg, cluster)
    split = trainers is not cluster
    # a critic-free estimator (ppo.advantage_estimator) builds no value model: no value role
    # (nor a teacher without distillation, nor a reference when the KL is off under it)
    roles = {r: _role_plan(cfg, r, shapes.shapes[r], trainers,
                           stages.get(r, getattr(cfg.deepspeed, r).stage(trainers.world_size)))
             for r in ROLES
             if (r != "value" or cfg.ppo.uses_critic) and (r != "teacher" or cfg.teacher.enabled)
             and (r != "reference" or uses_reference(cfg))}
    resident = sum(rp.states.resident_bytes for rp in roles.values())
    rows = _rows(cfg)
    gen_batch = _generation_batch(cfg, trainers)
    choice, generation = _generation_phase(cfg, shapes, trainers, roles["policy"], rows,
                                           gen_batch, 0 if split else resident)
    scoring, training = _scoring_phases(cfg, roles, rows), _training_phases(cfg, roles, rows)
    kept = _lora_base_copy(cfg, shapes.shapes["policy"])
    if split:  # the generation ranks decode; the training ranks score and train
        generation = _split_generation_phase(generation, roles["policy"], kept)
    elif cfg.ppo.max_lag > 0:  # the worker decodes beside them
        scoring, training = (_beside_worker(phases, generation, kept)
                             for phases in (scoring, training))
    phases = [generation, *scoring, *training]
    peak = max(phases, key=lambda p: p.total(resident))
    # CPU: the training ranks' nodes (a generation rank holds no optimizer state on CPU)
    cpu = sum(rp.states.cpu_bytes_per_node for rp in roles.values())
    return Plan(
        cluster=cluster, roles=roles, seq_prompt=rows.prompt, seq_response=rows.response,
        micro_batch=rows.micro, score_micro_batch=rows.score_micro,
        micro_batch_tokens=rows.budget, gen_batch=gen_batch,
        generation_mode="gathered" if split else choice.mode,
        generation_loop=choice.loop, tp_size=choice.tp_size, tp_unsupported=choice.tp_unsupported,
        resident_bytes=resident, phases=phases, peak_gpu_bytes=peak.total(resident),
        peak_phase=peak.name, cpu_bytes_per_node=cpu,
        fits_gpu=peak.total(resident) <= cluster.gpu_mem_bytes,
        fits_cpu=None if cluster.cpu_mem_bytes is None else cpu <= cluster.cpu_mem_bytes,
        notes=_notes(cfg, shapes, cluster, roles, rows) if notes else [],
        stage_choice=stage_choice, placement=cfg.ppo.placement,
        generation_ranks=cluster.world_size - trainers.world_size, training_cluster=trainers)


@dataclass(frozen=True)
class _Rows:
    """The rows an iteration's forwards see: lengths in tokens, micro-batches, packing and
    sequence parallelism."""

    prompt: int
    response: int
    prefill: int  # tokens one generate call prefills (a later turn: the episode so far)
    micro: int
    score_micro: int
    budget: int | None  # ppo.micro_batch_tokens
    sp: int  # deepspeed.sequence_parallel_size
    sharded: bool  # rows split over the sequence-parallel group
    tiled_logits: str | bool  # ppo.tiled_logits: auto, true or false
    logits_tile_tokens: int

    @property
    def seq(self) -> int:
        return self.prompt + self.response

    def micro_shape(self, rows: int, tokens: int) -> tuple[int, int]:
        """(tokens, sequences) on one rank in one policy/reference/value forward: `rows` rows of
        `tokens`, or packed, one sequence of at most the budget (a longer row alone); a row
        split across the sequence-parallel group, its 1/sp share, one row at a time."""
        if self.sharded:
            return -(-tokens // self.sp), 1
        return (tokens, rows) if self.budget is None else (max(self.budget, tokens), 1)

    def logits(self, shape: ModelShape, tokens: int, rows: int) -> tuple[str, int]:
        """The logits term of a policy/reference forward, tiled as forward.tile_logits decides."""
        if tile_logits(self.tiled_logits, tokens * rows, shape.vocab):
            tile = min(self.logits_tile_tokens, tokens * rows)
            return f"logits (tiled, {tile} positions)", tiled_logits_bytes(shape, tile)
        return "logits", logits_bytes(shape, tokens, rows)


def _rows(cfg: Config) -> _Rows:
    """The config's rows: prompt + response lengths, micro-batches, sequence parallelism."""
    # a multi-turn episode's response holds every turn and observation (env.max_total_tokens),
    # and a later turn re-prefills the prompt and the episode so far
    prompt, response = cfg.data.max_prompt_len, max_response_tokens(cfg)
    seq = prompt + response
    prefill = seq - cfg.generation.max_new_tokens if cfg.env.enabled else prompt
    micro = cfg.ppo.micro_batch_size
    sp = cfg.deepspeed.sequence_parallel_size
    return _Rows(prompt=prompt, response=response, prefill=prefill, micro=micro,
                 score_micro=cfg.ppo.score_micro_batch_size or micro,
                 budget=cfg.ppo.micro_batch_tokens, sp=sp,
                 sharded=sp > 1 and seq >= cfg.deepspeed.sequence_parallel_min_tokens,
                 tiled_logits=cfg.ppo.tiled_logits,
                 logits_tile_tokens=cfg.ppo.logits_tile_tokens)


def _generation_batch(cfg: Config, cluster: Cluster) -> int:
    """Rows a rank decodes at once."""
    sp = cfg.deepspeed.sequence_parallel_size
    # a rank's responses: its prompts x ppo.samples_per_prompt (the ranks of a
    # sequence-parallel group share theirs)
    per_rank = max(1, math.ceil(cfg.ppo.rollout_batch_size * cfg.ppo.samples_per_prompt
                                / (cluster.world_size // max(1, min(sp, cluster.world_size)))))
    # a rank decodes at most its own responses at once (a tensor-parallel group: tp x that)
    return min(cfg.generation.batch_size or per_rank, per_rank)


def _generation_phase(cfg: Config, shapes: RoleShapes, cluster: Cluster, pol: RolePlan,
                      rows: _Rows, gen_batch: int, resident: int):
    """(the engine's generation choice, the generation phase): the policy decodes gen_batch
    prompts with a KV cache."""
    ps = pol.shape
    replica = 2 * ps.params
    # the engine's decision (engine/generation/choice.py), on the free memory of this plan
    choice = choose_generation(
        cfg.generation, shapes.policy_config, cfg.generation.tp_size or cluster.gpus_per_node,
        replica_bytes=lambda n: 2 * tp_shard_params(ps, n),
        free_bytes=lambda: cluster.gpu_mem_bytes - resident - RUNTIME_OVERHEAD_BYTES,
        linears=ps.decoder_linears)
    mode, tp = choice.mode, choice.tp_size
    shard = 2 * tp_shard_params(ps, tp)
    gather = _forward_gather(pol)  # 0 unless ZeRO-3 partitions the policy
    if mode == "tensor_parallel" and ps.experts and pol.expert_parallel_size == tp and gather:
        # each rank copies the experts AutoEP gave it (both groups are tp consecutive ranks:
        # the same ranks): a layer's gather holds E / tp experts, not the whole block
        gather = 2 * max(ps.vocab * ps.hidden, ps.layer_expert_params // tp)
    batch, kv_share = gen_batch, 1
    if mode == "gathered":
        gen = {"16-bit policy replica": replica, "layer gather while copying": gather}
    elif mode == "tensor_parallel":  # the group decodes its ranks' prompts together
        batch = min(cfg.generation.batch_size or tp * gen_batch, tp * gen_batch)
        kv_share = kv_shards(ps, tp)
        gen = {f"16-bit policy replica shard (1/{tp} of each layer"
               + (f", {ps.experts // tp} of {ps.experts} experts" if ps.experts else "")
               + ")": shard,
               "layer gather while copying": gather}
    else:
        gen = {"layer gather (ZeRO-3 hooks)": gather}
    gen_common = {
        "KV cache": kv_cache_bytes(ps, rows.seq, batch) // kv_share,
        "prefill activations (one layer)": prefill_activation_bytes(
            ps, rows.prefill, batch, cfg.policy.attn_implementation == "eager",
            tp if mode == "tensor_parallel" else 1),
        "fp32 logits of one step": batch * ps.vocab * 4,
    }
    return choice, Phase(f"generation ({mode})", {**gen, **gen_common})


# the decoding terms of a generation phase, which a background worker's decoding adds to the
# phases it overlaps (ppo.placement = colocated, an off-policy schedule)
_DECODING_TERMS = ("KV cache", "prefill activations (one layer)", "fp32 logits of one step")
WORKER_REPLICA = "generation worker's 16-bit replica"


LORA_BASE_COPY = "LoRA base kept beside the replica"


def _lora_base_copy(cfg: Config, shape: ModelShape | None) -> dict[str, int]:
    """The 16-bit copy of the adapted layers' frozen weights that a LoRA policy's schedule
    replica keeps (the weight syncs after the first merge new adapters into it), or nothing."""
    lora = cfg.policy.lora
    if lora is None or shape is None:
        return {}
    return {LORA_BASE_COPY: 2 * lora_base_params(shape, lora,
                                                 _adapted_head(cfg, "policy", shape))}


def _beside_worker(phases: list[Phase], generation: Phase, kept: dict[str, int]
                   ) -> list[Phase]:
    """`phases` of the training thread with the background worker's replica (resident between
    refreshes, with `kept`: `_lora_base_copy`) and its decoding (running at the same time)
    added to each."""
    worker = {WORKER_REPLICA: sum(v for k, v in generation.transient.items()
                                  if k.startswith("16-bit policy replica")), **kept}
    worker.update({f"worker's {k}": generation.transient[k] for k in _DECODING_TERMS})
    return [replace(ph, transient={**ph.transient, **worker}) for ph in phases]


def _split_generation_phase(generation: Phase, pol: RolePlan, kept: dict[str, int]) -> Phase:
    """The generation ranks' phase under ppo.placement = split: a whole 16-bit replica (no ZeRO
    engine, no layer gather), with `kept` (`_lora_base_copy`), and the decoding of one training
    rank's rows at a time."""
    terms = {"16-bit policy replica": 2 * pol.shape.params, **kept}
    terms.update({k: generation.transient[k] for k in _DECODING_TERMS})
    return Phase("generation ranks (split)", terms, generation_ranks=True)


def _scoring_phases(cfg: Config, roles: dict[str, RolePlan], rows: _Rows) -> list[Phase]:
    """One forward per model role over the rollout, score_micro sequences at a time."""
    phases, seq, score_micro = [], rows.seq, rows.score_micro
    for role in ("reference", "teacher", "policy", "value", "reward"):
        rp = roles.get(role)
        if rp is None or rp.shape is None:
            continue
        # the reward model keeps row micro-batches (score_micro_batch_size)
        tokens, seqs = ((min(seq, cfg.reward.max_len), score_micro) if role == "reward"
                        else rows.micro_shape(score_micro, seq))
        eager = (cfg.policy.attn_implementation if role in ("policy", "reference", "teacher")
                 else cfg.value.attn_implementation if role == "value"
                 else "sdpa") == "eager"
        t = {"layer gather": _forward_gather(rp),
             "activations (one layer)": layer_activation_bytes(rp.shape, tokens, seqs, eager)}
        if role in ("policy", "reference", "teacher"):
            name, size = rows.logits(rp.shape, tokens, seqs)
            t[name] = size
        phases.append(Phase(f"scoring: {role}", t))
    return phases


def _training_phases(cfg: Config, roles: dict[str, RolePlan], rows: _Rows) -> list[Phase]:
    """Forward + backward of one micro-batch of each trained role."""
    phases = []
    for role in (r for r in TRAINED_ROLES if r in roles):
        rp, section = roles[role], getattr(cfg, role)
        gather = rp.states.gather_bytes
        tokens, seqs = rows.micro_shape(rows.micro, rows.seq)
        t = {"layer gather (weights + grads)": gather,
             "activations" + (" (checkpointed)" if section.gradient_checkpointing else ""):
                 train_activation_bytes(rp.shape, tokens, seqs, section.gradient_checkpointing,
                                        section.attn_implementation == "eager")}
        a2a = expert_all_to_all_bytes(rp.shape, rp.expert_parallel_size, tokens * seqs)
        if a2a:
            t["expert all-to-all (one layer)"] = a2a
        if role == "policy":
            name, size = rows.logits(rp.shape, tokens, seqs)
            t[name] = size
        phases.append(Phase(f"training: {role}", t))
    return phases


def _notes(cfg: Config, shapes: RoleShapes, cluster: Cluster, roles: dict[str, RolePlan],
           rows: _Rows) -> list[str]:
    """What the plan assumes or leaves out, and whether the config validates."""
    sp, seq, sharded = rows.sp, rows.seq, rows.sharded
    notes = list(shapes.notes)
    for role in roles:
        dtype = getattr(cfg, role).dtype if role in TRAINED_ROLES else cfg.policy.dtype
        if dtype == "fp32" and roles[role].shape is not None:
            notes.append(f"{role} dtype fp32: the plan assumes 16-bit weights and activations; "
                         "fp32 roughly doubles both")
            break
    if sp > 1:
        notes.append(f"deepspeed.sequence_parallel_size = {sp}: " + (
            f"rows of {seq} tokens are split over {sp} ranks ({-(-seq // sp)} tokens each, "
            f"one row per forward); data-parallel group {cluster.world_size // sp}"
            if sharded else f"rows of {seq} tokens stay whole (below "
            f"deepspeed.sequence_parallel_min_tokens = "
            f"{cfg.deepspeed.sequence_parallel_min_tokens})"))
    notes += _moe_notes(cfg, roles, cluster.world_size)
    if "value" not in roles:
        notes.append(f"ppo.advantage_estimator = {cfg.ppo.advantage_estimator}: critic-free, "
                     "no value model (no weights, gradients or optimizer state for it)")
    for role in (r for r in TRAINED_ROLES if r in roles):
        lora, shape = getattr(cfg, role).lora, roles[role].shape
        if lora is not None:
            head = _adapted_head(cfg, role, shape)
            n = lora_params(shape, lora, head)
            notes.append(f"{role}.lora r={lora.r} on {lora.target_modules}"
                         f"{' and the output head' if head else ''}: {_params(n)} adapter "
                         f"params ({100 * n / shape.params:.2f}%) with grads and optimizer "
                         "state; the base is frozen 16-bit weights")
    if cfg.policy.ema_decay is not None:
        pol = roles["policy"]
        ema = ema_bytes_per_rank(pol.shape.params, cluster.world_size, pol.zero_stage)
        notes.append(f"policy.ema_decay: the policy's float32 EMA, {ema / GiB:.2f} GiB per rank "
                     f"({'each rank its ZeRO-3 partition' if pol.zero_stage == 3 else 'whole'}"
                     f"; {'in CPU memory' if pol.offload_param and pol.zero_stage == 3 else 'on the GPU'}"
                     "), counted in the policy's model states")
    if not uses_reference(cfg):
        notes.append(f"ppo.advantage_estimator = {cfg.ppo.advantage_estimator} with "
                     "ppo.kl_loss_coef 0: no reference model (no KL toward it)")
    elif reference_from_policy_base(cfg):
        notes.append("reference: the policy's base with its adapters off (no reference role; "
                     "its scoring forward costs what the policy's does)")
    for role in (r for r in TRAINED_ROLES if r in roles):
        d = getattr(cfg.deepspeed, role)
        if d.offload_param and not d.offload_optimizer:
            notes.append(f"deepspeed.{role}: offload_param without offload_optimizer keeps the "
                         "optimizer state on the GPU")
    zero3 = [r for r, rp in roles.items() if rp.zero_stage == 3 and rp.shape is not None]
    if zero3:
        notes.append("ZeRO-3 speed knobs (" + ", ".join(zero3) + "): deepspeed.<role>.zero3."
                     "persistence_threshold (parameters below it stay whole: no gathers; 1e9 on "
                     "one GPU keeps all), prefetch_bucket_size, max_live_parameters, "
                     "max_reuse_distance trade GPU memory for fewer gathers; measured in "
                     "docs/PERFORMANCE.md")
    try:
        validate(cfg, cluster.world_size)
    except ConfigError as e:
        notes.append(f"the config does not validate for world size {cluster.world_size}: "
                     + str(e).replace("invalid config:\n  ", "").replace("\n  ", "; "))
    return notes
