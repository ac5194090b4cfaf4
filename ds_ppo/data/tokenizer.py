"""Tokenizers: train a SentencePiece model into a Hugging Face tokenizer directory, and load
any tokenizer (a directory, a hub name, a bare SentencePiece ``.model``, or ``builtin:tiny``)
in the one shape the trainer expects: left padding and a pad token.

A directory written by :func:`train_tokenizer` holds ``tokenizer.json`` (a ``tokenizers``
pipeline equivalent to the SentencePiece model), ``tokenizer_config.json`` (special tokens,
left padding, a chat template) and the raw ``spm.model``. It loads with
``transformers.AutoTokenizer.from_pretrained(dir)`` alone: nothing of ds_ppo is needed, so
exported policies stay usable without this package.

Special token ids of a trained tokenizer: ``<unk>`` = 0, ``<s>`` (BOS) = 1, ``</s>`` (EOS) = 2,
``<pad>`` = 3. PAD is distinct from EOS on purpose: the response mask ends at the first EOS,
and a pad that equals EOS would be indistinguishable from a real end of response.
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ds_ppo.errors import ConfigError, DataError

if TYPE_CHECKING:  # transformers is imported lazily: `import ds_ppo.data` stays light
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("ds_ppo")

TINY_SPEC = "builtin:tiny"
TINY_VOCAB_SIZE = 512
TINY_CACHE_NAME = "tokenizer_tiny"
SPM_FILE = "spm.model"  # not "tokenizer.model", so no loader mistakes it for the main file

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
# 256 byte pieces (byte fallback: no text is ever <unk>) + the four specials above.
_RESERVED_PIECES = 256 + 4

# Roles as plain "role: content" lines. The BOS is part of the template, as in Llama's, so
# rendered chat text is tokenised with add_special_tokens=False (no double BOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_corpus_path() -> Path:
    """The corpus shipped with ds_ppo: one short lowercase English sentence per line."""
    return Path(__file__).with_name("tiny_corpus.txt")


# ------------------------------------------------------------------------- training
def train_tokenizer(input_path: str | os.PathLike, vocab_size: int, out_dir: str | os.PathLike,
                    model_type: str = "bpe") -> Path:
    """Train a SentencePiece model on a text file and save it as an HF tokenizer directory.

    Args:
        input_path: text corpus, one sentence per line.
        vocab_size: pieces in total, including the 256 byte-fallback pieces and 4 specials.
        out_dir: directory to write (created; existing tokenizer files are overwritten).
        model_type: "bpe" or "unigram".

    Returns:
        ``out_dir`` as a Path. Training is deterministic: the same corpus and settings give
        byte-identical files (one thread, no sentence sampling or shuffling).

    Raises:
        DataError: the corpus is missing, unreadable or empty, or SentencePiece rejects the
            settings (e.g. a vocab_size too large for the corpus).
        ConfigError: a model_type or vocab_size that cannot work, or no sentencepiece package.
    """
    try:
        import sentencepiece as spm
    except ImportError:
        raise ConfigError("training a tokenizer (also builtin:tiny) needs the sentencepiece "
                          "package: pip install sentencepiece") from None

    src, out = Path(input_path), Path(out_dir)
    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"tokenizer model_type {model_type!r}: use bpe or unigram")
    if vocab_size <= _RESERVED_PIECES:
        raise ConfigError(f"tokenizer vocab_size = {vocab_size} must be > {_RESERVED_PIECES} "
                          "(256 byte pieces + 4 special tokens are always in the vocabulary)")
    if not src.is_file():
        raise DataError(f"tokenizer corpus {src}: file not found")
    try:
        if not src.read_text(encoding="utf-8").strip():
            raise DataError(f"tokenizer corpus {src}: the file is empty")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"tokenizer corpus {src}: cannot read it as UTF-8 text: {e}") from None

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            input=str(src), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            # Text is kept as written: identity normalisation and no whitespace folding make
            # the HF pipeline below a plain Metaspace + model (see _hf_tokenizer_from_spm).
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=True, byte_fallback=True, character_coverage=1.0,
            split_digits=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            unk_piece=UNK, bos_piece=BOS, eos_piece=EOS, pad_piece=PAD,
            # Determinism: one thread, every sentence, in file order.
            num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
            minloglevel=2)
    except RuntimeError as e:
        raise DataError(f"tokenizer training on {src} failed: {e}") from None
    proto = model.getvalue()

    tokenizer = _hf_tokenizer_from_spm(proto, model_type)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    (out / SPM_FILE).write_bytes(proto)
    log.debug("trained a %s SentencePiece tokenizer (%d pieces) on %s -> %s",
              model_type, vocab_size, src, out)
    return out


def _hf_tokenizer_from_spm(proto: bytes, model_type: str) -> PreTrainedTokenizerBase:
    """An HF fast tokenizer that encodes and decodes exactly like the SentencePiece model.

    Only for models trained by :func:`train_tokenizer` (identity normalisation, dummy prefix,
    byte fallback). Written here rather than through transformers' converters, whose internals
    change between transformers versions. One known difference, shared with transformers' own
    Llama conversion: a text that starts with a space gets no extra "▁" piece for it.
    """
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_proto=proto)
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    normal = {i for i in range(n)
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))}

    if model_type == "bpe":
        vocab = {p: i for i, p in enumerate(pieces)}
        by_piece = {pieces[i]: i for i in normal}
        # SentencePiece BPE applies the merge producing the highest-scoring piece first;
        # listing every (left, right) split of each piece in that order reproduces it.
        ranked = []
        for piece, i in by_piece.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in by_piece and right in by_piece:
                    ranked.append((-sp.get_score(i), i, left, right))
        merges = [(left, right) for _, _, left, right in sorted(ranked)]
        model = models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True,
                           byte_fallback=True)
    else:
        model = models.Unigram([(p, sp.get_score(i)) for i, p in enumerate(pieces)], unk_id=0,
                               byte_fallback=True)

    tok = Tokenizer(model)
    tok.normalizer = None
    # The dummy prefix: "the cat" -> "▁the▁cat"; only the first chunk between special tokens
    # gets it (prepend_scheme="first"), as in current Llama tokenizers.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])  # drop the dummy prefix's space
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, sp.piece_to_id(BOS))])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (UNK, BOS, EOS, PAD)])
    # The BOS comes from the post-processor in tokenizer.json (transformers ignores an
    # add_bos_token flag when it loads a tokenizer.json), so no add_bos_token here.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        padding_side="left", chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


# -------------------------------------------------------------------------- loading
def load_tokenizer(spec: str, cache_dir: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer and put it in the shape the trainer expects.

    Args:
        spec: an HF tokenizer directory, a hub name, a SentencePiece ``.model`` file (or a
            directory holding only ``tokenizer.model``), or ``builtin:tiny``: a 512-piece
            tokenizer trained on the shipped corpus, once, cached in
            ``cache_dir/tokenizer_tiny`` (safe when several ranks call this at once).
        cache_dir: where ``builtin:tiny`` is cached (e.g. the run's output_dir).

    Returns:
        The tokenizer with ``padding_side == "left"`` (generation pads prompts on the left)
        and a pad token: a tokenizer without one gets its EOS as pad (logged).

    Raises:
        ConfigError: the tokenizer cannot be loaded, or has neither pad nor EOS token.
    """
    if spec == TINY_SPEC:
        path: str = str(_builtin_tiny(Path(cache_dir)))
    elif spec.startswith("builtin:"):
        raise ConfigError(f"tokenizer {spec!r}: the only builtin tokenizer is {TINY_SPEC!r}")
    else:
        path = spec
    tokenizer = _load_hf_tokenizer(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer {spec!r} has neither a pad nor an EOS token; "
                              "use a tokenizer that defines one")
        tokenizer.pad_token = tokenizer.eos_token
        log.warning("tokenizer %s has no pad token: using its EOS %r as pad", spec,
                    tokenizer.eos_token)
    return tokenizer


