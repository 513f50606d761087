"""Perplexity, KL divergence and top-1 agreement, accumulated window by window as engines stream them.

Tested with numpy 2.4.6.

Over the protocol's scored tokens (natural logarithms):

* perplexity: ``exp(mean NLL)``, with NLL ``-log p(actual next token)``;
* KLD: the mean over scored positions of ``KL(P_base || P_artifact) = sum_v p_base(v) (log p_base(v) - log
  p_artifact(v))``, the direction llama.cpp's ``perplexity --kl-divergence`` reports;
* top-1 agreement: the share of scored positions where both models' most likely next token is the same.

The baseline is run once. Its distributions are kept in a :class:`BaselineStore` on disk, one file per window,
and read back one window at a time while each artifact streams its own, so neither side's full set of logits
is ever in memory. The store keeps either

* ``full``: every log-probability in float16 (2 bytes x vocabulary per token; renormalised in float32 when
  read back, so rounding cannot make the two distributions differ by more than second-order terms). KLD is then
  exact. Chosen when it fits in ``DENSE_BUDGET_BYTES`` and half the free space of the temporary folder: a
  vocabulary of 8k costs 16 KiB per token, 128k costs 256 KiB per token.
* ``top-k``: the baseline's ``k`` most likely ids and their log-probabilities. KLD is then computed between the
  two distributions coarse-grained into ``k + 1`` bins: one per known id and one for the rest of the vocabulary
  (whose masses are ``1 - sum`` of the known ones on each side). By the data-processing inequality that is a
  lower bound on the true KL, tight when the baseline puts little mass outside its top-k.

Sparse engines (vLLM returns only the artifact's top-k) are handled by the same binning, over the ids whose
log-probabilities both sides know.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.engines.logits import LogProbs, Window, log_softmax
from quantkit.errors import BackendError

DENSE_BUDGET_BYTES = 8 << 30
DEFAULT_TOPK = 256
ROW_CHUNK = 256  # rows of [rows, vocab] temporaries at a time: bounded memory for 128k vocabularies


@dataclass
class BaselineWindow:
    """The stored baseline for one window: argmax, and either the full log-probs or the top-k."""

    argmax: np.ndarray
    dense: np.ndarray | None = None  # [n, vocab] float16 (memory-mapped), renormalised when used
    ids: np.ndarray | None = None
    values: np.ndarray | None = None


class BaselineStore:
    """The baseline's per-window distributions on disk, written once and read for every artifact."""

    def __init__(self, root: Path, tokens_scored: int, topk: int | None = None) -> None:
        self.root = root
        self.tokens_scored = tokens_scored
        self.forced_topk = topk
        self.mode: str | None = None
        self.topk: int | None = None
        self.vocab_size: int | None = None
        self._argmax: dict[int, np.ndarray] = {}

    def _choose(self, vocab: int) -> None:
        self.vocab_size = vocab
        need = self.tokens_scored * vocab * 2
        free = shutil.disk_usage(self.root).free
        if self.forced_topk is None and need <= min(DENSE_BUDGET_BYTES, free // 2):
            self.mode = "full"
        else:
            self.mode = "top-k"
            self.topk = min(vocab, self.forced_topk or DEFAULT_TOPK)

    @property
    def kld_method(self) -> str:
        if self.mode == "full":
            return "exact: full baseline distribution stored as float16 log-probabilities"
        return (f"lower bound: baseline top-{self.topk} ids as bins plus one bin for the rest of the vocabulary "
                "(full distribution did not fit the store budget)")

    def put(self, w: Window, lp: LogProbs) -> None:
        if lp.dense is None:
            raise BackendError("the baseline must be evaluated by an engine that returns full distributions",
                               hint="evaluate the baseline with transformers (the default)")
        if self.mode is None:
            self._choose(int(lp.dense.shape[-1]))
        self._argmax[w.index] = lp.dense.argmax(axis=-1).astype(np.int32)
        if self.mode == "full":
            np.save(self.root / f"w{w.index}.npy", lp.dense.astype(np.float16))
            return
        k = self.topk or DEFAULT_TOPK
        ids = np.argpartition(lp.dense, -k, axis=-1)[:, -k:]
        vals = np.take_along_axis(lp.dense, ids, axis=-1)
        order = np.argsort(-vals, axis=-1)
        np.save(self.root / f"w{w.index}.ids.npy", np.take_along_axis(ids, order, axis=-1).astype(np.int32))
        np.save(self.root / f"w{w.index}.values.npy", np.take_along_axis(vals, order, axis=-1).astype(np.float32))

    def get(self, w: Window) -> BaselineWindow:
        if self.mode == "full":
            return BaselineWindow(self._argmax[w.index], dense=np.load(self.root / f"w{w.index}.npy", mmap_mode="r"))
        return BaselineWindow(self._argmax[w.index], ids=np.load(self.root / f"w{w.index}.ids.npy"),
                              values=np.load(self.root / f"w{w.index}.values.npy"))


def kld_rows(base: BaselineWindow, art: LogProbs) -> np.ndarray:
    """KL(base || artifact) at each scored position of one window (exact, or binned; see the module docstring)."""
    n = len(base.argmax)
    out = np.empty(n, dtype=np.float64)
    for lo in range(0, n, ROW_CHUNK):
        hi = min(n, lo + ROW_CHUNK)
        out[lo:hi] = _kld_chunk(base, art, lo, hi)
    return np.maximum(out, 0.0)  # KL is non-negative; tiny negatives are rounding


def _kld_chunk(base: BaselineWindow, art: LogProbs, lo: int, hi: int) -> np.ndarray:
    if base.dense is not None:
        lb = log_softmax(base.dense[lo:hi])
        if art.dense is not None:
            _same_vocab(lb.shape[-1], art.dense.shape[-1])
            return _kl_exact(lb, art.dense[lo:hi])
        ids, known = _in_vocab(art.ids[lo:hi], lb.shape[-1])
        return _kl_binned(np.take_along_axis(lb, ids, axis=-1), art.values[lo:hi], known)
    bids, bvals = base.ids[lo:hi], base.values[lo:hi]
    if art.dense is not None:
        ids, known = _in_vocab(bids, art.dense.shape[-1])
        return _kl_binned(bvals, np.take_along_axis(art.dense[lo:hi], ids, axis=-1), known)
    # Both sparse: bins are the artifact's top-k ids that the baseline's top-k also holds.
    aids = art.ids[lo:hi]
    match = aids[:, :, None] == bids[:, None, :]
    known = match.any(axis=-1) & (aids >= 0)
    lb = np.take_along_axis(bvals, match.argmax(axis=-1), axis=-1)
    return _kl_binned(lb, art.values[lo:hi], known)


def _same_vocab(vb: int, va: int) -> None:
    if vb != va:
        raise BackendError(f"the artifact's vocabulary has {va} entries, the baseline's {vb}: their token ids do not "
                           "mean the same thing, so their distributions cannot be compared",
                           hint="evaluate an artifact against the model it was made from (--baseline)")


def _in_vocab(ids: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    known = (ids >= 0) & (ids < vocab)
    return np.where(known, ids, 0), known


def _kl_exact(lb: np.ndarray, la: np.ndarray) -> np.ndarray:
    p = np.exp(lb)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (lb - la), 0.0)
    return terms.sum(axis=-1, dtype=np.float64)


def _kl_binned(lb: np.ndarray, la: np.ndarray, known: np.ndarray) -> np.ndarray:
    """KL between both distributions coarse-grained to the ``known`` ids plus one bin for all other ids."""
    lb = np.where(known, lb, -np.inf).astype(np.float64)
    la = np.where(known, la, -np.inf).astype(np.float64)
    pb, pa = np.exp(lb), np.exp(la)
    with np.errstate(invalid="ignore", divide="ignore"):
        terms = np.where(pb > 0, pb * (lb - la), 0.0).sum(axis=-1)
        rb = np.clip(1.0 - pb.sum(axis=-1), 0.0, 1.0)
        ra = np.clip(1.0 - pa.sum(axis=-1), 0.0, 1.0)
        tail = np.where(rb > 1e-9, rb * (np.log(rb) - np.log(np.maximum(ra, 1e-30))), 0.0)
    return terms + tail


@dataclass
class Metrics:
    """The figures for one model over the protocol's scored tokens."""

    tokens: int
    nll: float
    ppl: float
    kld: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    top1: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: _finite(v) for k, v in self.__dict__.items()}


