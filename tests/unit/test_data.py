"""Prompt data: every source format, chat rendering, every bad case (named file, row and
column), skipping, max_prompt_len, splits, and the data-parallel sampler."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_ppo.config import DataConfig
from ds_ppo.data.prompts import (PromptSampler, builtin_prompts, format_stats, left_pad,
                                 load_prompts, parse_split, slice_rows)
from ds_ppo.data.tokenizer import load_tokenizer
from ds_ppo.errors import DataError, UserError

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the cat sat", "we had a wonderful", "it was a", "my sister is kind and", "what a"]


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path_factory, monkeypatch):
    """datasets caches what load_dataset reads; keep the tests' copies out of ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE",
                        tmp_path_factory.getbasetemp() / "hf_datasets_cache")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("builtin:tiny", tmp_path_factory.mktemp("cache"))


def cfg(path: Path | str | None, **kw) -> DataConfig:
    return DataConfig(path=None if path is None else str(path), **kw)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_rows() -> list[dict]:
    """DeepSpeed-Chat style rows: prompt / chosen / rejected."""
    return [{"prompt": p, "chosen": " good answer", "rejected": " bad answer"} for p in PROMPTS]


# -------------------------------------------------------------------------------- formats
def write_all_formats(d: Path) -> dict[str, tuple[Path, dict]]:
    """The same prompts in every format; returns name -> (path, extra config)."""
    import datasets

    rows = dpo_rows()
    out = {"jsonl": (write_jsonl(d / "p.jsonl", rows), {})}
    (d / "p.json").write_text(json.dumps(rows, indent=1))
    out["json"] = (d / "p.json", {})
    # a .json file holding JSON lines, as datasets also accepts
    out["json-lines"] = (write_jsonl(d / "lines.json", rows), {})
    # a columnar JSON object
    (d / "cols.json").write_text(json.dumps({"prompt": PROMPTS, "n": list(range(len(PROMPTS)))}))
    out["json-columns"] = (d / "cols.json", {})
    (d / "p.csv").write_text("prompt,chosen,rejected\n" + "".join(
        f'"{r["prompt"]}",{r["chosen"]},{r["rejected"]}\n' for r in rows))
    out["csv"] = (d / "p.csv", {})
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(d / "p.parquet"))
    out["parquet"] = (d / "p.parquet", {})
    ds.save_to_disk(str(d / "disk"))
    out["disk"] = (d / "disk", {})
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(d / "diskdict"))
    out["disk-dict"] = (d / "diskdict", {})
    # a file ending that does not say the format: data.format does
    (d / "prompts.data").write_text((d / "p.jsonl").read_text())
    out["format-override"] = (d / "prompts.data", {"format": "jsonl"})
    return out


def test_every_format_gives_the_same_prompts(tok, tmp_path):
    expected = [tok(p)["input_ids"] for p in PROMPTS]
    for name, (path, extra) in write_all_formats(tmp_path).items():
        ps = load_prompts(cfg(path, **extra), tok)
        assert ps.texts == PROMPTS, name
        assert ps.input_ids == expected, name
        assert ps.stats["rows"] == ps.stats["used"] == len(PROMPTS), name


def test_builtin_prompts_need_no_datasets(tmp_path, tok):
    """Importing ds_ppo.data pulls in none of datasets/transformers/sentencepiece, and
    data.path = null works where `datasets` cannot be imported (the GPU image)."""
    script = f"""
import sys
import ds_ppo.data, ds_ppo.data.prompts, ds_ppo.rewards.encode, ds_ppo.data.tokenizer
heavy = [m for m in ("datasets", "transformers", "sentencepiece") if m in sys.modules]
assert not heavy, heavy
sys.modules["datasets"] = None  # any import of datasets now fails
from ds_ppo.config import DataConfig
from ds_ppo.data.prompts import load_prompts
from ds_ppo.data.tokenizer import load_tokenizer
t = load_tokenizer("builtin:tiny", {str(Path(tok.name_or_path).parent)!r})
ps = load_prompts(DataConfig(), t)
print(len(ps), ps.texts[0])
"""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == str(len(builtin_prompts()))