def _load_hf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    from ds_ppo.config.paths import is_hub_name, missing_local

    p = Path(path)
    if missing_local(path):
        raise ConfigError(f"cannot load tokenizer {path!r}: no such directory or file (from "
                          f"{Path.cwd()}; a hub name reads as name or org/name)")
    offline = _hub_offline()
    try:
        if p.is_file() and p.suffix == ".model":
            return _from_spm_file(p)
        if p.is_dir() and (p / "tokenizer.model").is_file() and not any(
                (p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return _from_spm_file(p / "tokenizer.model")
        if is_hub_name(path) and not offline:
            unreachable = _hub_unreachable()
            if unreachable:  # the cached copy, if any, rather than a minute of retries
                try:
                    return AutoTokenizer.from_pretrained(path, local_files_only=True)
                except (OSError, ValueError) as e:
                    raise ConfigError(
                        f"tokenizer {path!r} is a hub name, but {unreachable} (offline?) and "
                        f"it is not in the local cache ({type(e).__name__}); give a local "
                        "tokenizer directory, or load it once while online") from None
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, RuntimeError) as e:
        note = " (HF_HUB_OFFLINE is set: only the local cache is used)" if offline else ""
        raise ConfigError(f"cannot load tokenizer {path!r}{note}: {e}") from None


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face hub (HF_ENDPOINT) does not answer within `timeout_s`; None when it
    does (any HTTP answer). Through huggingface_hub's own session, so proxies apply."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    try:
        get_session().head(endpoint, timeout=timeout_s)
    except Exception as e:  # connection refused, DNS, timeout, TLS: all mean "cannot reach"
        return f"the hub at {endpoint} does not answer ({type(e).__name__}: {e})"
    return None


def _from_spm_file(model_file: Path) -> PreTrainedTokenizerBase:
    """A bare SentencePiece model (e.g. Llama's tokenizer.model) without HF config files."""
    from transformers import LlamaTokenizer

    # transformers converts a .model file named in vocab_file; LlamaTokenizer carries the
    # conventions of the SentencePiece models in the wild (BOS added, byte fallback).
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        tokenizer = LlamaTokenizer.from_pretrained(tmp, add_bos_token=True, add_eos_token=False)
    if tokenizer.pad_token is None and PAD in tokenizer.get_vocab():
        tokenizer.pad_token = PAD  # a model trained by train_tokenizer has a <pad> piece
    return tokenizer


def _builtin_tiny(cache_dir: Path) -> Path:
    """Train the tiny tokenizer into cache_dir/tokenizer_tiny once.

    Several ranks may get here at the same moment: each trains into its own temporary
    directory and renames it into place; rename onto an existing directory fails, so the
    first one wins and the others discard theirs. Training is deterministic, so whichever
    wins, the files are the same.
    """
    final = cache_dir / TINY_CACHE_NAME
    if (final / "tokenizer.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_CACHE_NAME}.", dir=cache_dir))
    try:
        train_tokenizer(tiny_corpus_path(), TINY_VOCAB_SIZE, tmp, model_type="bpe")
        try:
            os.rename(tmp, final)
            log.info("built the tiny tokenizer (%d pieces, trained on %s) into %s",
                     TINY_VOCAB_SIZE, tiny_corpus_path().name, final)
        except OSError:  # another rank renamed its copy first
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_policy_tokenizer(cfg, out: Path) -> PreTrainedTokenizerBase:
    """The policy's tokenizer (policy.tokenizer, else policy.path), cached under `out`, for
    every job (`ds-ppo train`, `sft`, `rm`). Every rank loads it (and, for builtin:tiny, may
    build it: the cache is written atomically), so a bad spec fails on every rank alike instead
    of hanging one."""
    from ds_ppo.errors import ConfigError

    spec = cfg.policy.tokenizer or cfg.policy.path
    if spec is None:
        raise ConfigError("policy.tokenizer: a policy built from policy.arch needs a tokenizer "
                          "(a path, a hub name or builtin:tiny)")
    out.mkdir(parents=True, exist_ok=True)
    return load_tokenizer(spec, out)


