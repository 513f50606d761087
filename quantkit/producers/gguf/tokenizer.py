"""The vocabulary: Hugging Face tokenizer files -> llama.cpp's tokenizer keys, so llama.cpp splits text the same way.

Two kinds are supported, the two llama.cpp implements for the families quantkit converts:

* byte-level BPE from ``tokenizer.json`` (Llama 3, Qwen, Mistral Nemo ...): tokens, merges and the
  pre-tokenizer. llama.cpp does not run the tokenizer.json regex; it has its own hand-written splitters, chosen
  by name in ``tokenizer.ggml.pre``. The name is picked by matching the regex in tokenizer.json against the
  original regexes of the splitters llama.cpp implements (:data:`PRE_TOKENIZERS`). An unknown regex is refused:
  a wrong guess would load fine and tokenize differently.
* SentencePiece BPE from ``tokenizer.model`` (Llama 2, Mistral 7B, Gemma, Phi-3): pieces, scores and piece
  types from the model protobuf, plus its whitespace options. A checkpoint saved by transformers 5 keeps only
  the ``tokenizer.json`` form of such a tokenizer (BPE with byte fallback over "▁"-joined text); it is turned
  into the same SentencePiece vocabulary, each token scored by the rank of the merge that makes it, which is the
  order SentencePiece's own scores encode.

Special tokens, add-BOS/EOS flags, merges and the chat template come from :class:`gguf.SpecialVocab`.

Tested with gguf 0.19.0, sentencepiece 0.2 and llama-cpp-python 0.3.36 (its bundled llama.cpp).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import SourceModelError

# llama.cpp pre-tokenizer name -> the regex its splitter reproduces, as written in tokenizer.json
# (the "original regex from tokenizer.json" of each splitter in llama.cpp's src/llama-vocab.cpp).
PRE_TOKENIZERS: dict[str, str] = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
              r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
GPT2 = "gpt-2"  # plain ByteLevel pre-tokenizer with its built-in GPT-2 regex
# Splitters for which llama.cpp emits a whole pre-token directly when it is in the vocabulary.
IGNORE_MERGES = {"llama-bpe", "tekken"}
# sentencepiece_model.proto: TrainerSpec.ModelType.BPE
SPM_BPE = 2


@dataclass
class Vocab:
    """What the GGUF tokenizer section holds."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    pre: str | None = None
    add_space_prefix: bool | None = None
    remove_extra_whitespaces: bool | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Kind:
    """Which tokenizer a checkpoint has (cheap to find out, for checks before any work)."""

    model: str
    pre: str | None
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceModelError(f"{path} is not readable JSON: {e}") from None


def _is_byte_level_bpe(tj: dict[str, Any]) -> bool:
    model = tj.get("model") or {}
    return model.get("type") == "BPE" and not model.get("byte_fallback", False) and \
        (tj.get("decoder") or {}).get("type") == "ByteLevel"


def _is_spm_json(tj: dict[str, Any]) -> bool:
    """A SentencePiece-style BPE in tokenizer.json: byte fallback, spaces replaced by "▁" before splitting."""
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback", False):
        return False
    pre, norm = tj.get("pre_tokenizer"), tj.get("normalizer")
    norms = (norm or {}).get("normalizers", [norm] if norm else [])
    replaces_spaces = any(n.get("type") == "Replace" and (n.get("pattern") or {}).get("String") == " "
                          and n.get("content") == "▁" for n in norms)
    if pre is None:
        return replaces_spaces
    if pre.get("type") == "Metaspace":
        return pre.get("replacement") == "▁" and not pre.get("split", True)
    # transformers' Gemma tokenizer splits on " " after the normalizer already removed every " ": a no-op
    return replaces_spaces and pre.get("type") == "Split" and (pre.get("pattern") or {}).get("String") == " "


def _spm_json_prefix(tj: dict[str, Any]) -> bool:
    pre, norm = tj.get("pre_tokenizer") or {}, tj.get("normalizer")
    norms = (norm or {}).get("normalizers", [norm] if norm else [])
    if pre.get("type") == "Metaspace":
        return pre.get("prepend_scheme", "always") in ("first", "always")
    return any(n.get("type") == "Prepend" and n.get("prepend") == "▁" for n in norms)