def test_builtin_prompts(tok):
    prompts = builtin_prompts()
    assert prompts == builtin_prompts()  # deterministic
    assert len(prompts) == len(set(prompts)) > 500
    assert all(2 <= len(p.split()) <= 4 for p in prompts)
    ps = load_prompts(cfg(None), tok)
    assert ps.texts == prompts and all(ids[0] == tok.bos_token_id for ids in ps.input_ids)
    # a held-out slice for evaluation
    ev = load_prompts(cfg(None), tok, split="train[-10%:]")
    assert ev.texts == prompts[-round(len(prompts) * 0.1):]
    with pytest.raises(DataError, match="only the split 'train'"):
        load_prompts(cfg(None), tok, split="test")


# --------------------------------------------------------------------------------- chat
def test_chat_messages_rendered_with_the_chat_template(tok, tmp_path):
    convs = [[{"role": "system", "content": "be kind"}, {"role": "user", "content": "say hi"}],
             [{"role": "user", "content": "what a day"}]]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m, "id": i}
                                                 for i, m in enumerate(convs)])
    ps = load_prompts(cfg(path), tok)
    rendered = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                for m in convs]
    assert ps.texts == rendered == ["<s>system: be kind\nuser: say hi\nassistant:",
                                    "<s>user: what a day\nassistant:"]
    for ids, text in zip(ps.input_ids, rendered):
        # the template writes the BOS; tokenising must not add a second one
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    # the messages are kept, for a reward model that renders them with its own chat template
    assert ps.messages == convs and ps.chat(1) == convs[1]
    assert load_prompts(cfg(write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "hi"}])),
                        tok).messages is None
    # TRL's conversational format: chat messages in the prompt column
    write_jsonl(tmp_path / "trl.jsonl", [{"prompt": m} for m in convs])
    assert load_prompts(cfg(tmp_path / "trl.jsonl"), tok).texts == rendered
    # CSV cells can carry messages as JSON text
    import csv
    with (tmp_path / "chat.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        w.writerows([[json.dumps(m)] for m in convs])
    assert load_prompts(cfg(tmp_path / "chat.csv"), tok).texts == rendered
    # Parquet: messages as a list of structs
    import datasets
    datasets.Dataset.from_list([{"messages": m} for m in convs]).to_parquet(
        str(tmp_path / "chat.parquet"))
    assert load_prompts(cfg(tmp_path / "chat.parquet"), tok).texts == rendered


def test_deepspeed_chat_rows_use_the_prompt_column(tok, tmp_path):
    path = write_jsonl(tmp_path / "dschat.jsonl", dpo_rows())
    ps = load_prompts(cfg(path), tok)
    assert ps.texts == PROMPTS  # chosen / rejected are ignored


def test_custom_prompt_key(tok, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": p} for p in PROMPTS])
    assert load_prompts(cfg(path, prompt_key="question"), tok).texts == PROMPTS


# ----------------------------------------------------------------------------- bad input
def _bad_cases(d: Path) -> list[tuple[str, Path, dict, list[str]]]:
    """(name, file, extra config, substrings the DataError message must contain)."""
    import datasets

    cases = []

    def case(name, filename, content, must, **extra):
        p = d / filename
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        cases.append((name, p, extra, must))

    ok = json.dumps({"prompt": "the cat"}) + "\n"
    case("missing column", "nocol.jsonl", json.dumps({"text": "x", "label": 1}) + "\n",
         ["nocol.jsonl", "no column 'prompt'", "'messages'", "'text', 'label'"])
    case("missing column in one row", "nocol_row.jsonl", ok + json.dumps({"text": "x"}) + "\n",
         ["nocol_row.jsonl", "line 2", "missing column 'prompt'", "'text'"])
    case("non-string prompt", "int.jsonl", ok + ok + json.dumps({"prompt": 42}) + "\n",
         ["int.jsonl", "line 3", "column 'prompt'", "must be a string", "int 42"])
    case("null prompt", "null.jsonl", ok + json.dumps({"prompt": None}) + "\n",
         ["null.jsonl", "line 2", "column 'prompt'", "null"])
    case("empty prompt", "blank.jsonl", ok + json.dumps({"prompt": "   "}) + "\n",
         ["blank.jsonl", "line 2", "column 'prompt'", "empty prompt"])
    case("empty prompt csv", "blank.csv", "prompt,x\nthe cat,1\n,2\n",
         ["blank.csv", "line 3", "column 'prompt'", "empty prompt"])
    case("empty file jsonl", "empty.jsonl", "", ["empty.jsonl", "empty"])
    case("whitespace file", "ws.jsonl", "\n  \n", ["ws.jsonl", "empty"])
    case("empty file csv", "empty.csv", "", ["empty.csv", "empty"])
    case("header only csv", "header.csv", "prompt,chosen\n", ["header.csv", "no rows"])
    case("empty json list", "empty.json", "[]", ["empty.json", "empty"])
    case("not utf-8", "latin1.jsonl", (ok + '{"prompt": "caf\xe9"}\n').encode("latin-1"),
         ["latin1.jsonl", "line 2", "not UTF-8", "byte 0xe9 at column 16"])
    case("not utf-8 csv", "latin1.csv", 'prompt\nok\ncaf\xe9\n'.encode("latin-1"),
         ["latin1.csv", "line 3", "not UTF-8", "byte 0xe9"])
    case("not utf-8 json document", "latin1.json",
         '[{"prompt": "a"},\n {"prompt": "caf\xe9"}]'.encode("latin-1"),
         ["latin1.json", "line 2", "not UTF-8", "byte 0xe9 at column 17"])
    case("corrupt parquet", "bad.parquet", b"PAR1 this is not parquet",
         ["bad.parquet", "cannot read it as Parquet"])
    case("malformed JSON line", "broken.jsonl", ok + '{"prompt": "the dog\n' + ok,
         ["broken.jsonl", "line 2", "malformed JSON"])
    case("malformed JSON document", "broken.json", '[{"prompt": "a"},\n {"prompt": }]',
         ["broken.json", "line 2", "malformed JSON"])
    case("JSON line not an object", "list.jsonl", ok + "[1, 2]\n",
         ["list.jsonl", "line 2", "expected a JSON object"])
    case("csv wrong field count", "fields.csv", "prompt,x\nthe cat,1\nthe,dog,2\n",
         ["fields.csv", "line 3", "3 fields", "header has 2"])
    case("chat bad role", "role.jsonl", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}) + "\n",
        ["role.jsonl", "line 1", "column 'messages'", "message 2", "bad role 'bot'",
         "system, user, assistant"])
    case("chat no role", "norole.jsonl", json.dumps({"messages": [{"content": "hi"}]}) + "\n",
         ["norole.jsonl", "line 1", "column 'messages'", "message 1", "no role"])
    case("chat content not a string", "content.jsonl", json.dumps(
        {"messages": [{"role": "user", "content": ["hi"]}]}) + "\n",
        ["content.jsonl", "line 1", "column 'messages'", "content must be a string"])
    case("chat not a list", "notlist.jsonl", json.dumps({"messages": "hello"}) + "\n",
         ["notlist.jsonl", "line 1", "column 'messages'"])
    case("chat empty", "emptychat.jsonl", json.dumps({"messages": []}) + "\n",
         ["emptychat.jsonl", "line 1", "column 'messages'", "empty list"])
    case("chat all empty content", "emptycontent.jsonl", json.dumps(
        {"messages": [{"role": "user", "content": " "}]}) + "\n",
        ["emptycontent.jsonl", "line 1", "column 'messages'", "empty prompt"])
    case("unknown ending", "prompts.txt", "the cat\n", ["prompts.txt", "data.format"])
    # Parquet rows are numbered as rows
    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": ""}]).to_parquet(
        str(d / "rows.parquet"))
    cases.append(("parquet empty prompt", d / "rows.parquet", {},
                  ["rows.parquet", "row 2", "column 'prompt'", "empty prompt"]))
    cases.append(("file not found", d / "missing.jsonl", {}, ["missing.jsonl", "not found"]))
    return cases


