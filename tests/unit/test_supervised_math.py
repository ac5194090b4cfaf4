"""The supervised jobs' pure parts: their losses (hand-worked), their rows (data/supervised_rows.py:
prompt + completion, chat with assistant-only loss, preference pairs, bad rows, long rows), their
config checks and the digit-sum task of the recipe (envs/addition.py)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ds_ppo.algo import bradley_terry, nll_sum, pair_stats, reward_centering
from ds_ppo.config import job_accum_steps, load_config, validate, validate_job
from ds_ppo.data.supervised_rows import chat_ids, load_pairs, load_sft
from ds_ppo.data.tokenizer import load_tokenizer
from ds_ppo.envs import addition
from ds_ppo.errors import ConfigError, DataError
from ds_ppo.bench.stand_ins import small_llama


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("builtin:tiny", tmp_path_factory.mktemp("cache"))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path, *extra):
    return load_config(None, [f"data.path={path}", *extra])


# ------------------------------------------------------------------------------ losses
def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    expected = [-math.log(1 / (1 + math.exp(-1.0))), -math.log(1 / (1 + math.exp(1.0)))]
    assert bradley_terry(chosen, rejected).tolist() == pytest.approx(expected, rel=1e-6)
    # a margin of 1 moves the first pair's difference from 1 to 0: log 2
    with_margin = bradley_terry(chosen, rejected, torch.tensor([1.0, 0.0]))
    assert with_margin[0].item() == pytest.approx(math.log(2), rel=1e-6)
    stats = pair_stats(chosen, rejected)
    assert stats["correct"].item() == 1 and stats["margin"].item() == pytest.approx(0.0)
    assert stats["ties"].item() == 0
    # a tie is neither right nor wrong: counted apart
    stats = pair_stats(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([1.0, 0.0, 0.5]))
    assert (stats["correct"].item(), stats["ties"].item()) == (1, 1)


def test_reward_centering_by_hand_and_in_the_rm_loss(tok, tmp_path):
    """rm.center_coef adds coef x (r_chosen + r_rejected)^2 per pair to the summed
    Bradley-Terry loss of a micro-batch; the `center` statistic is logged either way."""
    from types import SimpleNamespace

    from ds_ppo.data.supervised_rows import load_pairs
    from ds_ppo.rm import RMTask

    assert reward_centering(torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.5])).tolist() == \
        pytest.approx([9.0, 0.25])
    path = _write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                         {"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    scores = torch.tensor([2.0, -1.0, 1.0, 0.5])  # chosen 0, chosen 1, rejected 0, rejected 1
    role = SimpleNamespace(engine=SimpleNamespace(module=torch.nn.Linear(1, 1)),
                           scores=lambda ids, am: scores)
    bt = bradley_terry(scores[:2], scores[2:]).sum().item()
    for coef in (0.0, 0.5):
        cfg = _cfg(path, f"rm.center_coef={coef}")
        data = load_pairs(cfg, tok)
        loss, stats = RMTask().loss(cfg, role, data, [0, 1], pad_id=0)
        assert loss.item() == pytest.approx(bt + coef * 9.25, rel=1e-6)
        assert stats["center"][0].item() == pytest.approx(9.25)


def test_nll_sum_is_a_sum():
    assert nll_sum(torch.tensor([-1.0, -0.5, -2.0])).item() == pytest.approx(3.5)


# -------------------------------------------------------------------------------- rows
def test_sft_prompt_completion_rows_learn_the_completion_and_eos(tmp_path, tok):
    path = _write(tmp_path / "d.jsonl", [{"prompt": "the cat", "completion": "sat on a mat"}])
    data = load_sft(_cfg(path), tok)
    p = tok("the cat")["input_ids"]
    c = tok("sat on a mat", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert data.ids == [p + c]
    assert data.loss_mask == [[False] * len(p) + [True] * len(c)]
    assert data.counted([0]) == len(c)


def test_sft_chat_rows_learn_the_assistant_turns_only(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good day"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "love"}]
    ids, mask = chat_ids(tok, msgs, "messages")
    assert ids[-1] == tok.eos_token_id and mask[-1]
    learned = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert "good day" in learned and "love" in learned
    assert "hi" not in learned and "and?" not in learned
    # the unlearned tokens are exactly the prompts the chat template renders before each turn
    first = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    n = len(tok(first, add_special_tokens=False)["input_ids"])
    assert not any(mask[:n]) and mask[n]


def test_sft_bad_rows_error_or_skip_and_long_rows_drop(tmp_path, tok):
    rows = [{"prompt": "the cat", "completion": "sat"}, {"prompt": "a", "completion": 3},
            {"prompt": "my aunt", "completion": " ".join(["happy"] * 40)},
            {"prompt": "the sun"}]
    path = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"(?s)2 bad row\(s\).*line 2: column 'completion' must be "
                       r"a string.*line 4: missing column 'completion'"):
        load_sft(_cfg(path), tok)
    data = load_sft(_cfg(path, "data.on_bad_row=skip", "sft.max_len=20"), tok)
    assert len(data) == 1
    assert data.stats == {"rows": 4, "used": 1, "dropped_too_long": 1, "skipped_bad": 2,
                          "max_len": 20, "longest": len(data.ids[0])}


def test_sft_messages_column_and_a_chat_without_assistant(tmp_path, tok):
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "good"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}]}
    path = _write(tmp_path / "d.jsonl", [good, bad])
    with pytest.raises(DataError, match="line 2: column 'messages': no assistant message"):
        load_sft(_cfg(path), tok)
    assert len(load_sft(_cfg(path, "data.on_bad_row=skip"), tok)) == 1


def test_pairs_with_prompt_margin_and_chat_forms(tmp_path, tok):
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "the cat", "chosen": "sat", "rejected": "sun", "m": 0.5},
        {"prompt": "the cat", "chosen": "sat", "rejected": "sun", "m": "x"}])
    with pytest.raises(DataError, match=r"line 2: column 'm' \(rm.margin_key\) must be a number"):
        load_pairs(_cfg(path, "rm.margin_key=m"), tok)
    pairs = load_pairs(_cfg(path, "rm.margin_key=m", "data.on_bad_row=skip"), tok)
    p = tok("the cat")["input_ids"]
    assert pairs.chosen == [p + tok("sat", add_special_tokens=False)["input_ids"]
                            + [tok.eos_token_id]]
    assert pairs.margin == [0.5]
    chat = _write(tmp_path / "c.jsonl", [{
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "sad"}]}])
    pairs = load_pairs(_cfg(chat), tok)
    assert pairs.margin is None and pairs.chosen[0][-1] == tok.eos_token_id
    assert pairs.chosen[0] != pairs.rejected[0]
    with pytest.raises(DataError, match=r"no column 'rejected'"):
        load_pairs(_cfg(_write(tmp_path / "x.jsonl", [{"chosen": "a"}])), tok)


def test_pairs_mark_their_answers_tokens_for_dpo(tmp_path, tok):
    """`ds-ppo dpo` scores an answer's tokens only: after a prompt, the answer and its EOS; a
    whole chat, its assistant turns (and the EOS); text without a prompt, every token. Its own
    section's columns (dpo.chosen_key) name the answers."""
    path = _write(tmp_path / "p.jsonl", [{"prompt": "the cat", "good": "sat on", "bad": "sun"}])
    pairs = load_pairs(_cfg(path, "dpo.chosen_key=good", "dpo.rejected_key=bad"), tok,
                       job="dpo")
    p, a = tok("the cat")["input_ids"], tok("sat on", add_special_tokens=False)["input_ids"]
    assert pairs.chosen == [p + a + [tok.eos_token_id]]
    assert pairs.chosen_mask == [[False] * len(p) + [True] * (len(a) + 1)]
    assert [len(m) for m in pairs.rejected_mask] == [len(r) for r in pairs.rejected]
    chat = _write(tmp_path / "c.jsonl", [{
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "sad"}]}])
    pairs = load_pairs(_cfg(chat), tok, job="dpo")
    ids, mask = chat_ids(tok, json.loads(chat.read_text())["chosen"], "chosen")
    assert pairs.chosen_mask[0][:len(mask)] == mask and pairs.chosen_mask[0][-1]
    assert not pairs.chosen_mask[0][0]
    text = _write(tmp_path / "t.jsonl", [{"chosen": "a b", "rejected": "b a"}])
    assert all(load_pairs(_cfg(text), tok, job="dpo").chosen_mask[0])


