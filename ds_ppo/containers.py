"""Typed containers at the stage boundaries. B = sequences on this rank, P = prompt tokens
(left-padded), T = response tokens (right-padded). Every tensor lives on the rank's device."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ds_ppo.algo import token_budget_batches, turn_token_index
from ds_ppo.algo.distribution import LogitShape


def _slice_fields(obj, idx: slice | list[int]):
    """A copy of a container with every per-sequence field indexed by `idx` (B first): a slice
    or a list of row indices (host values: slicing never reads the device)."""
    rows = range(len(obj))[idx] if isinstance(idx, slice) else idx
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v[idx]
        elif isinstance(v, Rollout):
            out[f.name] = v.slice(idx)
        elif isinstance(v, list):
            out[f.name] = [v[i] for i in rows]
        else:
            out[f.name] = v
    return replace(obj, **out)


def longest_first(lengths: list[int], size: int, rows: list[int] | None = None
                  ) -> list[list[int]]:
    """`rows` (default: all of `lengths`) cut into groups of at most `size`, longest first, ties
    in the given order: a batched forward over rows of similar lengths pads little."""
    rows = list(range(len(lengths))) if rows is None else rows
    ordered = sorted(rows, key=lambda i: -lengths[i])
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def in_row_order(stacked: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Rows computed in `order` (a permutation of range(N), e.g. `longest_first`'s groups one
    after another), put back in row order."""
    if order == list(range(len(order))):
        return stacked
    out = torch.empty_like(stacked)
    out[torch.tensor(order, device=stacked.device)] = stacked
    return out


