"""Mixture-of-experts models in process (engine/moe.py): the load-balancing loss against
transformers', the expert choices our decoding loop records, and router replay in the
training forward (every token's experts are the sampler's; the gate stays differentiable)."""
from __future__ import annotations

import pytest
import torch

from ds_ppo.bench.stand_ins import small_moe

from ds_ppo.algo.masks import response_mask
from ds_ppo.containers import Rollout, concat_rollouts
from ds_ppo.engine import moe
from ds_ppo.engine.forward import response_logprobs
from ds_ppo.engine.generation.loop import decode

PAD, EOS = 0, 1
KINDS = ["qwen3_moe", "mixtral"]


def _prompts(B: int = 6, P: int = 7, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    for b in range(B):  # left padding of varied widths
        mask[b, :b % 4] = False
    return ids.masked_fill(~mask, PAD), mask


def _sampled(sampler, T: int = 8, seed: int = 0) -> Rollout:
    """A rollout sampled by `sampler` through our decoding loop, its routes recorded."""
    ids, mask = _prompts()
    torch.manual_seed(seed)
    out = decode(sampler, ids, mask, max_new_tokens=T, eos_ids=[EOS], pad_id=PAD,
                 temperature=1.0, routes=True)
    keep = response_mask(out.response_ids, [EOS])
    B = ids.shape[0]
    return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=out.response_ids.masked_fill(
        ~keep, PAD), mask=keep, ended=torch.ones(B, dtype=torch.bool), prompts=[""] * B,
        responses=[""] * B, prompt_lens=mask.sum(1).tolist(),
        response_lens=keep.sum(1).tolist(), extras=[{}] * B,
        rollout_logprobs=out.logprobs.masked_fill(~keep, 0.0),
        prompt_routes=out.prompt_routes, response_routes=out.response_routes)


def _experts_inputs(model):
    """A list that receives each MoE layer's (N, k) expert indices as the experts get them."""
    seen = []
    for m in model.modules():
        if hasattr(m, "experts") and hasattr(m, "gate"):
            m.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_load_balancing_loss_equals_transformers(kind):
    import importlib

    hf = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, 4, generator=g) for _ in range(3))
    am = torch.ones(3, 4, dtype=torch.long)
    am[0, :2] = 0
    for mask in (None, am):
        ours = moe.load_balancing_loss(list(logits), 2, None if mask is None else mask.reshape(-1))
        theirs = hf.load_balancing_loss_func(logits, 4, 2, mask)
        assert torch.allclose(ours, theirs.float(), atol=1e-6), (mask, ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_records_each_fed_tokens_experts(kind):
    """The routes our loop records are the experts a plain forward over prompt + response
    chooses for the same tokens (fp32 on CPU), -1 exactly where no token was fed: prompt
    pads, each response's last token, everything after it."""
    model = small_moe(kind)
    r = _sampled(model)
    tap = moe.tap(model)
    assert r.prompt_routes.shape[2:] == (tap.layers, tap.top_k) == (2, 2)
    assert r.prompt_routes.dtype == moe.ROUTE_DTYPE
    seen = _experts_inputs(model)
    ids, am = r.input_ids, r.attention_mask
    with torch.no_grad():
        model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0))
    own = torch.stack(seen, dim=1).view(*ids.shape, tap.layers, tap.top_k)
    recorded = torch.cat([r.prompt_routes, r.response_routes], dim=1).long()
    fed = torch.cat([r.prompt_mask, r.mask], dim=1).clone()
    last = torch.tensor(r.prompt_lens).new_full((len(r),), r.prompt_ids.shape[1]) + \
        torch.tensor(r.response_lens) - 1
    fed[torch.arange(len(r)), last] = False  # the last token is sampled, never fed back
    assert bool((recorded[fed] >= 0).all()) and bool((recorded[~fed] == -1).all())
    assert torch.equal(own[fed].sort(-1).values, recorded[fed].sort(-1).values)


def _perturbed(kind: str, scale: float):
    """The same model with noise of `scale` x its gate weights' std added to every router."""
    sampler = small_moe(kind)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe.routers(sampler):
            router.weight.add_(torch.randn(router.weight.shape, generator=g)
                               * scale * router.weight.std())
    return sampler


def _scored(model, rollout: Rollout, replay, packed: bool = False):
    tap = moe.tap(model)
    tap.take_flips()
    seen = _experts_inputs(model)
    lp, _ = response_logprobs(model, rollout, 1.0, packed=packed, routers=tap, replay=replay)
    for m in model.modules():
        if hasattr(m, "experts") and hasattr(m, "gate"):
            m.experts._forward_pre_hooks.clear()
    return lp, torch.stack(seen, dim=1), tap.take_flips()


