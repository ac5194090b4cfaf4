"""Tokenizers: SentencePiece training into an HF directory, loading, builtin:tiny, and
re-encoding between two different tokenizers for a reward model."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_ppo.data import POSITIVE_WORDS
from ds_ppo.rewards.encode import decode_responses, encode_for_reward, same_tokenizer
from ds_ppo.data.tokenizer import (CHAT_TEMPLATE, load_tokenizer, tiny_corpus_path,
                                   train_tokenizer)
from ds_ppo.errors import ConfigError, DataError, UserError
from ds_ppo.engine.forward import last_token_index

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["the cat sat in the park", "we had a wonderful time at the beach",
         "Hello World, 12345!  two  spaces", "naïve café ünïcödé 😀",
         "a\ttab and\na newline"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the subprocess must not even be able to import ds_ppo
    return env


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small corpus: the shipped one's first 400 lines (trains in well under a second)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    lines = tiny_corpus_path().read_text().splitlines()[:400]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def bpe_dir(corpus, tmp_path_factory) -> Path:
    return train_tokenizer(corpus, 320, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def unigram_dir(corpus, tmp_path_factory) -> Path:
    return train_tokenizer(corpus, 300, tmp_path_factory.mktemp("uni"), model_type="unigram")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tokenizer("builtin:tiny", tmp_path_factory.mktemp("cache"))


def test_trained_directory_loads_with_plain_transformers(bpe_dir):
    """AutoTokenizer alone (no ds_ppo on the path) loads it, with every property we rely on."""
    script = f"""
import json, sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained({str(bpe_dir)!r})
assert "ds_ppo" not in sys.modules
texts = {TEXTS!r}
batch = t(["the cat", "the cat sat in the park"], padding=True)
print(json.dumps(dict(
    cls=type(t).__name__, bos=t.bos_token_id, eos=t.eos_token_id, pad=t.pad_token_id,
    unk=t.unk_token_id, side=t.padding_side,
    ids=[t(x)["input_ids"] for x in texts],
    decoded=[t.decode(t(x)["input_ids"], skip_special_tokens=True) for x in texts],
    batch=batch["input_ids"], mask=batch["attention_mask"],
    chat=t.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False,
                               add_generation_prompt=True))))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=_env(), cwd=bpe_dir, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["bos"], got["eos"], got["pad"], got["unk"]) == (1, 2, 3, 0)
    assert got["pad"] != got["eos"] and got["side"] == "left"
    assert got["decoded"] == TEXTS  # byte fallback: nothing is lost, not even emoji
    assert all(ids[0] == 1 and 1 not in ids[1:] for ids in got["ids"])  # one BOS, first
    short, long_ = got["batch"]
    n = sum(got["mask"][0])  # left padding: pads (id 3) first, then "the cat" with its BOS
    assert len(short) == len(long_) > n and got["mask"][0] == [0] * (len(short) - n) + [1] * n
    assert short[:len(short) - n] == [3] * (len(short) - n) and short[len(short) - n] == 1
    assert got["chat"] == "<s>user: hi\nassistant:"
    # ds_ppo's loader gives the same ids
    t = load_tokenizer(str(bpe_dir), bpe_dir)
    assert [t(x)["input_ids"] for x in TEXTS] == got["ids"]


@pytest.mark.parametrize("which", ["bpe", "unigram"])
def test_encodes_like_sentencepiece(which, bpe_dir, unigram_dir, corpus):
    import sentencepiece as spm

    d = bpe_dir if which == "bpe" else unigram_dir
    sp = spm.SentencePieceProcessor(model_file=str(d / "spm.model"))
    t = load_tokenizer(str(d), d)
    lines = corpus.read_text().splitlines()[:200] + TEXTS
    for line in lines:
        assert t(line, add_special_tokens=False)["input_ids"] == sp.encode(line), line
        assert t.decode(sp.encode(line)) == sp.decode(sp.encode(line))


def test_training_is_deterministic(corpus, bpe_dir, tmp_path):
    again = train_tokenizer(corpus, 320, tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "spm.model"):
        assert (again / name).read_bytes() == (bpe_dir / name).read_bytes(), name