def vocabulary_problem(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase,
                       where: str) -> str | None:
    """One line when `teacher` (named by `where`, e.g. "teacher.path = '...'") does not have the
    student's vocabulary: every token of the student's under the same id (the teacher may have
    more). A distillation teacher scores the student's token ids; under another vocabulary they
    are other tokens. None when it does."""
    theirs = teacher.get_vocab()
    mine = student.get_vocab()
    wrong = sorted((i, t) for t, i in mine.items() if theirs.get(t) != i)
    if not wrong:
        return None
    i, t = wrong[0]
    other = {v: k for k, v in theirs.items()}.get(i)
    return (f"{where}: its tokenizer has another vocabulary than the student's ({len(wrong)} of "
            f"{len(mine)} student tokens have another id or none, e.g. id {i} is {t!r} for the "
            f"student, {other!r} for the teacher): a teacher must have the student's vocabulary "
            "(the same tokenizer, or one that extends it); use a teacher of the student's model "
            "family")


def teacher_problem(cfg, out: Path) -> str | None:
    """The distillation teacher's vocabulary against the student's (`vocabulary_problem`),
    from their tokenizers (teacher.tokenizer, else teacher.path); None when they agree, when
    there is no teacher.path (a teacher.arch uses the student's tokenizer), or when a tokenizer
    cannot be loaded (its own check reports that)."""
    from ds_ppo.errors import ConfigError

    spec = cfg.teacher.tokenizer or cfg.teacher.path
    if spec is None:
        return None
    try:
        student = load_policy_tokenizer(cfg, out)
        teacher = load_tokenizer(spec, out)
    except ConfigError as e:
        return f"teacher: {e}"
    key = "teacher.tokenizer" if cfg.teacher.tokenizer else "teacher.path"
    problem = vocabulary_problem(student, teacher, f"{key} = {spec!r}")
    if problem is not None or cfg.teacher.path is None:
        return problem
    from ds_ppo.config.model_checks import model_fields

    rows = model_fields(cfg.teacher.path, None).get("vocab_size")  # a local config.json
    if rows is not None and int(rows) < len(student):
        return (f"teacher.path = {cfg.teacher.path!r}: the model's vocab_size {rows} is below "
                f"the student's {len(student)} tokens: it has no logit for the highest ids; "
                "use a teacher whose output layer covers the student's vocabulary")
    return None