@pytest.mark.parametrize("kind", KINDS)
def test_replay_routes_every_token_to_the_samplers_experts(kind):
    """A sampler whose gates carry noise routes some tokens elsewhere than the trainer would.
    Without replay the trainer's experts differ from the sampler's for those tokens; with
    ppo.router_replay every recorded token reaches the sampler's experts (asserted token by
    token, padded and packed layouts), the log-prob gap to the sampler shrinks, and the gate
    still gets a gradient (the softmax at the chosen experts)."""
    trainer, sampler = small_moe(kind), _perturbed(kind, 0.5)
    r = _sampled(sampler)
    recorded = moe.forward_routes(r.prompt_routes, r.response_routes,
                                  keep=torch.cat([r.prompt_mask, r.mask], 1))  # packed order
    lead = r.prompt_ids.shape[1] - max(r.prompt_lens)
    padded = moe.forward_routes(r.prompt_routes, r.response_routes, lead=lead,
                                width=max(r.response_lens))
    with torch.no_grad():
        own_lp, own, own_flips = _scored(trainer, r, replay=False)
        rep_lp, rep, rep_flips = _scored(trainer, r, replay=True)
        packed_lp, packed_rep, _ = _scored(trainer, r, replay=True, packed=True)
    known = padded[:, :, 0] >= 0  # (N, layers)
    assert bool((own[known] != padded[known]).any())  # the noise flips routes
    assert own_flips[0] > 0 and own_flips == rep_flips  # counted either way
    assert torch.equal(rep[known].sort(-1).values, padded[known].sort(-1).values)
    kp = recorded[:, :, 0] >= 0
    assert torch.equal(packed_rep[kp].sort(-1).values, recorded[kp].sort(-1).values)
    assert torch.allclose(packed_lp[r.mask], rep_lp[r.mask], atol=1e-5)
    gap = lambda lp: float((lp - r.rollout_logprobs).abs()[r.mask].mean())  # noqa: E731
    assert gap(rep_lp) < gap(own_lp)
    # differentiable gate weights under replay
    trainer.train()
    lp, _ = response_logprobs(trainer, r, 1.0, routers=moe.tap(trainer), replay=True)
    lp[r.mask].sum().backward()
    assert all(float(router.weight.grad.abs().sum()) > 0 for router in moe.routers(trainer))


def test_identical_models_flip_nothing():
    """Sampler and trainer with the same weights (fp32, CPU): no token flips."""
    model = small_moe("qwen3_moe")
    r = _sampled(model)
    _, _, flips = _scored(model, r, replay=False)
    assert flips[0] == 0 and flips[1] > 0


def test_concat_rollouts_pads_routes_with_minus_one():
    model = small_moe("qwen3_moe")
    a, b = _sampled(model, T=4), _sampled(model, T=8, seed=1)
    b = b.slice(list(range(3)))
    b.prompt_ids, b.prompt_mask = b.prompt_ids[:, 2:], b.prompt_mask[:, 2:]
    b.prompt_routes = b.prompt_routes[:, 2:]
    both = concat_rollouts([a, b], PAD)
    assert both.prompt_routes.shape[:2] == both.prompt_ids.shape
    assert both.response_routes.shape[:2] == both.response_ids.shape
    assert bool((both.prompt_routes[len(a):, :2] == -1).all())
    assert bool((both.response_routes[:len(a), a.response_ids.shape[1]:] == -1).all())


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_export_writes_the_hf_moe_layout(kind, tmp_path, caplog):
    """`hf_writer.save_module` streams a mixture-of-experts model tensor by tensor (no
    whole-model fallback): the fused expert tensors are written one per expert, under the names
    and shapes save_pretrained writes, and the directory loads in plain transformers with the
    same logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from ds_ppo.engine.checkpoint.hf_writer import save_module

    model = small_moe(kind)
    with caplog.at_level("WARNING", logger="ds_ppo"):
        save_module(model, None, tmp_path / "ours", torch.float32)
    assert "save_pretrained" not in caplog.text  # streamed, not the whole-model fallback
    model.save_pretrained(tmp_path / "theirs")
    shapes = {}
    for name in ("ours", "theirs"):
        with safe_open(tmp_path / name / "model.safetensors", "pt") as f:
            shapes[name] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["ours"] == shapes["theirs"]
    assert any(".experts.3." in k for k in shapes["ours"])  # one tensor per expert
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(2, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_replay_and_aux_loss_under_gradient_checkpointing():
    """The replayed routes stay set after the forward, so a checkpointed layer recomputed in
    backward routes as its forward did: the gradients of log-probs plus the load-balancing
    loss equal those without checkpointing (a sampler that routes most tokens elsewhere)."""
    r = _sampled(small_moe("qwen3_moe", seed=5))
    grads = {}
    for checkpointing in (False, True):
        model = small_moe("qwen3_moe").train()
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        tap = moe.tap(model)
        lp, _ = response_logprobs(model, r, 1.0, routers=tap, replay=True)
        flipped, _ = tap.take_flips()
        assert flipped > 0
        (lp[r.mask].sum() + tap.take_aux()).backward()
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        assert torch.allclose(g, grads[True][name], atol=1e-6), name


def test_a_moe_reward_model_behind_the_last_token_scorer_gets_a_tap():
    from transformers import AutoModelForSequenceClassification

    from ds_ppo.engine.forward import LastTokenScorer

    scorer = LastTokenScorer(small_moe("qwen3_moe", cls=AutoModelForSequenceClassification,
                                       num_labels=1, pad_token_id=PAD))
    assert moe.tap(scorer).layers == 2
    ids, mask = _prompts()
    assert scorer(ids, mask.long()).shape == (ids.shape[0],)