def match_pre_tokenizer(tj: dict[str, Any]) -> str:
    """The llama.cpp pre-tokenizer that splits text exactly as this tokenizer.json does, or a clear refusal."""
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    norm = tj.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise SourceModelError(f"tokenizer.json has a {norm.get('type')} normalizer, which llama.cpp does not apply")
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True) \
            and not steps[0].get("add_prefix_space", False):
        return GPT2
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel" \
            and not steps[1].get("use_regex", True) and steps[0].get("behavior") == "Isolated" \
            and not steps[0].get("invert", False):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, known in PRE_TOKENIZERS.items():
            if regex == known:
                return name
        raise SourceModelError(
            f"tokenizer.json splits text with a regex llama.cpp has no pre-tokenizer for: {regex!r}",
            hint=f"llama.cpp implements these (quantkit matches them): {', '.join([*PRE_TOKENIZERS, GPT2])}")
    raise SourceModelError(
        "tokenizer.json has a pre-tokenizer llama.cpp cannot reproduce: "
        + json.dumps(pre, ensure_ascii=False)[:300],
        hint=f"llama.cpp implements these (quantkit matches them): {', '.join([*PRE_TOKENIZERS, GPT2])}")


def inspect(path: Path) -> Kind:
    """Find the tokenizer kind (and BPE pre-tokenizer) without building the vocabulary."""
    tj = _read_json(path / "tokenizer.json")
    if tj is not None and _is_byte_level_bpe(tj):
        pre = match_pre_tokenizer(tj)
        notes = []
        if bool((tj.get("model") or {}).get("ignore_merges", False)) != (pre in IGNORE_MERGES):
            notes.append(f"tokenizer.json has ignore_merges={bool(tj['model'].get('ignore_merges', False))} but "
                         f"llama.cpp's {pre!r} pre-tokenizer uses {pre in IGNORE_MERGES}: the two agree unless a "
                         "whole word is in the vocabulary yet unreachable by merges")
        return Kind("gpt2", pre, notes)
    if (path / "tokenizer.model").is_file():
        _require_sentencepiece()
        return Kind("llama", None)
    if tj is not None and _is_spm_json(tj):
        return Kind("llama", None, ["SentencePiece vocabulary rebuilt from tokenizer.json (no tokenizer.model): "
                                    "token scores come from the BPE merge ranks"])
    found = "a tokenizer.json of another kind" if tj is not None else "no tokenizer.json or tokenizer.model"
    raise SourceModelError(
        f"{path} has {found}; GGUF conversion needs a byte-level BPE tokenizer.json, a SentencePiece "
        "tokenizer.model, or a SentencePiece-style (byte-fallback BPE) tokenizer.json",
        hint="copy the tokenizer files of the base model into the checkpoint folder")


def _added(path: Path, tj: dict[str, Any] | None) -> dict[int, tuple[str, bool]]:
    """Added tokens by id: (content, special), from tokenizer.json and tokenizer_config.json."""
    out: dict[int, tuple[str, bool]] = {}
    for t in (tj or {}).get("added_tokens", []):
        out[int(t["id"])] = (t["content"], bool(t.get("special", False)))
    cfg = _read_json(path / "tokenizer_config.json") or {}
    for tid, t in (cfg.get("added_tokens_decoder") or {}).items():
        out.setdefault(int(tid), (t["content"], bool(t.get("special", False))))
    return out


def _pad(tokens: list[str], types: list[int], scores: list[float] | None, n_vocab: int) -> None:
    """Embedding rows beyond the tokenizer (vocab padded for speed) get unused placeholder tokens."""
    import gguf

    if len(tokens) > n_vocab:
        raise SourceModelError(f"the tokenizer has {len(tokens)} tokens but the embeddings only {n_vocab} rows",
                               hint="the tokenizer files do not belong to this checkpoint")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)


def _bpe(path: Path, tj: dict[str, Any], n_vocab: int, kind: Kind) -> Vocab:
    import gguf

    TT = gguf.TokenType
    vocab: dict[str, int] = tj["model"]["vocab"]
    by_id: dict[int, tuple[str, int]] = {i: (tok, int(TT.NORMAL)) for tok, i in vocab.items()}
    for i, (content, special) in _added(path, tj).items():
        by_id[i] = (content, int(TT.CONTROL if special else TT.USER_DEFINED))
    n = max(by_id) + 1 if by_id else 0
    missing = [i for i in range(n) if i not in by_id]
    if missing:
        raise SourceModelError(f"tokenizer.json has no token for id(s) {missing[:5]}: its ids are not contiguous")
    tokens = [by_id[i][0] for i in range(n)]
    types = [by_id[i][1] for i in range(n)]
    _pad(tokens, types, None, n_vocab)
    return Vocab("gpt2", tokens, types, pre=kind.pre, notes=list(kind.notes))


def _require_sentencepiece() -> None:
    from quantkit import versions

    versions.require("sentencepiece", "gguf", "Reading a SentencePiece tokenizer.model")
    versions.require("google.protobuf", "gguf", "Reading a SentencePiece tokenizer.model")


