"""Mixture-of-experts models: their routers, the auxiliary load-balancing loss, and the expert
choices recorded by the sampler and replayed by the trainer (`ppo.router_replay`).

A router here is the top-k gate of a sparse MoE block as transformers 5 writes it (Qwen3-MoE's
`Qwen3MoeTopKRouter`, Mixtral's `MixtralTopKRouter`, ...): a module with `top_k`, `num_experts`
and a `(E, H)` weight whose forward takes the block's (N, H) tokens, flattened row-major from
(B, L), and returns (router logits (N, E), top-k weights (N, k), top-k expert indices (N, k)).

`RouterTap` sits on each router as a forward hook (installed once per model, `tap`):

- capture: in a training forward, the router logits of every layer, for the auxiliary loss
  (`aux_loss`), over the forward's real tokens (the attention mask the decoder got);
- record: the expert indices of the last forward (the decoding loop reads them, Slots);
- replay: expert indices given per token and layer (-1 = route as the router does) replace
  the router's choice; the weights stay differentiable: the router's softmax at the chosen
  experts, renormalised as the router renormalises (R3, Ma et al. 2025, "Stabilizing MoE RL by
  aligning training and inference routers"). The tap counts the tokens whose own choice
  differed from the replayed one (`flips`).

Replayed routes (`RouterTap.routes`) stay set until the next forward of the model sets its own
(`forward.response_logprobs` sets them for every forward), so the recomputation of a
gradient-checkpointed layer in backward routes as its forward did.

Expert parallelism (`deepspeed.<role>.expert_parallel_size`, DeepSpeed AutoEP) replaces each
sparse MoE block by an `AutoEPMoELayer`: its router (`TokenChoiceTopKRouter`: a `gate` linear,
forward (N, H) -> (top-k weights (N, k) fp32, top-k indices (N, k), tokens per expert (E,)))
is tapped the same way (`_ep_hook`), and its experts, each rank holding E / N of them as
`w1`/`w3`/`w2`, are gathered back into the Hugging Face layout for a generation replica or an
export (`ep_weights`); a checkpoint saved without expert parallelism goes the other way, into
AutoEP's names and layout (`autoep_tensors`).
"""
from __future__ import annotations

import torch

ROUTE_DTYPE = torch.int16  # expert indices as stored in a Rollout (-1: not recorded)


def _router_weight(m: torch.nn.Module) -> torch.Tensor | None:
    """A router's (E, H) weight: its own (transformers), or its `gate` linear's (AutoEP)."""
    w = getattr(m, "weight", None)
    if w is None and isinstance(getattr(m, "gate", None), torch.nn.Linear):
        w = m.gate.weight
    return w if isinstance(w, torch.Tensor) else None


def is_ep_router(m: torch.nn.Module) -> bool:
    """An AutoEP layer's router (its logits come from its `gate` linear)."""
    return getattr(m, "weight", None) is None and _router_weight(m) is not None


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Router") and hasattr(m, "top_k")
            and hasattr(m, "num_experts") and _router_weight(m) is not None]


def moe_blocks(model: torch.nn.Module) -> list[type]:
    """The classes of the model's sparse MoE blocks (a module with a router `gate` and an
    `experts` module): ZeRO-3's leaf modules (`dist.set_leaf_modules`)."""
    kinds = []
    for m in model.modules():
        gate = getattr(m, "gate", None)
        if gate is not None and hasattr(m, "experts") and type(gate).__name__.endswith("Router"):
            if type(m) not in kinds:
                kinds.append(type(m))
    return kinds