def test_training_errors(corpus, tmp_path):
    with pytest.raises(DataError, match="not found"):
        train_tokenizer(tmp_path / "nope.txt", 320, tmp_path / "out")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match="empty"):
        train_tokenizer(tmp_path / "empty.txt", 320, tmp_path / "out")
    with pytest.raises(ConfigError, match="vocab_size = 100"):
        train_tokenizer(corpus, 100, tmp_path / "out")
    with pytest.raises(DataError, match="failed"):  # more pieces than the corpus can make
        train_tokenizer(corpus, 50000, tmp_path / "out")


def test_cli_tokenizer_train(corpus, tmp_path, capsys):
    from ds_ppo.cli import main

    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    # a user error: exit 2, one line, no traceback
    assert main(["tokenizer", "train", "--input", str(tmp_path / "missing.txt"),
                 "--vocab-size", "300", "--out", str(tmp_path / "tok2")]) == 2
    err = capsys.readouterr().err
    assert "missing.txt" in err and "not found" in err and "Traceback" not in err


def test_builtin_tiny_positive_words_are_single_pieces(tiny):
    assert len(tiny) == 512 and tiny.padding_side == "left"
    assert tiny.pad_token_id != tiny.eos_token_id and tiny.chat_template == CHAT_TEMPLATE
    for word in POSITIVE_WORDS:
        ids = tiny(word, add_special_tokens=False)["input_ids"]
        assert tiny.convert_ids_to_tokens(ids) == ["▁" + word], word
        # and in running text, where the policy will emit it
        ids = tiny(f"it was a {word} day", add_special_tokens=False)["input_ids"]
        assert "▁" + word in tiny.convert_ids_to_tokens(ids)


def test_builtin_tiny_is_cached(tmp_path):
    a = load_tokenizer("builtin:tiny", tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["tokenizer_tiny"]  # no temporary directory left behind
    stamp = (tmp_path / "tokenizer_tiny" / "tokenizer.json").stat().st_mtime_ns
    b = load_tokenizer("builtin:tiny", tmp_path)
    assert (tmp_path / "tokenizer_tiny" / "tokenizer.json").stat().st_mtime_ns == stamp
    assert a.get_vocab() == b.get_vocab()


def test_builtin_tiny_two_ranks_at_once(tmp_path, monkeypatch):
    """The rank that loses the race to build the cache discards its copy and uses the winner's.

    Simulated deterministically: while this call trains, "another rank" finishes first.
    """
    import shutil

    from ds_ppo.data import tokenizer as tk

    real_train = tk.train_tokenizer

    def train_while_another_rank_wins(src, vocab_size, out, model_type="bpe"):
        out = real_train(src, vocab_size, out, model_type=model_type)
        shutil.copytree(out, tmp_path / "tokenizer_tiny")  # the other rank's rename lands first
        (tmp_path / "tokenizer_tiny" / "winner").touch()
        return out

    monkeypatch.setattr(tk, "train_tokenizer", train_while_another_rank_wins)
    t = load_tokenizer("builtin:tiny", tmp_path)
    assert (tmp_path / "tokenizer_tiny" / "winner").exists()  # the winner's files were kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer_tiny"]  # ours removed
    assert len(t) == 512


def test_load_adds_pad_from_eos_and_left_padding(bpe_dir, tmp_path, caplog):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            padding_side="right").save_pretrained(tmp_path / "nopad")
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        t = load_tokenizer(str(tmp_path / "nopad"), tmp_path)
    assert t.pad_token_id == t.eos_token_id == 2 and t.padding_side == "left"
    assert "no pad token" in caplog.text


