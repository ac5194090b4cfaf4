"""Text between tokenizers: the reward model may use a tokenizer other than the policy's.

When ``same_tokenizer(policy_tok, reward_tok)`` is False, the policy's prompt and response
token ids are decoded to text (special tokens skipped) and the text is encoded again for the
reward model by :func:`encode_rollout_for_reward` (chat rows rendered with the reward
tokenizer's own chat template). When it is True the ids can be used as they are.
"""
from __future__ import annotations

import json
import logging
import re
import unicodedata
from typing import TYPE_CHECKING, Sequence

import torch

from ds_ppo.containers import Rollout
from ds_ppo.data.prompts import truncate_left

log = logging.getLogger("ds_ppo")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ds_ppo.config import Config

# Encoded by both tokenizers as a last check: catches differences in normalisation or
# pre-tokenisation that the vocabulary alone does not show.
_PROBE = "Hello, world!  It's 2024: naïve café, 12345 tokens\nand\ttabs."


def _special_ids(t: PreTrainedTokenizerBase) -> tuple[int | None, ...]:
    return (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id)


def _pipeline(t: PreTrainedTokenizerBase) -> dict | None:
    """The fast tokenizer's serialized pipeline, without per-call padding/truncation state."""
    backend = getattr(t, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    spec.pop("padding", None)
    spec.pop("truncation", None)
    return spec


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when ``a`` and ``b`` turn every text into the same ids, with the same special ids.

    Compares the class, the vocabulary, the BOS/EOS/PAD/UNK ids, the whole tokenisation
    pipeline of fast tokenizers, and the encoding of a probe text. A False is safe either way
    (re-encoding is then only slower); a True means token ids can be passed across as they are.
    """
    if a is b:
        return True
    if type(a) is not type(b) or _special_ids(a) != _special_ids(b):
        return False
    if a.get_vocab() != b.get_vocab():
        return False
    if _pipeline(a) != _pipeline(b):
        return False
    return a(_PROBE)["input_ids"] == b(_PROBE)["input_ids"]


def decode_responses(tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[Sequence[int]],
                     response_ids: Sequence[Sequence[int]]) -> tuple[list[str], list[str]]:
    """Decode prompts and responses to text, special tokens (BOS, EOS, PAD) skipped.

    A response is decoded together with its prompt and the prompt's text cut off the front:
    decoded alone, a SentencePiece response would lose the space of its first word ("▁good"
    decodes as "good" at the start of a text), so prompt + response would glue two words.

    Args:
        prompt_ids: B unpadded prompt id lists.
        response_ids: B response id lists (trailing EOS/padding may stay: they are skipped).

    Returns:
        (prompts, responses): B strings each; ``prompts[i] + responses[i]`` is the decoded
        whole sequence.
    """
    prompts, responses = [], []
    for p, r in zip(prompt_ids, response_ids):
        p, r = list(p), list(r)
        prompt = tokenizer.decode(p, skip_special_tokens=True)
        full = tokenizer.decode(p + r, skip_special_tokens=True)
        if full.startswith(prompt):
            response = full[len(prompt):]
        else:  # a token merged across the boundary in decoding: fall back to the response alone
            response = tokenizer.decode(r, skip_special_tokens=True)
        prompts.append(prompt)
        responses.append(response)
    return prompts, responses


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def readable_responses(tokenizer: PreTrainedTokenizerBase, rollout: Rollout,
                       rows: int) -> list[str]:
    """The first `rows` responses of `rollout` as text for people (the samples tables): as
    decode_responses gives them, but without its losses. A model that samples stray
    byte-fallback pieces (bytes that form no character, which decoding turns into U+FFFD) and
    control characters other than newline and tab shows them by their piece names, `<0xE3>`,
    `<0x0F>`; a valid byte sequence still shows its character. Decoded with the prompt, cut."""
    out = []
    for b in range(min(rows, len(rollout))):
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b]].tolist()
        response = rollout.response_ids[b][rollout.context[b]].tolist()
        before, whole = _readable(tokenizer, prompt), _readable(tokenizer, prompt + response)
        out.append(whole[len(before):] if whole.startswith(before) else
                   _readable(tokenizer, response))
    return out


def _readable(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """`ids` decoded (special tokens skipped), each run of byte-fallback pieces decoded on its
    own (`_bytes_shown`), each run of other pieces after the piece before it (which keeps a
    SentencePiece word's space), and control characters named."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in ids if i not in special]
    runs: list[tuple[bool, list[int], list[str]]] = []  # (byte pieces?, ids, pieces)
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        is_byte = _BYTE_PIECE.fullmatch(piece) is not None
        if not runs or runs[-1][0] != is_byte:
            runs.append((is_byte, [], []))
        runs[-1][1].append(i)
        runs[-1][2].append(piece)
    if not any(is_byte for is_byte, _, _ in runs):
        return _controls_shown(tokenizer.decode(ids))
    parts, last = [], None  # last: the piece before the run
    for is_byte, run, pieces in runs:
        if is_byte:
            parts.append(_bytes_shown(bytes(int(p[3:5], 16) for p in pieces)))
            continue
        if last is None and parts:  # after bytes at the start: as in mid-text, not at its start
            last = run[0]
        before = "" if last is None else tokenizer.decode([last])
        text = tokenizer.decode(run if last is None else [last] + run)
        if not text.startswith(before):  # a decoder that does not work piece by piece
            return _controls_shown(tokenizer.decode(ids))
        parts.append(text[len(before):])
        last = run[-1]
    return _controls_shown("".join(parts))


def _bytes_shown(data: bytes) -> str:
    """UTF-8 `data` as text, each byte that is no part of a character as `<0xNN>`."""
    text = data.decode("utf-8", errors="surrogateescape")  # stray byte N -> U+DC00 + N
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if "\udc80" <= c <= "\udcff" else c
                   for c in text)


def _controls_shown(text: str) -> str:
    """Control characters other than newline and tab as their UTF-8 bytes, `<0x0F>`."""
    return "".join("".join(f"<0x{b:02X}>" for b in c.encode()) if
                   unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def encode_for_reward(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                      responses: Sequence[str], max_len: int, append_eos: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode ``prompt + response`` texts for a reward model, right-padded.

    Args:
        tokenizer: the reward model's tokenizer; its specials (e.g. BOS) are added.
        prompts, responses: B strings each, concatenated as they are (see decode_responses).
        max_len: longest sequence; a longer one keeps its end (the response) and loses the
            start of the prompt, keeping a leading BOS.
        append_eos: end each sequence with the tokenizer's EOS (as reward models trained in
            DeepSpeed-Chat's style expect).

    Returns:
        ``input_ids`` (B, L) long and ``attention_mask`` (B, L) long, 1 on real tokens which
        come first in each row (right padding with the pad id, else EOS, else 0);
        L = the longest row <= max_len (see ds_ppo.engine.forward.last_token_index); and ``cut``
        (B,) bool, True for the rows that lost tokens to max_len.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("encode_for_reward needs at least one sequence")
    texts = [p + r for p, r in zip(prompts, responses)]
    rows = [list(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    eos = tokenizer.eos_token_id
    if append_eos and eos is not None:
        rows = [r + [eos] for r in rows]
    return _right_padded(tokenizer, rows, max_len)


def _right_padded(tokenizer: PreTrainedTokenizerBase, rows: list[list[int]], max_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Id rows cut to max_len (keeping their end and a leading BOS) and right-padded; see
    encode_for_reward."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    cut = torch.tensor([len(r) > max_len for r in rows], dtype=torch.bool)
    rows = [truncate_left(r, max_len, keep_first=bos is not None and bool(r) and r[0] == bos)
            for r in rows]
    pad = next((i for i in (tokenizer.pad_token_id, eos) if i is not None), 0)
    width = max(1, max(len(r) for r in rows))
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, :len(r)] = 1
    return input_ids, attention_mask, cut


def rollout_for_reward(rollout: Rollout, max_len: int, bos_id: int | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rollout's own ids as reward-model input (same tokenizer), right-padded, each row cut
    as `encode_for_reward` cuts it: a row of more than ``max_len`` real tokens keeps its last
    ones (the response) and loses the start of its prompt, keeping a leading ``bos_id``.

    Per row: the padding of the other rows never costs a row its tokens. Runs on the device
    with no host sync (the width comes from the rollout's host lengths).

    Returns:
        ``input_ids`` (B, L) long and ``attention_mask`` (B, L) long, real tokens first;
        L = the longest row after the cut; ``cut`` (B,) bool, True for the rows that were cut.
    """
    ids, real = rollout.input_ids, rollout.attention_mask.bool()  # (B, P+T)
    from_end = real.flip(1).cumsum(1).flip(1)  # 1 at each row's last real token, n at its first
    first = real.long().argmax(1, keepdim=True)  # column of each row's first real token
    too_long = from_end.gather(1, first) > max_len  # (B, 1)
    bos_kept = too_long & (max_len > 1) & (bos_id is not None)
    if bos_id is not None:
        bos_kept &= ids.gather(1, first) == bos_id
    tail = max_len - bos_kept.long()  # real tokens kept from the end
    columns = torch.arange(ids.shape[1], device=ids.device)
    keep = real & ((from_end <= tail) | (bos_kept & (columns == first)))
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept tokens first, in order
    width = max(1, max(min(max_len, p + r) for p, r in zip(rollout.prompt_lens,
                                                            rollout.response_lens)))
    order = order[:, :width]
    return ids.gather(1, order), keep.gather(1, order).long(), too_long.squeeze(1)


def _ends_with_eos(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    return bool(tokenizer.eos_token) and text.rstrip().endswith(tokenizer.eos_token)


def _render_chat(tokenizer: PreTrainedTokenizerBase, chat: list[dict], open_end: bool,
                 row: int) -> str:
    """`chat` in the reward tokenizer's template; a template that refuses it (e.g. one without
    a system role, or that needs alternating roles) is a ConfigError naming the roles."""
    from jinja2 import TemplateError

    from ds_ppo.errors import ConfigError

    try:
        return tokenizer.apply_chat_template(chat, tokenize=False,
                                             continue_final_message=open_end)
    except (TemplateError, ValueError, TypeError) as e:
        roles = ", ".join(str(m.get("role")) for m in chat)
        raise ConfigError(f"reward.tokenizer's chat template cannot render row {row}'s messages "
                          f"(roles {roles}): {type(e).__name__}: {e}; use a reward model whose "
                          "template accepts the policy's chats (reward.model / reward.tokenizer), "
                          "or prompts without such messages") from None


def encode_rollout_for_reward(tokenizer: PreTrainedTokenizerBase, rollout: Rollout, max_len: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rollout as input for a reward model with its own tokenizer, in the form it was trained
    on, with the end of the response marked as the same-tokenizer path marks it:

    - a chat row (``rollout.messages[i]``) when the tokenizer has a chat template: the row's
      messages plus ``{"role": "assistant", "content": response}`` rendered with the reward
      tokenizer's own template (its own special tokens, e.g. ``<|im_start|>`` or
      ``<|start_header_id|>``, which decoding the policy's ids drops). A response that ended
      (EOS or a stop token) closes its turn and gets the tokenizer's EOS unless the rendering
      already ends with it; a truncated one is left open (``continue_final_message``).
    - otherwise the decoded prompt + response text with the tokenizer's specials (BOS), and its
      EOS when the response ended (the same-tokenizer path scores the policy's EOS then).

    Returns ``input_ids`` (B, L), ``attention_mask`` (B, L) and ``cut`` (B,) as
    ``encode_for_reward`` does.
    """
    if not len(rollout):
        raise ValueError("encode_rollout_for_reward needs at least one sequence")
    eos = tokenizer.eos_token_id
    ended = rollout.ended.tolist()
    rows = []
    for i, (prompt, response) in enumerate(zip(rollout.prompts, rollout.responses)):
        chat = rollout.messages[i] if rollout.messages is not None else None
        if chat is not None and tokenizer.chat_template:
            text = _render_chat(tokenizer, [*chat, {"role": "assistant", "content": response}],
                                not ended[i], i)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            closed = _ends_with_eos(tokenizer, text)
        else:
            ids = list(tokenizer(prompt + response, add_special_tokens=True)["input_ids"])
            closed = False
        if ended[i] and eos is not None and not closed:
            ids.append(eos)
        rows.append(ids)
    return _right_padded(tokenizer, rows, max_len)


def reward_encoder(cfg: "Config", policy_tokenizer, reward_tok):
    """rollout -> (input_ids, attention_mask) for the reward model (cfg.reward.model): the
    rollout's own tokens when both share a tokenizer, else decoded text re-encoded with the
    reward tokenizer `reward_tok`. Its `same` attribute says which."""
    same = same_tokenizer(policy_tokenizer, reward_tok)
    if same:
        def encode(rollout):
            return rollout_for_reward(rollout, cfg.reward.max_len, reward_tok.bos_token_id)
    else:
        log.info("the reward model's tokenizer differs from the policy's: responses are decoded "
                 "and re-encoded for it (chat prompts with its own chat template%s)",
                 "" if reward_tok.chat_template else ": it has none, so as plain text")

        def encode(rollout):
            return encode_rollout_for_reward(reward_tok, rollout, cfg.reward.max_len)
    encode.same = same
    return encode