def test_every_bad_case_names_file_row_and_column(tok, tmp_path):
    for name, path, extra, must in _bad_cases(tmp_path):
        with pytest.raises(DataError) as err:
            load_prompts(cfg(path, **extra), tok)
        msg = str(err.value)
        for piece in must:
            assert piece in msg, f"{name}: {piece!r} not in {msg!r}"
        assert isinstance(err.value, UserError)  # the CLI prints it and exits 2, no traceback


def test_error_lists_the_first_bad_rows_and_counts_the_rest(tok, tmp_path):
    rows = [{"prompt": "ok"}] + [{"prompt": i} for i in range(9)]
    with pytest.raises(DataError) as err:
        load_prompts(cfg(write_jsonl(tmp_path / "many.jsonl", rows)), tok)
    msg = str(err.value)
    assert "9 bad row(s)" in msg and "line 2" in msg and "line 6" in msg
    assert "line 7" not in msg and "and 4 more" in msg and "on_bad_row=skip" in msg


def test_skip_counts_bad_rows(tok, tmp_path, caplog):
    text = "\n".join([
        json.dumps({"prompt": "the cat sat"}),
        json.dumps({"prompt": 7}),                       # non-string
        json.dumps({"prompt": ""}),                      # empty
        '{"prompt": "broken',                            # malformed JSON
        json.dumps({"other": "x"}),                      # missing column
        json.dumps({"prompt": [{"role": "robot", "content": "x"}]}),  # bad role
        json.dumps({"prompt": "what a"}),
    ]) + "\n"
    (tmp_path / "mixed.jsonl").write_text(text)
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        ps = load_prompts(cfg(tmp_path / "mixed.jsonl", on_bad_row="skip"), tok)
    assert ps.texts == ["the cat sat", "what a"]
    assert ps.stats["rows"] == 7 and ps.stats["skipped_bad"] == 5 and ps.stats["used"] == 2
    assert "skipped 5 bad row(s)" in caplog.text and "line 4" in caplog.text
    assert "5 bad rows skipped" in caplog.text  # the one-line summary

    # undecodable lines (not UTF-8) are bad rows like any other
    (tmp_path / "latin1.jsonl").write_bytes(
        b'{"prompt": "the cat sat"}\n' + '{"prompt": "caf\xe9 au lait"}\n'.encode("latin-1"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        ps = load_prompts(cfg(tmp_path / "latin1.jsonl", on_bad_row="skip"), tok)
    assert ps.texts == ["the cat sat"] and ps.stats["skipped_bad"] == 1
    assert "line 2: not UTF-8 text (byte 0xe9 at column 16" in caplog.text

    # CSV rows with a wrong number of fields are skipped too
    (tmp_path / "f.csv").write_text("prompt,x\nthe cat,1\nthe,dog,2\n,3\n")
    ps = load_prompts(cfg(tmp_path / "f.csv", on_bad_row="skip"), tok)
    assert ps.texts == ["the cat"] and ps.stats["skipped_bad"] == 2


def test_skip_still_stops_on_whole_file_problems(tok, tmp_path):
    skip = {"on_bad_row": "skip"}
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_prompts(cfg(tmp_path / "empty.jsonl", **skip), tok)
    write_jsonl(tmp_path / "nocol.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match="no column 'prompt'"):
        load_prompts(cfg(tmp_path / "nocol.jsonl", **skip), tok)
    with pytest.raises(DataError, match="not found"):
        load_prompts(cfg(tmp_path / "missing.jsonl", **skip), tok)
    write_jsonl(tmp_path / "allbad.jsonl", [{"prompt": 1}, {"prompt": ""}])
    with pytest.raises(DataError, match="no prompts left") as err:
        load_prompts(cfg(tmp_path / "allbad.jsonl", **skip), tok)
    assert "allbad.jsonl" in str(err.value) and "2 bad rows skipped" in str(err.value)


def test_chat_rows_need_a_chat_template(tok, tmp_path):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError, match="no chat template"):
        load_prompts(cfg(path), plain)


# ------------------------------------------------------------------------ max_prompt_len
def test_truncate_left_keeps_the_end_and_the_bos(tok, tmp_path):
    long_prompt = "the cat sat in the park and the dog ran to the wonderful beach"
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": long_prompt}, {"prompt": "what a"}])
    full = tok(long_prompt)["input_ids"]
    ps = load_prompts(cfg(path, max_prompt_len=5, truncation="left"), tok)
    assert ps.input_ids[0] == [tok.bos_token_id] + full[-4:]
    assert ps.texts[0] == tok.decode(full[-4:]) and long_prompt.endswith(ps.texts[0])
    assert ps.input_ids[1] == tok("what a")["input_ids"]
    assert ps.stats["truncated"] == 1 and ps.stats["used"] == 2 and ps.stats["longest"] == 5


def test_drop_counts_long_prompts(tok, tmp_path, caplog):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "the cat sat in the park"},
                                                 {"prompt": "what a"}, {"prompt": "we had a"}])
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        ps = load_prompts(cfg(path, max_prompt_len=5, truncation="drop"), tok)
    assert ps.texts == ["what a", "we had a"]
    assert ps.stats["dropped_too_long"] == 1 and ps.stats["truncated"] == 0
    assert "1 dropped as longer than 5 tokens" in caplog.text
    with pytest.raises(DataError, match="no prompts left"):
        load_prompts(cfg(path, max_prompt_len=2, truncation="drop"), tok)