def _spm(path: Path, tj: dict[str, Any] | None, n_vocab: int) -> Vocab:
    import gguf

    _require_sentencepiece()
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2 as spm_pb

    proto = spm_pb.ModelProto()
    try:
        proto.ParseFromString((path / "tokenizer.model").read_bytes())
    except (OSError, DecodeError) as e:
        raise SourceModelError(f"{path / 'tokenizer.model'} is not a SentencePiece model: {e}") from None
    if proto.trainer_spec.model_type != SPM_BPE:
        kind = spm_pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise SourceModelError(f"{path / 'tokenizer.model'} is a SentencePiece {kind} model; llama.cpp's "
                               "SentencePiece tokenizer reproduces BPE models only")
    TT = gguf.TokenType
    tokens = [p.piece for p in proto.pieces]
    scores = [float(p.score) for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]  # the protobuf's piece types use llama.cpp's numbering
    for i, (content, special) in sorted(_added(path, tj).items()):
        if i < len(tokens):
            if special and types[i] == TT.NORMAL:
                types[i] = int(TT.CONTROL)
            continue
        if i != len(tokens):
            raise SourceModelError(f"added token id {i} leaves a gap after the {len(tokens)} SentencePiece pieces")
        tokens.append(content)
        scores.append(-1000.0)
        types.append(int(TT.CONTROL if special else TT.USER_DEFINED))
    _pad(tokens, types, scores, n_vocab)
    notes = []
    if proto.normalizer_spec.name not in ("identity", ""):
        notes.append(f"tokenizer.model normalizes text with {proto.normalizer_spec.name!r}; llama.cpp does not, so "
                     "text that normalization changes may tokenize differently")
    return Vocab("llama", tokens, types, scores=scores,
                 add_space_prefix=bool(proto.normalizer_spec.add_dummy_prefix),
                 remove_extra_whitespaces=bool(proto.normalizer_spec.remove_extra_whitespaces), notes=notes)


def _spm_from_json(path: Path, tj: dict[str, Any], n_vocab: int, kind: Kind) -> Vocab:
    import gguf

    TT = gguf.TokenType
    model = tj["model"]
    by_id: dict[int, str] = {i: tok for tok, i in model["vocab"].items()}
    added = _added(path, tj)
    for i, (content, _) in added.items():
        by_id[i] = content
    n = max(by_id) + 1
    if any(i not in by_id for i in range(n)):
        raise SourceModelError("tokenizer.json ids are not contiguous")
    merges = model.get("merges") or []
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        rank.setdefault(a + b, r)
    unk = model.get("unk_token")
    tokens, types, scores = [], [], []
    for i in range(n):
        tok = by_id[i]
        if i in added:
            ttype = TT.CONTROL if added[i][1] else TT.USER_DEFINED
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
            ttype = TT.BYTE
        elif tok == unk:
            ttype = TT.UNKNOWN
        else:
            ttype = TT.NORMAL
        tokens.append(tok)
        types.append(int(ttype))
        # higher score merges first; tokens no merge makes come last (BPE would never produce them)
        scores.append(-float(rank[tok] + 1) if tok in rank else (0.0 if len(tok) == 1 else -float(len(merges) + 1)))
    _pad(tokens, types, scores, n_vocab)
    return Vocab("llama", tokens, types, scores=scores, add_space_prefix=_spm_json_prefix(tj),
                 remove_extra_whitespaces=False, notes=list(kind.notes))


def load(path: Path, n_vocab: int) -> Vocab:
    """The full vocabulary, padded to the embedding's ``n_vocab`` rows."""
    kind = inspect(path)
    tj = _read_json(path / "tokenizer.json")
    if kind.model == "gpt2":
        assert tj is not None
        return _bpe(path, tj, n_vocab, kind)
    if (path / "tokenizer.model").is_file():
        return _spm(path, tj, n_vocab)
    assert tj is not None
    return _spm_from_json(path, tj, n_vocab, kind)


def write(writer: Any, vocab: Vocab, path: Path) -> None:
    """Add the tokenizer keys, then special tokens, merges and the chat template via gguf.SpecialVocab."""
    import gguf

    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.remove_extra_whitespaces is not None:
        writer.add_remove_extra_whitespaces(vocab.remove_extra_whitespaces)
    # gguf-py logs guesses about exotic post-processors at WARNING; they are not actionable for a user here.
    log = logging.getLogger("gguf.vocab")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        special = gguf.SpecialVocab(path, load_merges=vocab.model == "gpt2", n_vocab=len(vocab.tokens))
    finally:
        log.setLevel(level)
    if vocab.model == "gpt2" and not special.merges:
        raise SourceModelError(f"{path}/tokenizer.json has no BPE merges")
    special.add_to_gguf(writer, quiet=True)