@dataclass
class Rollout:
    """What leaves generation."""

    prompt_ids: torch.Tensor  # (B, P) long, left-padded with pad
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long, pad after the first EOS (an episode: its end)
    # (B, T) bool, True on response tokens that count (to first EOS incl.): the model's tokens;
    # an episode's (ds_ppo.ppo.episodes) has holes where the environment's observations sit
    mask: torch.Tensor
    ended: torch.Tensor  # (B,) bool, the response ended with EOS/stop (not truncated)
    prompts: list[str]  # B prompt texts
    responses: list[str]  # B decoded responses (special tokens removed)
    # host copies of the row lengths, so a micro-batch's bounds need no device sync
    prompt_lens: list[int]  # B real prompt tokens per row (prompt_mask.sum(1))
    response_lens: list[int]  # B response tokens in the context per row (context.sum(1))
    extras: list[dict]  # B prompts' data.reward_keys values, for the reward function
    # B prompts' chat messages (None for a plain-text prompt), or None when the data has no
    # chats: a reward model with another tokenizer renders them with its own chat template
    messages: list | None = None
    # (B, T) float32: each response token's log-prob under the distribution it was sampled
    # from (generation.loop=own; 0 outside mask), None when HF generate sampled it
    rollout_logprobs: torch.Tensor | None = None
    # the distribution the responses were sampled from (temperature, blocked tokens, top-k,
    # top-p): the trainer's log-probs, entropy and KL shape the logits alike; None: the
    # plain softmax at the temperature the caller gives (e.g. PPO-ptx text rows)
    sampling: LogitShape | None = None
    # multi-turn episodes (None: one response per prompt, every response token counts)
    context_mask: torch.Tensor | None = None  # (B, T) bool, True on model and observation tokens
    model_lens: list[int] | None = None  # B model tokens per row (mask.sum(1)), host values
    turn_rewards: torch.Tensor | None = None  # (B, T) float32, each turn's environment reward
    # at its last model token, 0 elsewhere
    transcripts: list | None = None  # B episodes' turns: {turn, model, reward, observation}
    # (B, T) bool, True on the first token of each model turn (None: one turn from column 0)
    turn_starts: torch.Tensor | None = None
    # a mixture-of-experts policy's expert choices where the sampler routed each token (our
    # decoding loop; None: a dense policy or HF generate): int16 top-k expert indices per MoE
    # layer, -1 where no route was recorded (pads; the last response token, never fed back)
    prompt_routes: torch.Tensor | None = None  # (B, P, layers, k)
    response_routes: torch.Tensor | None = None  # (B, T, layers, k)
    # (B, T) int32: the policy version (optimizer updates applied) whose weights sampled each
    # counted token, -1 elsewhere (pads, an episode's observations); None: not recorded
    token_versions: torch.Tensor | None = None

    @property
    def context(self) -> torch.Tensor:  # (B, T) bool
        """The response tokens the model reads: every counted token, and an episode's
        observations (which are not counted: no loss, no KL, no reward)."""
        return self.mask if self.context_mask is None else self.context_mask

    def new_token_index(self) -> torch.Tensor:
        """(B, T) long: how many tokens of its model turn precede each response token (the
        sampler's token index, which generation.min_new_tokens compares)."""
        B, T = self.response_ids.shape
        if self.turn_starts is None:
            return torch.arange(T, device=self.response_ids.device).expand(B, T)
        return turn_token_index(self.turn_starts)

    @property
    def counted_lens(self) -> list[int]:
        """B counted (model) tokens per row, host values: what losses and their divisors count."""
        return self.response_lens if self.model_lens is None else self.model_lens

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P+T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P+T) long
        return torch.cat([self.prompt_mask, self.context], dim=1).long()

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input_ids (B, P'+T'), attention_mask (B, P'+T') long, T') without the columns no
        counted token needs: the leading pads every row's prompt has (P' = longest prompt)
        and the response columns after every row's last counted token (T' = longest counted
        response). Positions count real tokens only, so the model's outputs for the kept
        tokens are those of the full width; a micro-batch of short rows costs short forwards."""
        lead = self.prompt_ids.shape[1] - max(self.prompt_lens, default=0)
        keep = max(self.response_lens, default=0)
        ids = torch.cat([self.prompt_ids[:, lead:], self.response_ids[:, :keep]], dim=1)
        am = torch.cat([self.prompt_mask[:, lead:], self.context[:, :keep]], dim=1).long()
        return ids, am, keep

    @property
    def row_lens(self) -> list[int]:
        """Each row's real tokens, prompt + response (observations included; host values)."""
        return [p + r for p, r in zip(self.prompt_lens, self.response_lens)]

    def micro_batches(self, size: int, rows: list[int] | None = None) -> list[list[int]]:
        """`rows` (default: all) cut into micro-batches of at most `size`, longest (prompt +
        counted response) first: rows of similar length share a forward, so `model_inputs`
        drops more padding."""
        return longest_first(self.row_lens, size, rows)

    def token_micro_batches(self, budget: int, rows: list[int] | None = None
                            ) -> list[list[int]]:
        """`rows` (default: all) cut into packed micro-batches of at most `budget` real tokens
        (prompt + counted response), longest first (`token_budget_batches`: first fit; a row
        longer than the budget alone)."""
        return token_budget_batches(self.row_lens, budget, rows)

    def with_idle(self, batches: list[list[int]], count: int) -> list[list[int]]:
        """`batches` followed by idle micro-batches up to `count` in all, each the shortest row
        of `batches` (the cheapest forward a rank with fewer micro-batches can run to keep
        step with the others; its outputs are dropped)."""
        lens = self.row_lens
        shortest = min((i for rows in batches for i in rows), key=lens.__getitem__)
        return batches + [[shortest]] * (count - len(batches))

    def positions(self, batches: list[list[int]], packed: bool = False,
                  mine: int | None = None) -> tuple[int, int]:
        """(token positions the forwards of these micro-batches compute, real tokens in them),
        from the host lengths: a micro-batch's forward is as wide as its longest prompt plus
        its longest counted response (`model_inputs`), or, packed, exactly its real tokens;
        the real tokens are each row's prompt and counted response (an episode's observations
        too: context like the prompt, not padding). Their ratio is the compute
        spent on padding (1 = none). `mine`: only the first `mine` micro-batches hold this
        rank's rows, the rest are idle repeats (`with_idle`), computed but not real tokens."""
        computed = real = 0
        for k, rows in enumerate(batches):
            prompt = [self.prompt_lens[i] for i in rows]
            response = [self.response_lens[i] for i in rows]
            tokens = sum(prompt) + sum(response)
            if mine is None or k < mine:
                real += tokens
            computed += tokens if packed else len(rows) * (
                max(prompt, default=0) + max(response, default=0))
        return computed, real

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def slice(self, idx: slice | list[int]) -> "Rollout":
        return _slice_fields(self, idx)


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rows of `parts` one after another, as one Rollout: prompts left-padded and responses
    right-padded to the widest part (pad_id in id columns, 0 / False elsewhere). The parts share
    a device and come from one run (the same optional fields set)."""
    if not parts:
        raise ValueError("concat_rollouts needs at least one part")
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.response_ids.shape[1] for r in parts)
    out = {}
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in parts]
        if all(v is None for v in values):
            out[f.name] = None
        elif isinstance(values[0], torch.Tensor):
            if values[0].dim() == 1:
                out[f.name] = torch.cat(values)
                continue
            left = f.name.startswith("prompt_")
            fill = (pad_id if f.name.endswith("_ids") else
                    -1 if f.name.endswith(("_routes", "_versions")) else 0)
            width = P if left else T
            inner = (0, 0) * (values[0].dim() - 2)  # routes: pad only the token axis
            out[f.name] = torch.cat([torch.nn.functional.pad(
                v, inner + ((width - v.shape[1], 0) if left else (0, width - v.shape[1])),
                value=fill) for v in values])
        elif isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
        else:  # one value for the whole rollout (`sampling`): the parts' must agree
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"concat_rollouts: the parts' {f.name} differ")
            out[f.name] = values[0]
    return Rollout(**out)


@dataclass
class Experience:
    """What leaves scoring and advantage estimation: everything a PPO update needs."""

    rollout: Rollout
    old_logprobs: torch.Tensor  # (B, T) float32, policy log-probs at sampling time
    ref_logprobs: torch.Tensor  # (B, T) float32, reference log-probs (no reference: the
    # policy's old_logprobs, a KL of 0)
    old_values: torch.Tensor | None  # (B, T) float32, value estimates at sampling time (None:
    # a critic-free estimator, no value model)
    scores: torch.Tensor  # (B,) float32, sequence scores after penalties, before clipping
    # (B, T) float32, policy entropy per position (metric only); None with
    # ppo.old_logprobs=rollout (no scoring forward: the update's first epoch measures it)
    entropy: torch.Tensor | None
    reward_cut: torch.Tensor | None = None  # (B,) bool, reward-model input cut to reward.max_len
    reward_s: float = 0.0  # seconds this rank spent on the reward scores (metric only)
    reward_retries: int | None = None  # reward.url: requests retried for them (metric only)
    # (positions computed, real tokens) by one scoring forward over the rollout (metric only)
    scoring_positions: tuple[int, int] = (0, 0)
    # a mixture-of-experts policy's scoring forwards (metric only): (tokens whose own routing
    # differs from the sampler's in some layer, tokens with a recorded route)
    route_flips: tuple[float, float] = (0.0, 0.0)
    # on-policy distillation (ppo.advantage_estimator = distill; None without a teacher):
    # (B, T) float32 the teacher's log-probs of the sampled tokens, and (B, T) float32 1 where
    # the sample is the teacher's top-1 token (None also when its logits were tiled)
    teacher_logprobs: torch.Tensor | None = None
    teacher_top1: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # (B, T) float32, KL-shaped per-token rewards
    kl: torch.Tensor | None = None  # (B, T) float32, per-token KL estimate (policy vs ref)
    advantages: torch.Tensor | None = None  # (B, T) float32, whitened if configured
    returns: torch.Tensor | None = None  # (B, T) float32, advantages + old_values (pre-whitening)
    # B host flags: the row takes part in the update (False: its group's scores were all equal
    # and ppo.filter_zero_std_groups drops it); None = every row
    train_rows: list[bool] | None = None
    # ppo.rollout_correction (None: off): (B, T) float32 importance weights of the policy loss
    # (0 outside is_kept), (B, T) bool the tokens the policy loss keeps, and their count per
    # row on the host (the loss divisor's lengths)
    is_weights: torch.Tensor | None = None
    is_kept: torch.Tensor | None = None
    is_kept_lens: list[int] | None = None

    @property
    def mask(self) -> torch.Tensor:  # (B, T) bool
        return self.rollout.mask

    @property
    def episode_scores(self) -> torch.Tensor:  # (B,) float32
        """Each response's whole reward before KL: its score, plus an episode's turn rewards."""
        turns = self.rollout.turn_rewards
        return self.scores if turns is None else self.scores + turns.sum(dim=1)

    def __len__(self) -> int:
        return len(self.rollout)

    def slice(self, idx: slice | list[int]) -> "Experience":
        return _slice_fields(self, idx)
