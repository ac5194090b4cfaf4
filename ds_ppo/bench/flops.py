"""The FLOP count of `ds-ppo bench`: model FLOPs (MFU, not hardware FLOPs: no recomputation is
counted) of one architecture's generation, scoring and training, each formula worked out in
FlopModel's docstrings and checked by hand in tests/e2e/test_bench.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopModel:
    """What the FLOP count needs of the one architecture all four roles share."""

    body_params: int  # parameters outside the token embedding and the output head
    layers: int
    attn_width: int  # num_attention_heads * head_dim (query width; GQA does not change it)
    hidden: int
    vocab: int

    def forward(self, seq_len: int, head_positions: int, head_width: int) -> float:
        """FLOPs of one forward over one sequence of `seq_len` tokens.

        2 per body parameter per token (a multiply-add; Kaplan et al. 2020, PaLM App. B), plus
        attention scores QK^T and the weighted sum AV, 2 * attn_width FLOPs per (query, key) pair
        each, counted causally (query i sees keys 1..i: S(S+1)/2 pairs; PaLM's 12*L*H*Q*T counts
        all S^2), plus the output head (hidden x head_width) at `head_positions` positions
        (logits_to_keep for the policy, every position for the value head, one for a reward).
        """
        body = 2 * self.body_params * seq_len
        attention = 2 * self.layers * self.attn_width * seq_len * (seq_len + 1)
        head = 2 * self.hidden * head_width * head_positions
        return float(body + attention + head)

    def generate(self, prompt_len: int, new_tokens: int) -> float:
        """FLOPs of generating `new_tokens` after one prompt with a KV cache: a prefill of the
        prompt (logits at its last position only) and new_tokens - 1 one-token steps, step k
        attending to prompt_len + k keys. Equals forward(prompt_len + new_tokens - 1,
        new_tokens, vocab): the cache saves recomputation, not counted work."""
        if new_tokens <= 0:
            return 0.0
        steps = new_tokens - 1
        keys = steps * prompt_len + steps * (steps + 1) // 2
        return (self.forward(prompt_len, 1, self.vocab)
                + steps * (2 * self.body_params + 2 * self.hidden * self.vocab)
                + 4 * self.layers * self.attn_width * keys)

    def scoring(self, prompt_len: int, new_tokens: int, reward_model: bool) -> float:
        """One sequence's scoring forwards: policy and reference log-probs (logits at T + 1
        positions), the value head at every position, and the reward model at the last."""
        S, T = prompt_len + new_tokens, new_tokens
        flops = 2 * self.forward(S, T + 1, self.vocab) + self.forward(S, S, 1)
        return flops + (self.forward(S, 1, 1) if reward_model else 0.0)

    def training(self, prompt_len: int, new_tokens: int, ppo_epochs: int) -> float:
        """One sequence's PPO update: forward + backward (2x forward) of policy and value, per
        epoch. Gradient checkpointing's recomputed forward is not counted (model FLOPs)."""
        S, T = prompt_len + new_tokens, new_tokens
        return ppo_epochs * 3 * (self.forward(S, T + 1, self.vocab) + self.forward(S, S, 1))


def flop_model(model) -> FlopModel:
    """The FlopModel of an HF causal LM (parameters counted as ZeRO-3's full sizes)."""
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    body = sum(numel(p) for p in model.parameters()) - numel(embedding)
    if head is not None and head.weight is not embedding:
        body -= numel(head.weight)
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return FlopModel(body_params=body, layers=c.num_hidden_layers,
                     attn_width=c.num_attention_heads * head_dim, hidden=c.hidden_size,
                     vocab=c.vocab_size)