def test_format_stats():
    line = format_stats({"rows": 10, "used": 6, "truncated": 1, "dropped_too_long": 2,
                         "skipped_bad": 2, "max_prompt_len": 8, "longest": 8})
    assert line == ("10 rows, 6 used (longest 8 tokens), 1 truncated to their last 8 tokens, "
                    "2 dropped as longer than 8 tokens, 2 bad rows skipped")


# -------------------------------------------------------------------------------- splits
def test_splits_and_eval_split(tok, tmp_path):
    paths = write_all_formats(tmp_path)
    diskdict = paths["disk-dict"][0]
    c = cfg(diskdict, eval_split="test")
    assert load_prompts(c, tok, split=c.eval_split).texts == PROMPTS[:1]
    with pytest.raises(DataError, match="no split 'valid'"):
        load_prompts(c, tok, split="valid")
    # a single file is split 'train'; slices select rows (row numbers stay the file's)
    jsonl = paths["jsonl"][0]
    assert load_prompts(cfg(jsonl), tok, split="train[:40%]").texts == PROMPTS[:2]
    assert load_prompts(cfg(jsonl), tok, split="train[2:]").texts == PROMPTS[2:]
    with pytest.raises(DataError, match="single split named 'train'"):
        load_prompts(cfg(jsonl), tok, split="test")
    # the eval split may be another file
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "what a"}])
    c = cfg(jsonl, eval_split=str(ev))
    assert load_prompts(c, tok, split=c.eval_split).texts == ["what a"]
    # a directory with one file per split
    (tmp_path / "splits").mkdir()
    write_jsonl(tmp_path / "splits" / "train.jsonl", [{"prompt": p} for p in PROMPTS])
    (tmp_path / "splits" / "test.csv").write_text("prompt\nwhat a\n")
    c = cfg(tmp_path / "splits", eval_split="test")
    assert load_prompts(c, tok).texts == PROMPTS
    assert load_prompts(c, tok, split=c.eval_split).texts == ["what a"]
    (tmp_path / "splits" / "bad.jsonl").write_text('{"prompt": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: 1 bad row\(s\)[^\n]*\n  line 1: column"):
        load_prompts(c, tok, split="bad")
    # a slice holding only bad rows is an error; bad rows outside it do not matter
    write_jsonl(tmp_path / "half.jsonl", [{"prompt": "a b"}, {"prompt": 3}])
    assert load_prompts(cfg(tmp_path / "half.jsonl"), tok, split="train[:1]").texts == ["a b"]
    with pytest.raises(DataError, match="line 2"):
        load_prompts(cfg(tmp_path / "half.jsonl"), tok, split="train[1:]")


def test_parse_and_slice_split():
    assert parse_split("train") == ("train", None, None)
    assert parse_split("train[10%:-5]") == ("train", "10%", "-5")
    with pytest.raises(DataError):
        parse_split("train+test")
    assert slice_rows(10, None, None) == range(0, 10)
    assert slice_rows(10, "-3", None) == range(7, 10)
    assert slice_rows(10, None, "90%") == range(0, 9)
    assert slice_rows(10, "8", "2") == range(8, 8)


# ------------------------------------------------------------------------------- sampler
def test_two_ranks_cover_every_prompt_once_per_epoch():
    n, batch = 12, 4  # 3 iterations per epoch
    ranks = [PromptSampler(n, batch, r, 2, seed=7) for r in range(2)]
    for epoch in range(3):
        seen = []
        for it in range(epoch * 3, epoch * 3 + 3):
            a, b = ranks[0].indices(it), ranks[1].indices(it)
            assert len(a) == len(b) == 2 and not set(a) & set(b)  # no overlap
            seen += a + b
        assert sorted(seen) == list(range(n)), epoch  # each prompt exactly once


def test_one_rank_batch_is_the_two_ranks_concatenated():
    one = PromptSampler(10, 4, 0, 1, seed=3)
    two = [PromptSampler(10, 4, r, 2, seed=3) for r in range(2)]
    four = [PromptSampler(10, 4, r, 4, seed=3) for r in range(4)]
    for it in range(12):  # batches straddle epoch boundaries (10 is not a multiple of 4)
        assert one.indices(it) == two[0].indices(it) + two[1].indices(it) == one.global_indices(it)
        assert one.indices(it) == sum((s.indices(it) for s in four), [])


def test_epochs_use_different_permutations_and_straddle():
    s = PromptSampler(10, 4, 0, 1, seed=0)
    stream = sum((s.indices(i) for i in range(10)), [])  # 40 positions = 4 epochs
    epochs = [stream[k * 10:(k + 1) * 10] for k in range(4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # reshuffled each epoch
    # deterministic from the seed alone (resume needs only the iteration)
    assert PromptSampler(10, 4, 0, 1, seed=0).indices(7) == s.indices(7)
    assert PromptSampler(10, 4, 0, 1, seed=1).indices(0) != s.indices(0)
    assert PromptSampler(10, 4, 0, 1, seed=0, shuffle=False).indices(2) == [8, 9, 0, 1]


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        PromptSampler(10, 6, 0, 4, seed=0)
    with pytest.raises(ValueError, match="rank"):
        PromptSampler(10, 4, 2, 2, seed=0)
    with pytest.raises(ValueError):
        PromptSampler(0, 4, 0, 1, seed=0)


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_sampler_groups_by_minibatch_invariant_to_world_size():
    """Mini-batch j (the j-th G/W samples of each rank) is the same set of prompts for W=1,2,4."""
    G, B = 8, 32

    def minibatches(world):
        ranks = [PromptSampler(100, B, r, world, seed=3, group_size=G) for r in range(world)]
        share = G // world
        out = []
        for j in range(B // G):
            out.append(sorted(sum((s.indices(5)[j * share:(j + 1) * share] for s in ranks), [])))
        return out

    assert minibatches(1) == minibatches(2) == minibatches(4)
    two = [PromptSampler(100, B, r, 2, seed=3, group_size=G) for r in range(2)]
    assert sorted(two[0].indices(5) + two[1].indices(5)) == sorted(two[0].global_indices(5))
    with pytest.raises(ValueError):
        PromptSampler(100, B, 0, 3, seed=3, group_size=G)


# ------------------------------------------------------------------------- reward columns
def test_reward_keys_follow_their_prompts(tok, tmp_path, caplog):
    """data.reward_keys values stay with their prompt through bad rows skipped, prompts dropped
    as too long, and in a CSV too."""
    rows = [{"prompt": p, "answer": i, "note": f"n{i}"} for i, p in enumerate(PROMPTS)]
    rows.insert(2, {"prompt": 7, "answer": 99, "note": "bad"})  # not text: skipped
    rows[4] = {"prompt": rows[4]["prompt"]}  # no answer: skipped
    rows.append({"prompt": "a " * 40, "answer": 100, "note": "long"})  # dropped as too long
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        got = load_prompts(cfg(path, reward_keys=["answer", "note"], on_bad_row="skip",
                               truncation="drop", max_prompt_len=12), tok)
    assert "missing column 'answer'" in caplog.text
    assert [(t, e) for t, e in zip(got.texts, got.extras)] == [
        (PROMPTS[i], {"answer": i, "note": f"n{i}"}) for i in (0, 1, 2, 4)]
    assert got.extra(1) == {"answer": 1, "note": "n1"}
    import csv

    with open(tmp_path / "p.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "answer"])
        w.writeheader()
        w.writerows({"prompt": p, "answer": f"a{i}"} for i, p in enumerate(PROMPTS))
    got = load_prompts(cfg(tmp_path / "p.csv", reward_keys=["answer"]), tok)
    assert got.extras == [{"answer": f"a{i}"} for i in range(len(PROMPTS))]
    assert load_prompts(cfg(path, on_bad_row="skip"), tok).extra(0) == {}  # none asked for


def test_reward_keys_missing_column_or_value(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": 1} for p in PROMPTS[:2]]
                       + [{"prompt": "no answer here"}, {"prompt": "null", "answer": None}])
    with pytest.raises(DataError, match=r"no column 'solution' \(data.reward_keys\).*'answer'"):
        load_prompts(cfg(path, reward_keys=["solution"]), tok)
    with pytest.raises(DataError, match=r"line 3: missing column 'answer'.*\n.*line 4: "
                                        r"column 'answer' \(data.reward_keys\) is null"):
        load_prompts(cfg(path, reward_keys=["answer"]), tok)
