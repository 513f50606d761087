"""Whether each artifact reads the baseline's token ids as the same tokens: checked from files, before any model loads.

The protocol tokenizes the evaluation text once, with the baseline's tokenizer, and feeds every engine those ids
(:mod:`quantkit.engines.logits`). An artifact made from another model reads them as other tokens: llama.cpp stopped
at the first id past its vocabulary (``llama_decode failed (-1)``) and transformers refused the distributions only
after the baseline had been scored, both exit 1; an artifact whose manifest names another source was already a
usage error (exit 2). Here every engine's artifact gets the same check, exit 2: the size of its vocabulary (a
checkpoint's ``config.json``; a GGUF file's token list, whose length is what llama.cpp scores over) and, where both
sides list their tokens (``tokenizer.json``, a GGUF's ``tokenizer.ggml.tokens``), the token each id stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.architectures import text_config
from quantkit.checkpoint import read_config
from quantkit.engines.logits import is_gguf
from quantkit.errors import IntegrityError, UsageError
from quantkit.evaluation.results import Target
from quantkit.source import SourceModel

HINT = "evaluate it against the model it was made from (--baseline)"


@dataclass(frozen=True)
class Vocabulary:
    """What a model's files say about its token ids."""

    size: int | None  # how many ids it scores over; None where its files do not say
    # id -> token of the base vocabulary; a tokenizer's added tokens are left out (llama.cpp's converter may respell
    # them); empty where the files list no tokens
    tokens: dict[int, str]


def read(path: Path) -> Vocabulary:
    """The vocabulary of a checkpoint folder or a ``.gguf`` file, from its metadata only."""
    return _gguf(path) if is_gguf(path) else _checkpoint(path)


def _gguf(path: Path) -> Vocabulary:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
        listed = field.contents() if field is not None else []
    except Exception as e:  # gguf-py raises what its parsing meets (ValueError, struct and numpy errors)
        raise IntegrityError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    return Vocabulary(size=len(listed) or None, tokens=dict(enumerate(listed)))


def _checkpoint(folder: Path) -> Vocabulary:
    size = text_config(read_config(folder)).get("vocab_size")
    data = read_config(folder, "tokenizer.json")
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pairs: list[tuple[Any, Any]] = []
    if isinstance(vocab, dict):  # BPE, WordPiece: token -> id
        pairs = [(i, t) for t, i in vocab.items()]
    elif isinstance(vocab, list):  # Unigram: [token, score] in id order
        pairs = [(i, e[0]) for i, e in enumerate(vocab) if isinstance(e, list) and e]
    added = {a.get("id") for a in data.get("added_tokens") or [] if isinstance(a, dict)}
    tokens = {i: t for i, t in pairs if isinstance(i, int) and isinstance(t, str) and i not in added}
    return Vocabulary(size=size if isinstance(size, int) and not isinstance(size, bool) else None, tokens=tokens)


def check(targets: list[Target], baseline: SourceModel) -> None:
    """Refuse (exit 2) a target whose vocabulary is not the baseline's: another size, or another token at an id
    both list."""
    base = read(baseline.path)
    for t in targets:
        own = read(t.path)
        if base.size and own.size and own.size != base.size:
            raise UsageError(f"{t.label} has a vocabulary of {own.size:,} tokens, the baseline {baseline.spec} one of "
                             f"{base.size:,}: it was made from another model", hint=HINT)
        wrong = min((i for i in own.tokens.keys() & base.tokens.keys() if own.tokens[i] != base.tokens[i]),
                    default=None)
        if wrong is not None:
            raise UsageError(f"{t.label} has another tokenizer than the baseline {baseline.spec}: token id {wrong} is "
                             f"{own.tokens[wrong]!r} in it, {base.tokens[wrong]!r} in the baseline", hint=HINT)