def _finite(v: Any) -> Any:
    """JSON has no inf/nan: a non-finite figure is written as null (and fails every gate it meets)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass
class Accumulator:
    """Running sums for one model; per-token KL values are kept (8 bytes a token) for the median and p99."""

    nll_sum: float = 0.0
    tokens: int = 0
    agree: int = 0
    compared: int = 0
    kl: list[np.ndarray] = field(default_factory=list)

    def add(self, w: Window, lp: LogProbs, base: BaselineWindow | None = None) -> None:
        targets = w.targets
        self.nll_sum -= float(np.asarray(lp.target_logprobs(targets), dtype=np.float64).sum())
        self.tokens += len(targets)
        if base is not None:
            self.agree += int((lp.argmax() == base.argmax).sum())
            self.compared += len(targets)
            self.kl.append(kld_rows(base, lp))

    def result(self) -> Metrics:
        nll = self.nll_sum / max(1, self.tokens)
        try:
            ppl = math.exp(nll)
        except OverflowError:
            ppl = math.inf
        m = Metrics(tokens=self.tokens, nll=nll, ppl=ppl)
        if self.compared:
            kl = np.concatenate(self.kl)
            m.kld = float(kl.mean())
            m.kld_median = float(np.median(kl))
            m.kld_p99 = float(np.percentile(kl, 99))
            m.kld_max = float(kl.max())
            m.top1 = self.agree / self.compared
        return m