def test_load_bare_sentencepiece_model(bpe_dir, tmp_path):
    """A Llama-style tokenizer.model alone (no HF files) loads; BOS added, <pad> found."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(bpe_dir / "spm.model"))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "tokenizer.model").write_bytes((bpe_dir / "spm.model").read_bytes())
    for spec in (tmp_path / "llama", tmp_path / "llama" / "tokenizer.model"):
        t = load_tokenizer(str(spec), tmp_path)
        assert t("the cat sat")["input_ids"] == [1] + sp.encode("the cat sat")
        assert t.pad_token == "<pad>" and t.padding_side == "left"


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "no_such_dir"), tmp_path)
    with pytest.raises(ConfigError, match="builtin:tiny"):
        load_tokenizer("builtin:huge", tmp_path)
    assert issubclass(ConfigError, UserError) and issubclass(DataError, UserError)


# ------------------------------------------------------------------ reward re-encoding
def test_same_tokenizer(bpe_dir, unigram_dir, tiny):
    a, a2 = load_tokenizer(str(bpe_dir), bpe_dir), load_tokenizer(str(bpe_dir), bpe_dir)
    assert same_tokenizer(a, a2)
    assert not same_tokenizer(a, tiny)  # vocab 320 vs 512
    assert not same_tokenizer(a, load_tokenizer(str(unigram_dir), unigram_dir))


def test_reencode_between_different_tokenizers(bpe_dir, tiny):
    policy, reward = load_tokenizer(str(bpe_dir), bpe_dir), tiny
    prompts = ["the cat sat", "we had a", "what a"]
    responses = [" in the sunny park", " wonderful time at the beach", " lovely 😀 day"]
    prompt_ids = [policy(p)["input_ids"] for p in prompts]  # with BOS, as rollouts have
    # responses as generated: no BOS, ended by EOS and padded, as in a rollout
    response_ids = [policy(r, add_special_tokens=False)["input_ids"] for r in responses]
    response_ids = [r + [policy.eos_token_id] + [policy.pad_token_id] * (i + 1)
                    for i, r in enumerate(response_ids)]

    got_prompts, got_responses = decode_responses(policy, prompt_ids, response_ids)
    assert got_prompts == prompts and got_responses == responses  # spaces kept at the seam

    ids, mask, cut = encode_for_reward(reward, got_prompts, got_responses, max_len=64)
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape
    assert not cut.any()
    last = last_token_index(mask)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        n = int(mask[b].sum())
        assert mask[b, :n].all() and not mask[b, n:].any()  # right padding
        assert ids[b, :n].tolist() == reward(p + r)["input_ids"]  # the reward tokenizer's ids
        assert reward.decode(ids[b, :n], skip_special_tokens=True) == p + r
        assert int(last[b]) == n - 1
    # policy and reward ids really differ: re-encoding was needed
    assert ids[0, :int(mask[0].sum())].tolist() != prompt_ids[0] + response_ids[0][:-2]


def test_encode_for_reward_keeps_the_end(tiny):
    prompts, responses = ["the cat sat in the park and the dog ran"], [" to the wonderful beach"]
    full = tiny(prompts[0] + responses[0])["input_ids"]
    ids, mask, cut = encode_for_reward(tiny, prompts, responses, max_len=6, append_eos=True)
    assert ids.shape == (1, 6) and mask.all() and cut.tolist() == [True]
    assert ids[0].tolist() == [tiny.bos_token_id] + (full + [tiny.eos_token_id])[-5:]
    assert tiny.decode(ids[0], skip_special_tokens=True).endswith("wonderful beach")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADERS = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
           "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
           "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
           "{% endif %}")


def _chat_tokenizer(path: Path, specials: list[str], eos: str, template: str):
    """A reward-model tokenizer of another family: its own special tokens and chat template."""
    tok = load_tokenizer(str(path), path)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_special_tokens({"eos_token": eos})
    tok.chat_template = template
    return tok


def test_reward_tokenizer_renders_chats_with_its_own_template(tiny, unigram_dir):
    """Policy (builtin:tiny, `role: content` template) and reward tokenizers differ: a chat row
    reaches the reward model in the reward tokenizer's own chat markup (its special tokens, not
    the policy's markup as text), closed by its EOS like the same-tokenizer path's input; a
    truncated response stays open; a plain-text row gets BOS ... EOS."""
    from ds_ppo.containers import Rollout
    from ds_ppo.rewards.encode import encode_rollout_for_reward, rollout_for_reward

    chat = [{"role": "user", "content": "what a day"}]
    policy = tiny
    rendered_prompt = policy.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    chat_ids = policy(rendered_prompt, add_special_tokens=False)["input_ids"]
    prompt_ids = [chat_ids, policy("we had a")["input_ids"], chat_ids]
    response_ids = [policy(" good day", add_special_tokens=False)["input_ids"] + [policy.eos_token_id],
                    policy(" wonderful time", add_special_tokens=False)["input_ids"] + [policy.eos_token_id],
                    policy(" a long", add_special_tokens=False)["input_ids"]]  # truncated
    prompts, responses = decode_responses(policy, prompt_ids, response_ids)
    P, T = max(map(len, prompt_ids)), max(map(len, response_ids))
    pids = torch.tensor([[policy.pad_token_id] * (P - len(p)) + p for p in prompt_ids])
    rids = torch.tensor([r + [policy.pad_token_id] * (T - len(r)) for r in response_ids])
    rollout = Rollout(prompt_ids=pids, prompt_mask=pids != policy.pad_token_id,
                      response_ids=rids, mask=torch.tensor([[i < len(r) for i in range(T)]
                                                            for r in response_ids]),
                      ended=torch.tensor([True, True, False]), prompts=prompts,
                      responses=responses, prompt_lens=[len(p) for p in prompt_ids],
                      response_lens=[len(r) for r in response_ids], extras=[{}] * 3,
                      messages=[chat, None, chat])
    # the same-tokenizer path: the policy's own ids, the last real token of an ended row is EOS
    same, same_mask, _ = rollout_for_reward(rollout, 64, policy.bos_token_id)
    assert same[0, last_token_index(same_mask)[0]] == policy.eos_token_id

    chatml = _chat_tokenizer(unigram_dir, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML)
    headers = _chat_tokenizer(unigram_dir, ["<|start_header_id|>", "<|end_header_id|>",
                                            "<|eot_id|>", "<|end_of_text|>"], "<|end_of_text|>",
                              HEADERS)
    for reward in (chatml, headers):
        ids, mask, cut = encode_rollout_for_reward(reward, rollout, max_len=64)
        assert not cut.any()
        rows = [ids[b, :int(mask[b].sum())].tolist() for b in range(3)]
        texts = [reward.decode(r) for r in rows]
        full = [*chat, {"role": "assistant", "content": " good day"}]
        rendered = reward.apply_chat_template(full, tokenize=False)
        # row 0: the reward tokenizer's markup, its special tokens as single ids, EOS at the end
        assert responses[0] == " good day"
        if reward is chatml:  # the template's turn end is the EOS: not doubled
            assert rows[0] == reward(rendered, add_special_tokens=False)["input_ids"]
            assert texts[0].startswith("<|im_start|>user\nwhat a day<|im_end|>\n<|im_start|>"
                                       "assistant\n")
        else:  # the turn end is <|eot_id|>: the EOS is appended, as the policy's EOS ends its row
            assert rows[0] == reward(rendered, add_special_tokens=False)["input_ids"] + [
                reward.eos_token_id]
            assert rows[0][-1] == reward.eos_token_id
        opener = "<|im_start|>" if reward is chatml else "<|start_header_id|>"
        assert reward.convert_tokens_to_ids(opener) in rows[0]  # one special id
        assert "user:" not in texts[0] and "assistant:" not in texts[0]  # no policy markup
        # row 1, plain text: BOS + prompt + response + EOS
        assert rows[1] == reward("we had a wonderful time")["input_ids"] + [reward.eos_token_id]
        # row 2, truncated: the assistant turn is left open, no EOS
        assert rows[2][-1] != reward.eos_token_id
        assert texts[2].endswith(("assistant\n a long", "<|end_header_id|>\n\n a long"))


NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
             "supported') }}{% endif %}" + CHATML)


def test_reward_template_that_rejects_a_chat_is_a_clear_error(tiny, unigram_dir):
    """A reward tokenizer whose chat template refuses the row's messages (e.g. Gemma's: no
    system role, though the policy's template took it) stops with one message naming
    reward.tokenizer, the row and the template's words, not a traceback from jinja."""
    from ds_ppo.containers import Rollout
    from ds_ppo.rewards.encode import encode_rollout_for_reward

    chat = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "what a day"}]
    ids = torch.tensor([tiny(tiny.apply_chat_template(chat, add_generation_prompt=True,
                                                      tokenize=False),
                             add_special_tokens=False)["input_ids"]])
    rollout = Rollout(prompt_ids=ids, prompt_mask=torch.ones_like(ids, dtype=torch.bool),
                      response_ids=ids[:, :2], mask=torch.ones(1, 2, dtype=torch.bool),
                      ended=torch.tensor([True]), prompts=["p"], responses=[" good day"],
                      prompt_lens=[ids.shape[1]], response_lens=[2], extras=[{}],
                      messages=[chat])
    reward = _chat_tokenizer(unigram_dir, ["<|im_start|>", "<|im_end|>"], "<|im_end|>",
                             NO_SYSTEM)
    with pytest.raises(UserError, match=r"reward.tokenizer's chat template cannot render row 0's "
                       r"messages \(roles system, user, assistant\): .*System role not supported"):
        encode_rollout_for_reward(reward, rollout, max_len=64)