def test_an_empty_completion_is_named_as_one(tmp_path, tok):
    path = _write(tmp_path / "d.jsonl", [{"prompt": "hi", "completion": "  "}])
    with pytest.raises(DataError, match="line 1: column 'completion' is an empty answer"):
        load_sft(_cfg(path), tok)


def test_a_pair_whose_answers_are_the_same_is_a_bad_row(tmp_path, tok):
    """chosen == rejected teaches nothing (log 2 whatever the model) and would score as a tie:
    a bad row (data.on_bad_row), named; all-identical data is refused, not trained on."""
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "the cat", "chosen": "sat", "rejected": "sun"},
        {"prompt": "the cat", "chosen": "sat", "rejected": "sat"}])
    with pytest.raises(DataError, match=r"line 2: columns 'chosen' and 'rejected' are the same "
                                        r"answer"):
        load_pairs(_cfg(path), tok)
    pairs = load_pairs(_cfg(path, "data.on_bad_row=skip"), tok)
    assert len(pairs) == 1 and pairs.stats["skipped_bad"] == 1
    same = _write(tmp_path / "s.jsonl", [{"chosen": "a b", "rejected": "a b"}] * 3)
    with pytest.raises(DataError):
        load_pairs(_cfg(same, "data.on_bad_row=skip"), tok)


