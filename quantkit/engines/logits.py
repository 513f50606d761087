"""The shape every engine shares: token windows in, next-token log-probabilities out.

Engines are tokenizer-agnostic on purpose. The evaluation protocol tokenizes the text once, with the
baseline's tokenizer, and every engine (transformers, llama.cpp, vLLM) is fed the very same token ids; an
engine that tokenized its own text could score a different sequence and its perplexity would not be
comparable. An engine yields one :class:`LogProbs` per window, for the scored positions only, so a caller never
holds more than one window's distributions at a time.

Dense engines (transformers, llama.cpp) return the full log-softmax over the vocabulary. Sparse engines (vLLM's
``prompt_logprobs``) return the top-k ids with their log-probabilities plus the log-probability of the actual
next token; :mod:`quantkit.evaluation.metrics` says how KL divergence is bounded from those.

Evaluation reads engines through :func:`scored_rows`: :class:`Rows`, the scored positions of consecutive windows as
torch tensors. An engine that computes in torch (transformers) gives them batched and on its own device
(``batches``), so the comparison runs where the logits are and only per-token figures reach the host; the others'
per-window :class:`LogProbs` are wrapped as they come.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from quantkit.engines import registry
from quantkit.errors import UsageError
from quantkit.formats import kinds
from quantkit.formats.names import EVALUATING, LLAMACPP, KindName
from quantkit.recipe import DEFAULT_STALL_TIMEOUT

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Window:
    """One evaluation window: token ids (BOS first when the tokenizer has one), scored from ``score_from``.

    Row ``i`` of the window's :class:`LogProbs` is the distribution predicting ``tokens[score_from + i]``,
    computed from ``tokens[:score_from + i]``.
    """

    index: int
    tokens: tuple[int, ...]
    score_from: int

    @property
    def n_scored(self) -> int:
        return len(self.tokens) - self.score_from

    @property
    def targets(self) -> np.ndarray:
        return np.asarray(self.tokens[self.score_from:], dtype=np.int64)


@dataclass
class LogProbs:
    """Next-token log-probabilities at one window's scored positions (natural log, float32).

    Either ``dense`` ([n, vocab], the whole distribution) or ``ids``/``values`` ([n, k], the top-k in rank
    order) together with ``target`` ([n], the log-probability of the actual next token).
    """

    dense: np.ndarray | None = None
    ids: np.ndarray | None = None
    values: np.ndarray | None = None
    target: np.ndarray | None = None

    def target_logprobs(self, targets: np.ndarray) -> np.ndarray:
        """log p(actual next token) at each scored position."""
        if self.dense is not None:
            return self.dense[np.arange(len(targets)), targets]
        assert self.target is not None, "a sparse engine must return the actual tokens' log-probabilities"
        return self.target

    def argmax(self) -> np.ndarray:
        """The most likely next token at each scored position."""
        if self.dense is not None:
            return self.dense.argmax(axis=-1)
        assert self.ids is not None
        return self.ids[:, 0]


@dataclass
class Rows:
    """Log-probabilities at the scored positions of consecutive windows, as torch tensors on one device: the rows of
    each window in turn (``sum(w.n_scored)`` of them), either ``dense`` ([rows, vocab] float32) or ``ids``/``values``
    ([rows, k], the top-k in rank order) with ``target`` ([rows], the actual next token's log-probability)."""

    windows: list[Window]
    dense: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    values: torch.Tensor | None = None
    target: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        t = self.dense if self.dense is not None else self.values
        assert t is not None
        return t.device

    def to(self, device: torch.device) -> Rows:
        """The same rows on ``device`` (themselves when they are there)."""
        if device == self.device:
            return self
        return Rows(self.windows, *(None if t is None else t.to(device)
                                    for t in (self.dense, self.ids, self.values, self.target)))

    @classmethod
    def of(cls, window: Window, lp: LogProbs) -> Rows:
        """One window's :class:`LogProbs` as rows on the CPU (the arrays shared, not copied)."""
        import torch

        if lp.dense is not None:
            return cls([window], dense=torch.from_numpy(np.ascontiguousarray(lp.dense, dtype=np.float32)))
        assert lp.ids is not None and lp.values is not None and lp.target is not None
        return cls([window], ids=torch.from_numpy(np.asarray(lp.ids, dtype=np.int64)),
                   values=torch.from_numpy(np.asarray(lp.values, dtype=np.float32)),
                   target=torch.from_numpy(np.asarray(lp.target, dtype=np.float32)))


@dataclass(frozen=True)
class EngineOptions:
    """How to run an engine; the protocol (windows, ctx) comes from the caller."""

    ctx: int
    device: str = "auto"
    python: str | None = None  # vLLM: the interpreter of vLLM's own environment
    topk: int = 20  # vLLM: log-probabilities returned per position
    numerics: str = "auto"  # an FP4 W4A4 artifact's activations: auto, emulated, weight-only (engines/numerics.py)
    batch: int | None = None  # transformers: windows per forward pass (None: chosen from free memory)
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT  # vLLM, SGLang: a load without progress this long is stopped


class LogitsEngine(Protocol):
    """What evaluation needs from an engine."""

    name: str

    def info(self) -> dict[str, Any]:
        """Engine name, version, device and model file, for the report's protocol section."""

    def logits(self, windows: Sequence[Window]) -> Iterator[LogProbs]:
        """Log-probabilities for each window's scored positions, one window at a time, in order."""

    def close(self) -> None:
        """Free the model (GPU memory, subprocess) before the next engine loads."""


def scored_rows(engine: LogitsEngine, windows: Sequence[Window]) -> Iterator[Rows]:
    """The engine's log-probabilities over ``windows``, in order: batched where it computes them (``batches``, an
    engine in torch), else one window at a time."""
    batches = getattr(engine, "batches", None)
    if batches is not None:
        yield from batches(windows)
        return
    for w, lp in zip(windows, engine.logits(windows), strict=True):
        yield Rows.of(w, lp)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, in float32."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def kind_refusal(engine: str, kind: str, path: Path) -> UsageError | None:
    """Why ``engine`` cannot read ``path`` of kind ``kind`` at all, from the kind alone: GGUF is llama.cpp's, and
    llama.cpp reads nothing else. :func:`check_compatible` asks it of the folder it finds, and a run's plan of an
    output not made yet, whose kind its format gives (:func:`quantkit.plan.evaluation_step`), so the two agree."""
    if engine == LLAMACPP and kind != KindName.GGUF:
        return UsageError(f"llama.cpp reads GGUF files; {path} holds none",
                          hint="use --engine transformers (or auto) for Hugging Face checkpoints")
    if engine != LLAMACPP and kind == KindName.GGUF:
        return UsageError(f"{path} is GGUF, which quantkit evaluates and serves with llama.cpp",
                          hint="use --engine llama.cpp (or auto)")
    return None


def check_compatible(kind: str, path: Path) -> None:
    """Refuse an engine that cannot read the path at all, before anything loads: the GGUF split here
    (:func:`kind_refusal`), what only one engine cannot read in that engine's ``refuse(path, kind)``."""
    if kind not in EVALUATING:
        raise UsageError(f"unknown engine {kind!r}; choose one of auto, {', '.join(EVALUATING)}")
    found = kinds.detect(path)
    if refused := kind_refusal(kind, found.name, path):
        raise refused
    _module(kind).refuse(path, found)


def _module(kind: str) -> Any:
    """The engine's logits module (its row's; imported now, its heavy library only when it loads a model)."""
    return importlib.import_module(registry.get(kind).logits or "")


def open_engine(kind: str, path: Path, options: EngineOptions) -> LogitsEngine:
    """Load ``path`` in the engine ``kind`` (the engine module and its library are imported only now)."""
    check_compatible(kind, path)
    return _module(kind).load(path, options)
