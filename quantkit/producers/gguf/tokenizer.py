"""Which llama.cpp pre-tokenizer a byte-level BPE ``tokenizer.json`` uses, read from its own regex.

What upstream cannot do, measured: llama.cpp's converter names a BPE tokenizer's pre-tokenizer only by the
sha256 of the token ids of a fixed text, so it refuses any tokenizer it has not seen, including one trained
locally with a standard splitter (``models/quantkit-tiny``: its own 8,192-token BPE with Llama 3's regex; hash
3e4268bb...). llama.cpp does not run the regex in tokenizer.json; it has hand-written splitters chosen by name
in ``tokenizer.ggml.pre``. :func:`match` compares the tokenizer's regex with the original regexes of the
splitters llama.cpp implements (:data:`PRE_TOKENIZERS`, from llama.cpp's ``src/llama-vocab.cpp``) and answers
only on an exact match; :mod:`.convert` hands that answer to the converter only after its own check failed.

Tested with llama.cpp b11312 (llama-cpp-python 0.3.36) and tokenizers 0.22.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# llama.cpp pre-tokenizer name -> the regex its splitter reproduces, as written in tokenizer.json
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


def names() -> str:
    """The splitters quantkit matches, for messages."""
    return ", ".join([*PRE_TOKENIZERS, GPT2])


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _match(tj: dict[str, Any]) -> tuple[str | None, str]:
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback", False) or \
            (tj.get("decoder") or {}).get("type") != "ByteLevel":
        return None, "tokenizer.json is not a byte-level BPE"
    norm = tj.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        return None, f"tokenizer.json has a {norm.get('type')} normalizer, which llama.cpp does not apply"
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True) \
            and not steps[0].get("add_prefix_space", False):
        return GPT2, ""
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel" \
            and not steps[1].get("use_regex", True) and steps[0].get("behavior") == "Isolated" \
            and not steps[0].get("invert", False):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, known in PRE_TOKENIZERS.items():
            if regex == known:
                return name, ""
        return None, f"tokenizer.json splits text with a regex llama.cpp has no pre-tokenizer for: {regex!r}"
    return None, "tokenizer.json has a pre-tokenizer llama.cpp cannot reproduce: " + \
        json.dumps(pre, ensure_ascii=False)[:200]


def match(model_dir: Path) -> tuple[str | None, list[str]]:
    """(the llama.cpp pre-tokenizer that splits text exactly as ``tokenizer.json`` does, notes) on an exact match;
    (None, [why not]) otherwise."""
    tj = _read_json(model_dir / "tokenizer.json")
    if tj is None:
        return None, ["no readable tokenizer.json"]
    name, why = _match(tj)
    if name is None:
        return None, [why]
    notes = [f"pre-tokenizer {name!r} named by quantkit from tokenizer.json's splitter: llama.cpp's converter did "
             "not recognise this tokenizer by its hash (a locally trained vocabulary)"]
    if bool((tj.get("model") or {}).get("ignore_merges", False)) != (name in IGNORE_MERGES):
        notes.append(f"tokenizer.json has ignore_merges={bool(tj['model'].get('ignore_merges', False))} but "
                     f"llama.cpp's {name!r} pre-tokenizer uses {name in IGNORE_MERGES}: the two agree unless a "
                     "whole word is in the vocabulary yet unreachable by merges")
    return name, notes