# ------------------------------------------------------------------------------ config
def test_job_config_checks_name_key_and_fix():
    cfg = load_config(None, ["sft.batch_size=12", "sft.micro_batch_size=4"])
    with pytest.raises(ConfigError) as e:
        validate_job(cfg, "sft", 2)
    assert "sft.batch_size = 12 must be a multiple of sft.micro_batch_size * world size" in \
        str(e.value) and "data.path = None" in str(e.value)
    cfg = load_config(None, ["data.path=x.jsonl", "rm.batch_size=16", "rm.micro_batch_size=4",
                             "rm.rejected_key=chosen", "policy.lora.r=8"])
    with pytest.raises(ConfigError, match="rm.chosen_key = rm.rejected_key") as e:
        validate_job(cfg, "rm", 2)
    assert "lora" not in str(e.value)  # a LoRA reward model trains (test_supervised.py)
    assert job_accum_steps(cfg, "rm", 2) == 2
    ok = load_config(None, ["data.path=x.jsonl", "sft.batch_size=16", "sft.micro_batch_size=4"])
    validate_job(ok, "sft", 2)


def test_dpo_checks_name_key_and_fix(tmp_path, capsys):
    """The dpo section's rules: label smoothing has no meaning for ipo's squared loss (refused),
    a reference path is unused by simpo (a warning), the pair columns as rm's; `--dry-run` reads
    the rows through the dpo section's columns and checks its reference path exists."""
    from ds_ppo.cli import main

    cfg = load_config(None, ["data.path=x.jsonl", "dpo.loss=ipo", "dpo.label_smoothing=0.1",
                             "dpo.rejected_key=chosen"])
    with pytest.raises(ConfigError) as e:
        validate_job(cfg, "dpo", 1)
    assert "dpo.label_smoothing = 0.1 does not apply to dpo.loss = 'ipo'" in str(e.value)
    assert "dpo.chosen_key = dpo.rejected_key = 'chosen'" in str(e.value)
    validate(cfg, 1)  # `ds-ppo train` does not read the dpo section: its rules are dpo's
    with pytest.raises(ConfigError, match="dpo.label_smoothing = 0.5: Input should be less"):
        load_config(None, ["dpo.label_smoothing=0.5"])
    rows = _write(tmp_path / "p.jsonl", [{"prompt": "a", "good": "b", "bad": "c"}])
    base = ["dpo", "--dry-run", f"data.path={rows}", "dpo.batch_size=8",
            "dpo.micro_batch_size=4", f"output_dir={tmp_path / 'out'}"]
    assert main(base + ["dpo.chosen_key=good", "dpo.rejected_key=bad", "dpo.loss=simpo",
                        f"dpo.reference_path={tmp_path}"]) == 0
    out = capsys.readouterr()
    assert f"dpo.reference_path = '{tmp_path}' is unused: dpo.loss = 'simpo'" in out.err
    assert main(base) == 2  # the default columns are not in the file
    assert "no column 'chosen'" in capsys.readouterr().err
    assert main(base + ["dpo.chosen_key=good", "dpo.rejected_key=bad",
                        "dpo.reference_path=/no/such/model"]) == 2
    assert "dpo.reference_path = '/no/such/model': no such file" in capsys.readouterr().err