def is_moe_config(config) -> bool:
    """Whether a Hugging Face config describes a mixture-of-experts model (it names experts
    per token)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "num_experts_per_tok", 0)) and bool(
        getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0)
        or getattr(text, "n_routed_experts", 0))


def aux_coef(config, setting: float | None) -> float:
    """The auxiliary loss's coefficient: `setting` (a role's moe_aux_loss_coef), else the
    model config's router_aux_loss_coef (0 if it has none)."""
    if setting is not None:
        return float(setting)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6), as
    transformers' `load_balancing_loss_func` computes it: E x sum_e f_e P_e, where over the
    counted tokens of all layers f_e is the share of top-k assignments that go to expert e and
    P_e the mean router probability of e. router_logits: one (N, E) tensor per layer;
    token_mask: (N,) bool or float, the tokens that count (None: all). A scalar (fp32)."""
    E = router_logits[0].shape[-1]
    device = router_logits[0].device
    w = (torch.ones(router_logits[0].shape[0], device=device) if token_mask is None
         else token_mask.reshape(-1).to(device=device, dtype=torch.float32))
    counts = torch.zeros(E, dtype=torch.float32, device=device)
    probs = torch.zeros(E, dtype=torch.float32, device=device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices  # (N, k)
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p * w[:, None]).sum(dim=0)
    rows = w.sum() * len(router_logits)
    return E * torch.sum((counts / rows) * (probs / rows))


def replayed_weights(logits: torch.Tensor, chosen: torch.Tensor, normalise: bool,
                     dtype: torch.dtype) -> torch.Tensor:
    """(N, k) gate weights of the experts `chosen` (N, k) from router `logits` (N, E): the
    softmax's probabilities at those experts (renormalised over them with `normalise`), as a
    top-k router computes them for its own choice; differentiable in `logits`."""
    top = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
    if normalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


class RouterTap:
    """The forward hooks on a model's routers (module docstring). `layers` routers, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self.layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.num_experts = int(self.routers[0].num_experts) if self.routers else 0
        self.captured: list[torch.Tensor] = []  # this forward's router logits (training)
        self.token_mask: torch.Tensor | None = None  # (N,) the forward's real tokens
        self.record = False  # keep each layer's indices of the last forward in `seen`
        self.seen: list[torch.Tensor | None] = [None] * self.layers
        self.routes: torch.Tensor | None = None  # (N, layers, k) long, recorded (-1: none)
        self.replay = False  # route as `routes` says (else only count the flips)
        self.flips: torch.Tensor | None = None  # (tokens flipped, tokens compared), device
        self._any: torch.Tensor | None = None  # this forward's flipped tokens so far
        self._gate_logits: list[torch.Tensor | None] = [None] * self.layers  # AutoEP routers
        for layer, router in enumerate(self.routers):
            if is_ep_router(router):
                router.gate.register_forward_hook(self._gate_hook(layer))
                router.register_forward_hook(self._ep_hook(layer))
            else:
                router.register_forward_hook(self._hook(layer))

    def start_forward(self, attention_mask) -> None:
        """Called by the decoder's pre-hook: a new forward (its real tokens from a 2D mask;
        a 4D or no mask: every token is real)."""
        self.captured = []
        am = attention_mask
        self.token_mask = am.reshape(-1).bool() if am is not None and am.dim() == 2 else None

    def _gate_hook(self, layer: int):
        def hook(_module, _inputs, logits):
            self._gate_logits[layer] = logits
        return hook

    def _ep_hook(self, layer: int):
        """An AutoEP router's hook: the transformers router's (`_hook`) on its outputs, the
        logits taken from its gate; a replayed route's weights as the router computes its own
        (softmax at the chosen experts, renormalised with route_norm, times route_scale)."""
        inner = self._hook(layer)

        def hook(module, inputs, out):
            weights, chosen, _counts = out
            logits, self._gate_logits[layer] = self._gate_logits[layer], None
            new = inner(module, inputs, (logits, weights, chosen))
            if new is None:
                return None
            _, _, new_chosen = new
            top = torch.softmax(logits.float(), dim=-1).gather(1, new_chosen)
            if module.route_norm:
                top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
            counts = torch.zeros(module.num_experts, dtype=torch.int32, device=chosen.device)
            counts.scatter_add_(0, new_chosen.reshape(-1),
                                torch.ones(new_chosen.numel(), dtype=torch.int32,
                                           device=chosen.device))
            return top * module.route_scale, new_chosen, counts
        return hook

    def _hook(self, layer: int):
        def hook(module, _inputs, out):
            logits, weights, chosen = out
            if self.record:
                self.seen[layer] = chosen
            if module.training and torch.is_grad_enabled():
                self.captured.append(logits)
            if self.routes is None:
                return None
            given = self.routes[:, layer].to(chosen.device)
            if given.shape != chosen.shape:
                raise RuntimeError(f"router replay: routes for {given.shape[0]} tokens, the "
                                   f"forward has {chosen.shape[0]}")
            use = given >= 0  # (N, k): a token with no recorded route keeps its own
            new = torch.where(use, given, chosen)
            with torch.no_grad():  # device counts: no host read per layer
                row = use.all(dim=-1)
                own, rep = chosen.sort(dim=-1).values, new.sort(dim=-1).values
                flipped = (own != rep).any(dim=-1) & row
                self._any = flipped if layer == 0 or self._any is None else self._any | flipped
                if layer == self.layers - 1:  # a token flipped in any layer counts once
                    counts = torch.stack([self._any.sum(), row.sum()]).double()
                    self.flips = counts if self.flips is None else self.flips + counts.to(
                        self.flips.device)
            if not self.replay:
                return None
            return logits, replayed_weights(logits, new, getattr(module, "norm_topk_prob", True),
                                            weights.dtype), new
        return hook

    def take_aux(self) -> torch.Tensor | None:
        """The load-balancing loss of the last training forward (None: nothing captured), and
        forget its logits."""
        logits, self.captured = self.captured, []
        if not logits:
            return None
        return load_balancing_loss(logits, self.top_k, self.token_mask)

    def take_flips(self) -> tuple[float, float]:
        """(tokens whose own routing differed from the recorded one in some layer, tokens with
        a recorded route) over the forwards since the last call, host values."""
        counts, self.flips = self.flips, None
        return (0.0, 0.0) if counts is None else tuple(counts.tolist())