def test_sample_responses_show_stray_bytes_and_control_characters_by_name(tiny):
    """The samples tables' text: byte-fallback pieces that form no character (decoded: U+FFFD)
    or a control character appear as `<0xNN>`; a valid byte sequence, newlines, tabs and every
    other piece read as the decoded text does."""
    from ds_ppo.containers import Rollout
    from ds_ppo.data.prompts import left_pad
    from ds_ppo.rewards.encode import readable_responses

    vocab = tiny.get_vocab()

    def ids(text):
        return tiny(text, add_special_tokens=False).input_ids

    def byte(*values):
        return [vocab[f"<0x{v:02X}>"] for v in values]

    prompts = [ids("the cat"), ids("we love"), ids("you are")]
    responses = [ids(" good") + byte(0xE3, 0x0F) + ids(" happy") + byte(0xC3, 0xA9) + ids(" day")
                 + byte(0xC3) + [tiny.eos_token_id],
                 byte(0x0F) + ids(" love") + byte(0x0A, 0x09) + ids("fun"),
                 ids(" nice and\ttabs\nnew")]
    lossy = decode_responses(tiny, prompts, responses)[1]
    assert "\ufffd" in lossy[0] and "\x0f" in lossy[1]  # what decoding makes of them
    p_ids, p_mask = left_pad(prompts, tiny.pad_token_id)
    r_ids, mask = left_pad(responses, tiny.pad_token_id)  # the layout does not matter here
    rollout = Rollout(prompt_ids=p_ids, prompt_mask=p_mask.bool(), response_ids=r_ids,
                      mask=mask.bool(), ended=torch.ones(3, dtype=torch.bool),
                      prompts=["the cat", "we love", "you are"], responses=lossy,
                      prompt_lens=[len(p) for p in prompts],
                      response_lens=[len(r) for r in responses], extras=[{}, {}, {}])
    shown = readable_responses(tiny, rollout, 3)
    assert shown == [" good<0xE3><0x0F> happyé day<0xC3>", "<0x0F> love\n\t fun",
                     " nice and\ttabs\nnew"]
    assert shown[2] == lossy[2]  # nothing to show differently: the decoded text
    assert readable_responses(tiny, rollout, 1) == shown[:1]


def test_readable_text_equals_the_decoded_text_when_nothing_is_lost(tiny):
    """Any pieces, with byte runs that form characters (é = <0xC3><0xA9>), anywhere (first
    too): the samples' text is exactly what decoding gives."""
    import random

    from ds_ppo.rewards.encode import _readable

    vocab = tiny.get_vocab()
    plain = [i for p, i in vocab.items()
             if not p.startswith("<0x") and i not in tiny.all_special_ids]
    e_acute = [vocab["<0xC3>"], vocab["<0xA9>"]]
    rng = random.Random(0)
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 30)):
            ids += e_acute if rng.random() < 0.2 else [rng.choice(plain)]
        assert _readable(tiny, ids) == tiny.decode(ids, skip_special_tokens=True), ids
