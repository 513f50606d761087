"""The evaluation protocol as data: which text, tokenized how, cut into which windows, scoring which tokens.

Tested with transformers 5.17.0 (tokenizers 0.23.3) and datasets 5.2.0.

Numbers from two engines or two formats can only be compared when they score the same tokens in the same
contexts. So the protocol is computed once, from the baseline's Hugging Face tokenizer, and every engine is fed
the resulting token ids (never text). It is recorded in full (dataset and its sha256, tokenizer hash, ctx,
stride, tokens scored, sha256 of the windows) in the report and in each artifact's manifest.

* Text: a shipped set (``heldout``...), a file, or a hub dataset, read by :func:`quantkit.calibration.eval_text`
  (documents joined by blank lines, the WikiText-2 convention). ``auto`` is WikiText-2 test when the Hugging
  Face hub answers within a few seconds (and ``HF_HUB_OFFLINE`` is not set), else ``heldout``.
* Tokens: the whole text is tokenized once, without special tokens, into one stream; ``--max-tokens`` keeps
  its first N tokens.
* Windows: each window is BOS followed by up to ``ctx - 1`` stream tokens. By default windows do not overlap
  (the AWQ/GPTQ protocol), so every stream token is scored exactly once, the first of each window given only
  BOS. With ``--stride S`` a window moves S tokens at a time and only its new tokens are scored, the others
  serving as context (the sliding-window method of the Hugging Face perplexity guide): the same tokens are
  scored, each with more context. A tokenizer without BOS gets no prefix; then the first token of each window
  has no context and is not scored.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.engines.logits import Window
from quantkit.errors import CalibrationError, UsageError
from quantkit.recipe import EvaluationSpec

HUB_PROBE_TIMEOUT = 3.0
AUTO_HUB = "wikitext2"
AUTO_LOCAL = "heldout"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")
# The fewest tokens an evaluation scores: the least ``--max-tokens`` (the recipe's bound, read from it so that it is
# declared once). A shorter text (a file of two words) gave figures of no meaning, gated and recorded as a verdict.
MIN_TOKENS: int = next(m.ge for m in EvaluationSpec.model_fields["max_tokens"].metadata
                       if getattr(m, "ge", None) is not None)


@dataclass
class Protocol:
    """Everything that decides which tokens are scored, and how to reproduce them."""

    dataset: str
    source: str
    kind: str
    source_sha256: str | None
    text_sha256: str
    tokenizer: str
    tokenizer_sha256: str
    bos_token_id: int | None
    ctx: int
    stride: int | None
    max_tokens: int | None
    stream_tokens: int  # tokens in the whole text, before --max-tokens
    windows: list[Window]
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_scored(self) -> int:
        return sum(w.n_scored for w in self.windows)

    @property
    def tokens_evaluated(self) -> int:
        """Tokens run through the model, context included (more than scored when windows overlap)."""
        return sum(len(w.tokens) for w in self.windows)

    @property
    def windows_sha256(self) -> str:
        return windows_sha256(self.windows)

    def manifest(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset, "source": self.source, "kind": self.kind, "source_sha256": self.source_sha256,
            "text_sha256": self.text_sha256, "tokenizer": self.tokenizer, "tokenizer_sha256": self.tokenizer_sha256,
            "bos_token_id": self.bos_token_id, "ctx": self.ctx,
            "stride": self.stride, "windowing": "strided" if self.stride else "non-overlapping",
            "max_tokens": self.max_tokens, "stream_tokens": self.stream_tokens, "windows": len(self.windows),
            "tokens_scored": self.tokens_scored, "tokens_evaluated": self.tokens_evaluated,
            "windows_sha256": self.windows_sha256, "notes": self.notes,
        }


def make_windows(stream: list[int], bos: int | None, ctx: int, stride: int | None = None) -> list[Window]:
    """Cut a token stream into windows of at most ``ctx`` tokens (see the module docstring for the rules)."""
    prefix = [] if bos is None else [bos]
    span = ctx - len(prefix)
    if span < 2:
        raise UsageError(f"--ctx {ctx} is too small: a window needs at least 2 tokens after BOS")
    step = stride or span
    if not 1 <= step <= span:
        raise UsageError(f"--stride {stride} must be between 1 and ctx - {len(prefix)} = {span}",
                         hint="a stride larger than the window would skip tokens; leave it out for "
                              "non-overlapping windows")
    windows: list[Window] = []
    begin, scored_to = 0, 0
    while scored_to < len(stream):
        end = min(begin + span, len(stream))
        tokens = prefix + stream[begin:end]
        score_from = max(1, len(tokens) - (end - scored_to))
        if score_from < len(tokens):
            windows.append(Window(index=len(windows), tokens=tuple(tokens), score_from=score_from))
        scored_to = end
        begin += step
    return windows


def windows_sha256(windows: list[Window]) -> str:
    """sha256 over every window's length, first scored position and token ids (int32 little-endian)."""
    import numpy as np

    h = hashlib.sha256()
    for w in windows:
        h.update(len(w.tokens).to_bytes(4, "little"))
        h.update(w.score_from.to_bytes(4, "little"))
        h.update(np.asarray(w.tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """Whether the Hugging Face hub answers within ``timeout`` seconds; False at once when offline is set.

    The probe runs in a daemon thread so a hanging DNS lookup cannot hold evaluation up past the timeout.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            req = urllib.request.Request(constants.ENDPOINT.rstrip("/") + "/api/datasets/Salesforce/wikitext",
                                         method="HEAD")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                result.append(resp.status < 500)
        except Exception:  # any failure (DNS, refused, TLS, HTTP error) means "not reachable"
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result and result[0])


def tokenizer_sha256(path: Path) -> str:
    """sha256 over the tokenizer files of a checkpoint folder (name and content of each present)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def load_tokenizer(path: Path) -> Any:
    transformers = _require_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        raise UsageError(f"cannot load the tokenizer of the baseline {path}: {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}",
                         hint="the baseline must be a Hugging Face checkpoint with its tokenizer files") from None


def _require_transformers() -> Any:
    from quantkit.versions import require

    return require("transformers", "eval", "tokenizing the evaluation text")


def _read_text(dataset: str, field_name: str, notes: list[str]) -> tuple[str, Any]:
    from quantkit.calibration import eval_text

    if dataset != "auto":
        return eval_text(dataset, field_name)
    if hub_reachable():
        try:
            return eval_text(AUTO_HUB, field_name)
        except CalibrationError as e:
            notes.append(f"auto: WikiText-2 could not be loaded ({e.message}); used {AUTO_LOCAL}")
    else:
        notes.append(f"auto: the Hugging Face hub is not reachable (or HF_HUB_OFFLINE is set); used {AUTO_LOCAL}")
    return eval_text(AUTO_LOCAL, "text")


def build(baseline: Path, *, dataset: str = "auto", field_name: str = "text", ctx: int = 2048,
          stride: int | None = None, max_tokens: int | None = None) -> Protocol:
    """Read the text, tokenize it with the baseline's tokenizer and cut it into windows."""
    from quantkit.calibration import check_eval_field

    check_eval_field(dataset, field_name)
    if max_tokens is not None and max_tokens < MIN_TOKENS:
        raise UsageError(f"--max-tokens must be at least {MIN_TOKENS}, got {max_tokens}")
    cfg_path = baseline / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        limit = (cfg.get("text_config") or cfg).get("max_position_embeddings")
        if isinstance(limit, int) and ctx > limit:
            raise UsageError(f"--ctx {ctx} is longer than the baseline's context ({limit} positions)",
                             hint=f"use --ctx {limit} or less")
    notes: list[str] = []
    text, docs = _read_text(dataset, field_name, notes)
    if field_name != "text":  # what the text hash alone does not say: which of each record's fields it is
        notes.append(f"the text is each record's {field_name!r} field")
    tok = load_tokenizer(baseline)
    stream = list(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
    total = len(stream)
    if total < MIN_TOKENS:  # refused before any model is scored (--max-tokens keeps at least as many)
        raise CalibrationError(f"evaluation text {docs.source!r} gives {total} token{'s' * (total != 1)} with the "
                               f"baseline's tokenizer; an evaluation scores at least {MIN_TOKENS}",
                               hint="give a longer text (--dataset)")
    if max_tokens is not None:
        stream = stream[:max_tokens]
        if max_tokens > total:  # said, not left for the reader to spot in the count of tokens scored
            notes.append(f"--max-tokens {max_tokens:,} asks for more than the text gives: its {total:,} tokens are "
                         "all scored")
    bos = tok.bos_token_id
    windows = make_windows(stream, bos, ctx, stride)
    scored = sum(w.n_scored for w in windows)
    if scored < MIN_TOKENS:  # a tokenizer without BOS scores one token fewer per window than the text gives
        cut = f" cut to --max-tokens {max_tokens}" if max_tokens is not None and max_tokens < total else ""
        raise CalibrationError(f"evaluation text {docs.source!r}{cut} leaves {scored} tokens to score (the "
                               f"tokenizer has no BOS: each window's first token has no context and is not scored); "
                               f"an evaluation scores at least {MIN_TOKENS}",
                               hint="raise --max-tokens" if cut else "give a longer text (--dataset)")
    if bos is None:
        notes.append("the tokenizer has no BOS token: windows start with text and their first token is not scored")
    return Protocol(dataset=dataset, source=docs.source, kind=docs.kind, source_sha256=docs.file_sha256,
                    text_sha256=hashlib.sha256(text.encode()).hexdigest(), tokenizer=str(baseline),
                    tokenizer_sha256=tokenizer_sha256(baseline), bos_token_id=bos, ctx=ctx, stride=stride,
                    max_tokens=max_tokens, stream_tokens=total, windows=windows, notes=notes)