def tap(model: torch.nn.Module | None) -> RouterTap | None:
    """The model's RouterTap (installed on the first call), None for a dense model. `model`: the
    HF model (the decoder gets a pre-hook so every forward resets the capture)."""
    if model is None:
        return None
    found = model.__dict__.get("_ds_ppo_router_tap")
    if found is not None:
        return found
    if not routers(model):
        return None
    t = RouterTap(model)
    model.__dict__["_ds_ppo_router_tap"] = t
    decoder = _decoder(model)
    decoder.register_forward_pre_hook(
        lambda _m, args, kwargs: t.start_forward(kwargs.get("attention_mask")),
        with_kwargs=True)
    return t


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (the module whose forward every causal LM, classifier and scorer
    calls with the attention mask)."""
    base = getattr(model, "get_base_model", None)
    model = base() if callable(base) else model
    get = getattr(model, "get_decoder", None)
    if callable(get):
        return get()
    prefix = getattr(model, "base_model_prefix", None)
    if prefix:
        return getattr(model, prefix)
    return _decoder(model.model)  # a wrapper around the HF model (forward.LastTokenScorer)


def forward_routes(prompt_routes: torch.Tensor, response_routes: torch.Tensor,
                   keep: torch.Tensor | None = None, lead: int = 0,
                   width: int | None = None) -> torch.Tensor:
    """The routes of a forward's tokens, (N, layers, k) long, flattened as the routers see
    them: from (B, P, layers, k) and (B, T, layers, k), either the padded layout
    (`Rollout.model_inputs`: prompt columns from `lead`, the first `width` response columns)
    or, given `keep` (B, P+T) bool, the packed one (the kept tokens, row-major)."""
    if keep is not None:
        both = torch.cat([prompt_routes, response_routes], dim=1)
        return both[keep].long()
    resp = response_routes if width is None else response_routes[:, :width]
    both = torch.cat([prompt_routes[:, lead:], resp], dim=1)
    return both.reshape(-1, *both.shape[2:]).long()


# ------------------------------------------------------------------ expert parallelism (AutoEP)
def autoep_compat() -> None:
    """Let DeepSpeed AutoEP (0.19.8) read transformers' output-recorder registry: it calls
    `_CAN_RECORD_REGISTRY.get(class_name, default)` as on a dict, and transformers 5.25's
    `_CanRecordRegistry.get(model)` takes a model and no default, so every engine start with
    expert parallelism fails with "get() takes 2 positional arguments but 3 were given". A string
    key (AutoEP's) then reads the dict as a dict; transformers' own calls are unchanged. Applied
    only where the installed registry's `get` lacks the default (a fixed release needs none)."""
    import inspect

    try:
        from transformers.utils import output_capturing as oc
    except ImportError:
        return
    registry = getattr(oc, "_CanRecordRegistry", None)
    if registry is None or getattr(registry.get, "_ds_ppo_compat", False):
        return
    if len(inspect.signature(registry.get).parameters) > 2:
        return
    plain = registry.get

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else plain(self, key)
    get._ds_ppo_compat = True
    registry.get = get


def ep_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's AutoEP layers by module name (empty without expert parallelism)."""
    return {name: m for name, m in model.named_modules() if getattr(m, "_is_autoep_layer", False)}


def ep_size(model: torch.nn.Module) -> int:
    """The expert-parallel size a model's AutoEP layers run at (1: no expert parallelism)."""
    return max((layer.ep_size for layer in ep_layers(model).values()), default=1)


def ep_weights(prefix: str, layer: torch.nn.Module):
    """(name in the Hugging Face model, parameters to gather, the full tensor once gathered) of
    an AutoEP layer named `prefix`, in the layout of the Qwen3-MoE / Mixtral block it replaced:
    `gate.weight` (E, H) and the fused `experts.gate_up_proj` (E, 2F, H) (gate rows, then up)
    and `experts.down_proj` (E, H, F). The experts' tensors are collected from the layer's
    expert-parallel group (rank r holds experts [r E/N, (r+1) E/N)): their `full()` is a
    collective every rank of the group must call (it carries `collective = True`, the full
    `shape`, `local()` this rank's experts and `ep_ranks` the group's global ranks in order,
    None at N = 1)."""
    ex = layer.experts

    def gathered(local: torch.Tensor) -> torch.Tensor:
        if layer.ep_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(layer.ep_size)]
        tdist.all_gather(parts, local.contiguous(), group=layer.ep_group)
        return torch.cat(parts, dim=0)

    import torch.distributed as tdist

    ranks = tuple(tdist.get_process_group_ranks(layer.ep_group)) if layer.ep_size > 1 else None

    def full_of(make, shape):
        def full() -> torch.Tensor:
            return gathered(make())
        full.collective, full.shape = True, shape
        full.local, full.ep_ranks = make, ranks  # this rank's experts, the group holding all
        return full

    E = layer.num_experts
    w1_shape = tuple(getattr(ex.w1, "ds_shape", ex.w1.shape))
    w2_shape = tuple(getattr(ex.w2, "ds_shape", ex.w2.shape))
    yield (f"{prefix}.gate.weight", [layer.router.gate.weight],
           lambda: layer.router.gate.weight.data)
    yield (f"{prefix}.experts.gate_up_proj", [ex.w1, ex.w3],
           full_of(lambda: torch.cat([ex.w1.data, ex.w3.data], dim=1),
                   (E, 2 * w1_shape[1], w1_shape[2])))
    yield (f"{prefix}.experts.down_proj", [ex.w2],
           full_of(lambda: ex.w2.data, (E, *w2_shape[1:])))