# -------------------------------------------------------------------------------- task
def test_digit_sum_task_files_are_disjoint_and_checked(tmp_path):
    paths = addition.write_task(tmp_path, seed=3, terms=2, test=20, sft=30)
    read = {n: [json.loads(line) for line in p.read_text().splitlines()]
            for n, p in paths.items()}
    test = {r["prompt"] for r in read["test.jsonl"]}
    assert len(test) == 20 and not test & {r["prompt"] for r in read["rl.jsonl"]}
    assert not test & {r["prompt"] for r in read["pairs.jsonl"]}
    assert len(read["rl.jsonl"]) == 80 and len(read["sft.jsonl"]) == 30
    for r in read["sft.jsonl"]:
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["completion"] == str(int(a) + int(b))
    assert all(p["chosen"] != p["rejected"] for p in read["pairs.jsonl"])
    assert addition.exact_match([], [" 13", "14", "13 "], ["13", "13", "13"]) == [1.0, 0.0, 1.0]


# --------------------------------------------------------------------- commands
def test_dry_run_and_plan_of_the_jobs(tmp_path, capsys):
    from ds_ppo.cli import main

    rows = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    assert main(["sft", "--dry-run", f"data.path={rows}"]) == 0
    assert "config OK for world size 1" in capsys.readouterr().out
    assert main(["rm", "--dry-run", f"data.path={tmp_path / 'none.jsonl'}"]) == 2
    assert "data.path = " in capsys.readouterr().err
    assert main(["sft", "--dry-run", f"data.path={rows}", "sft.batch_size=12"]) == 2
    assert "sft.batch_size = 12 must be a multiple" in capsys.readouterr().err
    # the plan: the one trained model, its micro-batch (rm: chosen + rejected rows)
    assert main(["plan", "--job", "rm", "--json", "rm.micro_batch_size=4", "rm.max_len=64"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["job"] == "rm" and plan["micro_batch"] == {"rows": 8, "tokens": 64}
    assert main(["plan", "--job", "sft", "sft.micro_batch_tokens=256"]) == 0
    out = capsys.readouterr().out
    assert "ds-ppo sft plan" in out and "1 row(s) x 512 tokens" in out and "fits" in out


def test_steps_epochs_completion_key_and_pair_length(tmp_path, tok):
    from ds_ppo.jobs.supervised.training import total_steps

    cfg = load_config(None, ["sft.epochs=3", "sft.batch_size=8"])
    assert total_steps(cfg.sft, 20) == 3 * 2  # whole global batches per epoch
    assert total_steps(load_config(None, ["sft.steps=5"]).sft, 20) == 5
    path = _write(tmp_path / "d.jsonl", [{"prompt": "the cat", "answer": "sat"}])
    with pytest.raises(DataError, match="no column 'messages'"):
        load_sft(_cfg(path), tok)  # no `completion` column: the rows would have to be chats
    assert load_sft(_cfg(path, "sft.completion_key=answer"), tok).counted([0]) == \
        len(tok("sat", add_special_tokens=False)["input_ids"]) + 1
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                           {"prompt": "a", "chosen": "b " * 30, "rejected": "c"}])
    data = load_pairs(_cfg(pairs, "rm.max_len=10"), tok)
    assert len(data) == 1 and data.stats["dropped_too_long"] == 1


def test_reward_model_picks_is_the_argmax_over_every_sum(tmp_path, tok):
    """`addition.reward_model_picks` (batched by answer width) against each of the 28 answers
    scored alone, on a random tiny sequence classifier that saves and loads like an export."""
    from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

    model = small_llama(LlamaForSequenceClassification, vocab_size=len(tok), num_labels=1,
                        pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    test = _write(tmp_path / "test.jsonl", [{"prompt": p, "answer": a} for p, a in
                                            addition.problems(3)[::37]])
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    right = 0
    for line in test.read_text().splitlines():
        r = json.loads(line)
        scores = []
        for s in range(28):
            ids = tok(r["prompt"])["input_ids"] + tok(str(s), add_special_tokens=False)[
                "input_ids"] + [tok.eos_token_id]
            with torch.no_grad():
                scores.append(rm(torch.tensor([ids])).logits[0, 0].item())
        right += max(range(28), key=scores.__getitem__) == int(r["answer"])
    expected = right / len(test.read_text().splitlines())
    assert addition.reward_model_picks(tmp_path / "rm", test) == pytest.approx(expected)
