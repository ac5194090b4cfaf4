"""The teacher and distill sections: `--dry-run` refuses, one line each, a distill estimator
without a teacher, a teacher without the distill estimator, a teacher whose tokenizer has
another vocabulary, and the reward mix without groups; a teacher of the student's vocabulary
passes."""
from __future__ import annotations

import json

import pytest

from ds_ppo.cli import main
from ds_ppo.config import load_config, uses_reference, validate
from ds_ppo.errors import ConfigError

DISTILL = ["ppo.advantage_estimator=distill", "ppo.kl_loss_coef=0"]


def _dry_run(capsys, *overrides: str) -> tuple[int, list[str]]:
    """The exit code and the problems the dry run names (one line each)."""
    rc = main(["train", "--dry-run", "output_dir=out", *overrides])
    lines = [line for line in capsys.readouterr().err.splitlines()
             if not line.startswith("ds-ppo: warning")]
    assert not any("Traceback" in line for line in lines), lines
    if lines and lines[0].endswith("invalid config:"):
        return rc, [line.strip() for line in lines[1:]]
    return rc, [line for line in lines if line.startswith("ds-ppo: error")]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A teacher directory with the student's tokenizer (builtin:tiny) and one whose vocabulary
    has two tokens' ids swapped."""
    from ds_ppo.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("teachers")
    tok = load_tokenizer("builtin:tiny", root / "cache")
    same, other = root / "same", root / "other"
    tok.save_pretrained(same)
    tok.save_pretrained(other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]  # piece -> id
    a, b = (next(t for t, i in vocab.items() if i == k) for k in (10, 11))
    vocab[a], vocab[b] = 11, 10
    (other / "tokenizer.json").write_text(json.dumps(spec))
    return root


def test_distill_without_a_teacher_is_refused_in_one_line(capsys):
    rc, lines = _dry_run(capsys, *DISTILL)
    assert rc == 2
    assert len(lines) == 1 and "teacher.path is not set" in lines[0], lines


def test_a_teacher_without_distill_is_refused_in_one_line(capsys, tokenizers):
    rc, lines = _dry_run(capsys, f"teacher.path={tokenizers / 'same'}")
    assert rc == 2
    assert len(lines) == 1 and "reads no teacher" in lines[0], lines
    assert "ppo.advantage_estimator=distill" in lines[0]


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(capsys, tokenizers,
                                                                   monkeypatch):
    monkeypatch.chdir(tokenizers)  # builtin:tiny cached under out/
    rc, lines = _dry_run(capsys, *DISTILL, f"teacher.path={tokenizers / 'other'}")
    assert rc == 2
    assert len(lines) == 1 and "another vocabulary than the student's" in lines[0], lines
    assert "2 of 512" in lines[0]


def test_a_teacher_with_the_students_vocabulary_passes(capsys, tokenizers, monkeypatch):
    monkeypatch.chdir(tokenizers)
    rc, lines = _dry_run(capsys, *DISTILL, f"teacher.path={tokenizers / 'same'}")
    assert rc == 0, lines


def test_the_reward_mix_needs_groups():
    cfg = load_config("tiny", [*DISTILL, "teacher.arch.model_type=llama",
                               "distill.reward_coef=0.5"])
    with pytest.raises(ConfigError, match="distill.reward_coef = 0.5 .*samples_per_prompt"):
        validate(cfg, 1)
    validate(load_config("tiny", [*DISTILL, "teacher.arch.model_type=llama",
                                  "distill.reward_coef=0.5", "ppo.samples_per_prompt=2",
                                  "ppo.mini_batch_size=16"]), 1)


def test_the_kl_goes_in_the_loss_and_the_reference_only_with_it():
    with pytest.raises(ConfigError, match="ppo.kl_in_reward=false"):
        validate(load_config("tiny", [*DISTILL, "teacher.arch.model_type=llama",
                                      "ppo.kl_in_reward=true"]), 1)
    cfg = load_config("tiny", [*DISTILL, "teacher.arch.model_type=llama"])
    assert not cfg.ppo.kl_in_reward and not uses_reference(cfg)
    assert uses_reference(load_config("tiny", ["ppo.advantage_estimator=distill",
                                               "ppo.kl_loss_coef=0.01"]))
    assert uses_reference(load_config("tiny"))


def test_distill_settings_without_distillation_are_warned_as_ignored():
    from ds_ppo.config import config_warnings

    [line] = [w for w in config_warnings(load_config("tiny", ["distill.reward_coef=0.5"]))
              if "distill" in w]
    assert line.startswith("distill.reward_coef: read by on-policy distillation only")
    cfg = load_config("tiny", [*DISTILL, "teacher.arch.model_type=llama", "distill.discount=1"])
    assert not [w for w in config_warnings(cfg) if "distill." in w]


def test_plan_sizes_the_teacher_and_leaves_out_the_reference():
    """`ds-ppo plan --config distill`: the 8B-shape teacher's frozen 16-bit weights and its
    scoring forward are planned, the reference (no KL loss) and the value model are not; with a
    KL loss the reference is back."""
    from ds_ppo import plan as P

    GiB = 2**30
    cluster = P.Cluster(1, 8, 80 * GiB)
    cfg = load_config("distill")
    plan = P.plan(cfg, cluster)
    assert set(P.to_json(plan)["roles"]) == {"policy", "reward", "teacher"}
    teacher = plan.roles["teacher"]
    assert 7.9e9 < teacher.shape.params < 8.1e9 and not teacher.trained
    assert teacher.states.resident_bytes > 0
    assert any(ph.name == "scoring: teacher" for ph in plan.phases)
    assert any("no reference model" in n for n in plan.notes)
    with_kl = P.plan(load_config("distill", ["ppo.kl_loss_coef=0.01"]), cluster)
    assert with_kl.roles["reference"].shape.params == plan.roles["policy"].shape.params


def test_group_filters_need_the_reward_in_the_mix():
    base = [*DISTILL, "teacher.arch.model_type=llama", "ppo.samples_per_prompt=2",
            "ppo.mini_batch_size=16", "ppo.filter_zero_std_groups=true"]
    with pytest.raises(ConfigError, match="ppo.filter_zero_std_groups choose groups"):
        validate(load_config("tiny", base), 1)
    validate(load_config("tiny", [*base, "distill.reward_coef=1"]), 1)


def test_a_teacher_model_without_logits_for_every_student_token_is_refused(
        capsys, tokenizers, monkeypatch):
    monkeypatch.chdir(tokenizers)
    small = tokenizers / "small_head"
    if not small.exists():
        import shutil

        shutil.copytree(tokenizers / "same", small)
        (small / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    rc, lines = _dry_run(capsys, *DISTILL, f"teacher.path={small}")
    assert rc == 2 and len(lines) == 1 and "vocab_size 100 is below the student's 512" in lines[0]