def autoep_tensors(name: str, full: torch.Tensor, shapes: dict[str, tuple[int, ...]]
                   ) -> list[tuple[str, torch.Tensor]] | None:
    """A Hugging Face parameter (or one of its optimizer states) of a Qwen3-MoE / Mixtral block
    as AutoEP's layer holds it, the inverse of `ep_weights`: router `P.gate.weight` ->
    `P.router.gate.weight`; fused `P.experts.gate_up_proj` (E, 2F, H) -> `P.experts.w1` (its gate
    rows, (E, F, H)) and `P.experts.w3` (its up rows); `P.experts.down_proj` (E, H, F) ->
    `P.experts.w2`. `full`: the whole tensor, any shape with the right number of elements (a
    universal checkpoint stores ZeRO-3 parameters flat); `shapes`: every parameter's shape by
    name (which blocks have experts). None: a parameter AutoEP keeps under its own name."""
    prefix, _, leaf = name.rpartition(".experts.")
    if prefix and leaf in ("gate_up_proj", "down_proj") and "." not in leaf:
        t = full.reshape(shapes[name])
        if leaf == "down_proj":
            return [(f"{prefix}.experts.w2", t.contiguous())]
        f = t.shape[1] // 2
        return [(f"{prefix}.experts.w1", t[:, :f].contiguous()),
                (f"{prefix}.experts.w3", t[:, f:].contiguous())]
    if name.endswith(".gate.weight"):
        prefix = name[:-len(".gate.weight")]
        if f"{prefix}.experts.gate_up_proj" in shapes:
            return [(f"{prefix}.router.gate.weight", full)]
    return None
