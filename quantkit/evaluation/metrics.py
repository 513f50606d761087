"""Perplexity, KL divergence and top-1 agreement, accumulated batch by batch as engines stream them.

Tested with numpy 2.4.6 and torch 2.13.0 (CPU; the same code runs on CUDA).

Over the protocol's scored tokens (natural logarithms):

* perplexity: ``exp(mean NLL)``, with NLL ``-log p(actual next token)``;
* KLD: the mean over scored positions of ``KL(P_base || P_artifact) = sum_v p_base(v) (log p_base(v) - log
  p_artifact(v))``, the direction llama.cpp's ``perplexity --kl-divergence`` reports;
* top-1 agreement: the share of scored positions where both models' most likely next token is the same.

The baseline is run once. Its distributions are kept in a :class:`BaselineStore`, one row per scored token in
the protocol's order, and read back batch by batch while each artifact computes its own, so neither side's full
set of logits is ever held twice. The store keeps either

* ``full``: every log-probability in float16 (2 bytes x vocabulary per token; renormalised in float32 when
  read back, so rounding cannot make the two distributions differ by more than second-order terms). KLD is then
  exact. Kept on the device the baseline ran on (GPU memory, or host memory on a CPU) when it fits a share of that
  device's free memory (:func:`device_budget`), else on disk when it fits ``DENSE_BUDGET_BYTES`` and half the free
  space of the temporary folder: a vocabulary of 8k costs 16 KiB per token, 128k costs 256 KiB per token.
* ``top-k``: the baseline's ``k`` most likely ids and their log-probabilities. KLD is then computed between the
  two distributions coarse-grained into ``k + 1`` bins: one per known id and one for the rest of the vocabulary
  (whose masses are ``1 - sum`` of the known ones on each side). By the data-processing inequality that is a
  lower bound on the true KL, tight when the baseline puts little mass outside its top-k.

Sparse engines (vLLM returns only the artifact's top-k) are handled by the same binning, over the ids whose
log-probabilities both sides know.

The comparison (:func:`score_rows`) runs in torch on the device where the artifact's log-probabilities are (the
GPU for transformers on CUDA), the baseline's rows brought there; only per-token figures (NLL, KL, whether the
top-1 tokens agree) go to the host. :func:`kld_rows` is the same KL in numpy, one window at a time, for callers that
hold numpy arrays (image prompts).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from quantkit.engines.logits import LogitsEngine, LogProbs, Rows, Window, log_softmax, scored_rows
from quantkit.errors import BackendError

if TYPE_CHECKING:
    import torch

DENSE_BUDGET_BYTES = 8 << 30
DEFAULT_TOPK = 256
ROW_CHUNK = 256  # rows of [rows, vocab] temporaries at a time: bounded memory for 128k vocabularies
DEVICE_SHARE = 0.4  # of a GPU's free memory the baseline may keep (the artifact's model and batches need the rest)
HOST_SHARE = 0.25  # of the host's available memory, on a CPU
SHARED_GPU_SHARE = 0.05  # vLLM takes 0.8 of a GPU's memory by default, SGLang about as much: room for the rest
# One [rows, vocab] float32 temporary of the comparison. On the host it stays under glibc's 32 MB mmap threshold, so
# each chunk's temporaries reuse the heap (and the cache) instead of faulting in fresh pages: the KL of 1,023 rows of a
# 49k vocabulary took 0.24 s in 64 MB chunks and 0.04 s in 8 MB ones on the 2-core CPU.
CHUNK_BYTES = {"cuda": 256 << 20, "cpu": 8 << 20}


def device_budget(device: torch.device, shared: bool = False) -> int:
    """Bytes of the baseline's full distributions that may stay on ``device``: a share of its free memory now; a
    GPU that an engine in another process (vLLM, SGLang) will load onto, asking for most of its memory, lends at
    most :data:`SHARED_GPU_SHARE` of its whole."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(min(free * DEVICE_SHARE, total * SHARED_GPU_SHARE if shared else free))
    if device.type == "cpu":
        import psutil

        return int(min(DENSE_BUDGET_BYTES, psutil.virtual_memory().available * HOST_SHARE))
    return 0


def row_chunk(vocab: int, device: torch.device) -> int:
    """Rows per step of the comparison, so that each [rows, vocab] float32 temporary stays within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cpu"]) // (4 * vocab))


@dataclass
class BaselineWindow:
    """The stored baseline for one window, as numpy arrays: argmax, and either the full log-probs or the top-k."""

    argmax: np.ndarray
    dense: np.ndarray | None = None  # [n, vocab] float16, renormalised when used
    ids: np.ndarray | None = None
    values: np.ndarray | None = None


@dataclass
class BaselineRows:
    """The stored baseline at a batch of scored rows, on the device they are compared on."""

    argmax: torch.Tensor  # [n] int64
    dense: torch.Tensor | None = None  # [n, vocab] float16, renormalised when used
    ids: torch.Tensor | None = None  # [n, k] int64, rank order
    values: torch.Tensor | None = None  # [n, k] float32


class BaselineStore:
    """The baseline's distributions at every scored token, written once and read for every artifact.

    Rows are kept in the order windows are put (the protocol's); ``put_rows``/``rows`` move whole batches, ``put``
    and ``get`` one window as numpy arrays."""

    def __init__(self, root: Path, tokens_scored: int, topk: int | None = None, shared_gpu: bool = False) -> None:
        self.root = root
        self.shared_gpu = shared_gpu  # an engine in another process will load onto the GPU (device_budget)
        self.tokens_scored = tokens_scored
        self.forced_topk = topk
        self.mode: str | None = None
        self.device: torch.device | None = None  # full mode on a device (a torch tensor there); None: on disk
        self.compare_device: torch.device | None = None  # the baseline's own device, where rows are compared
        self.topk: int | None = None
        self.vocab_size: int | None = None
        self._offsets: dict[int, tuple[int, int]] = {}
        self._filled = 0
        self._argmax = np.empty(tokens_scored, dtype=np.int64)
        self._dense: Any = None  # torch.Tensor on the device, or np.memmap on disk
        self._ids: np.ndarray | None = None
        self._values: np.ndarray | None = None

    def _choose(self, vocab: int, device: torch.device) -> None:
        import torch

        self.vocab_size = vocab
        self.compare_device = device
        need = self.tokens_scored * vocab * 2
        if self.forced_topk is None and need <= device_budget(device, self.shared_gpu):
            self.mode, self.device = "full", device
            self._dense = torch.empty((self.tokens_scored, vocab), dtype=torch.float16, device=device)
            return
        if self.forced_topk is None and need <= min(DENSE_BUDGET_BYTES, shutil.disk_usage(self.root).free // 2):
            self.mode = "full"
            self._dense = np.lib.format.open_memmap(self.root / "baseline.f16.npy", mode="w+", dtype=np.float16,
                                                    shape=(self.tokens_scored, vocab))
            return
        self.mode = "top-k"
        self.topk = min(vocab, self.forced_topk or DEFAULT_TOPK)
        shape = (self.tokens_scored, self.topk)
        self._ids = np.lib.format.open_memmap(self.root / "baseline.ids.npy", mode="w+", dtype=np.int32, shape=shape)
        self._values = np.lib.format.open_memmap(self.root / "baseline.values.npy", mode="w+", dtype=np.float32,
                                                 shape=shape)

    @property
    def kld_method(self) -> str:
        if self.mode == "full":
            where = "on disk" if self.device is None else \
                f"in {'GPU' if self.device.type == 'cuda' else 'host'} memory ({self.device})"
            return f"exact: full baseline distribution stored as float16 log-probabilities {where}"
        return (f"lower bound: baseline top-{self.topk} ids as bins plus one bin for the rest of the vocabulary "
                "(full distribution did not fit the store budget)")

    def put_rows(self, rows: Rows) -> None:
        """Keep a batch of the baseline's rows (dense: the baseline runs in an engine that returns whole
        distributions)."""
        import torch

        if rows.dense is None:
            raise BackendError("the baseline must be evaluated by an engine that returns full distributions",
                               hint="evaluate the baseline with transformers (the default)")
        lp = rows.dense
        if self.mode is None:
            self._choose(int(lp.shape[-1]), lp.device)
        start = self._filled
        for w in rows.windows:
            self._offsets[w.index] = (self._filled, w.n_scored)
            self._filled += w.n_scored
        end = self._filled
        if end > self.tokens_scored or lp.shape[0] != end - start:
            raise BackendError(f"the baseline gave {lp.shape[0]} rows for {end - start} scored tokens "
                               f"({self.tokens_scored} expected in all)")
        with torch.inference_mode():
            self._argmax[start:end] = lp.argmax(dim=-1).cpu().numpy()
            # Converted straight into the store (no float16 temporary of the batch's size in between).
            if self.mode == "full" and self.device is not None:
                self._dense[start:end].copy_(lp)
            elif self.mode == "full":
                torch.from_numpy(self._dense[start:end]).copy_(lp)
            else:
                assert self._ids is not None and self._values is not None
                values, ids = lp.topk(self.topk or DEFAULT_TOPK, dim=-1)  # sorted, most likely first
                self._ids[start:end] = ids.cpu().numpy()
                self._values[start:end] = values.cpu().numpy()

    def put(self, w: Window, lp: LogProbs) -> None:
        """Keep one window's rows, given as numpy arrays."""
        self.put_rows(Rows.of(w, lp))

    def _span(self, windows: Sequence[Window]) -> tuple[int, int] | list[int]:
        """The stored rows of ``windows``: one (start, end) when they lie together (as batches do), else indices."""
        spans = [self._offsets[w.index] for w in windows]
        if all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
            return spans[0][0], spans[-1][0] + spans[-1][1]
        return [i for s, n in spans for i in range(s, s + n)]

    def rows(self, windows: Sequence[Window], device: torch.device) -> BaselineRows:
        """The baseline at the scored rows of ``windows``, brought to ``device``."""
        import torch

        span = self._span(windows)
        pick = slice(*span) if isinstance(span, tuple) else span
        argmax = torch.from_numpy(self._argmax[pick]).to(device)
        if self.mode == "full" and self.device is not None:
            index = pick if isinstance(pick, slice) else torch.tensor(pick, device=self._dense.device)
            return BaselineRows(argmax, dense=self._dense[index].to(device))
        if self.mode == "full":
            return BaselineRows(argmax, dense=torch.from_numpy(np.ascontiguousarray(self._dense[pick])).to(device))
        assert self._ids is not None and self._values is not None
        return BaselineRows(argmax, ids=torch.from_numpy(self._ids[pick].astype(np.int64)).to(device),
                            values=torch.from_numpy(np.ascontiguousarray(self._values[pick])).to(device))

    def get(self, w: Window) -> BaselineWindow:
        """One window's stored baseline as numpy arrays (for :func:`kld_rows`)."""
        b = self.rows([w], _cpu())
        if b.dense is not None:
            return BaselineWindow(b.argmax.numpy(), dense=b.dense.numpy())
        assert b.ids is not None and b.values is not None
        return BaselineWindow(b.argmax.numpy(), ids=b.ids.numpy(), values=b.values.numpy())


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


@dataclass
class TokenScores:
    """Per-token figures of a batch, on the host: NLL, and against a baseline the KL and top-1 agreement."""

    nll: np.ndarray
    kl: np.ndarray | None = None
    agree: np.ndarray | None = None


def score_rows(rows: Rows, base: BaselineStore | None = None) -> TokenScores:
    """NLL of the actual tokens, and against the stored baseline the KL(base || rows) and top-1 agreement, at every
    scored row of ``rows``, computed on the device the baseline ran on (else the rows' own); only the per-token
    results are copied to the host."""
    import torch

    # Rows are compared on the baseline's device (a GPU), where rows an engine gave on the host go: moving them is
    # cheaper than moving the baseline's whole distributions out, and the GPU computes the comparison faster.
    device = base.compare_device if base is not None and base.compare_device is not None else rows.device
    with torch.inference_mode():
        rows = rows.to(device)
        targets = torch.from_numpy(np.concatenate([w.targets for w in rows.windows])).to(device)
        if rows.dense is not None:
            nll = -rows.dense.gather(1, targets[:, None])[:, 0]
            top = rows.dense.argmax(dim=-1)
        else:
            assert rows.ids is not None and rows.target is not None
            nll, top = -rows.target, rows.ids[:, 0]
        if base is None:
            return TokenScores(nll=nll.double().cpu().numpy())
        b = base.rows(rows.windows, device)
        kl = _kl(b, rows)
        return TokenScores(nll=nll.double().cpu().numpy(), kl=kl.cpu().numpy(), agree=(top == b.argmax).cpu().numpy())


def score_windows(engine: LogitsEngine, windows: Sequence[Window], store: BaselineStore, *, baseline: bool,
                  progress: Callable[[int], None] | None = None) -> Metrics:
    """One model over ``windows`` as ``quantkit eval`` scores it: the baseline fills ``store``, any other model is
    compared against it batch by batch (:func:`score_rows`); ``progress`` hears the tokens each batch scored."""
    acc = Accumulator()
    for rows in scored_rows(engine, windows):
        if baseline:
            store.put_rows(rows)
        acc.add_scores(score_rows(rows, None if baseline else store))
        if progress is not None:
            progress(sum(w.n_scored for w in rows.windows))
    return acc.result()


def _kl(b: BaselineRows, a: Rows) -> torch.Tensor:
    """KL(base || artifact) per row in float64, exact when both are dense, else binned (see the module docstring);
    in chunks of rows so no [rows, vocab] temporary outgrows :data:`CHUNK_BYTES`."""
    import torch

    n = len(b.argmax)
    width = a.dense.shape[-1] if a.dense is not None else b.dense.shape[-1] if b.dense is not None else 1
    step = row_chunk(width, b.argmax.device)
    out = torch.empty(n, dtype=torch.float64, device=b.argmax.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        out[lo:hi] = _kl_chunk(b, a, lo, hi)
    return out.clamp_min(0.0)  # KL is non-negative; tiny negatives are rounding


def _kl_chunk(b: BaselineRows, a: Rows, lo: int, hi: int) -> torch.Tensor:
    import torch

    if b.dense is not None:
        # The stored float16 log-probabilities lb' are renormalised: lb = lb' - c with c = log sum exp(lb') (about 0,
        # so exp(lb') cannot overflow). Then KL = sum p (lb - la) = exp(-c) sum exp(lb') (lb' - la) - c: one exp,
        # one difference and one dot product per row, the fewest passes over [rows, vocab].
        lb = b.dense[lo:hi].float()
        eb = lb.exp()
        c = eb.sum(dim=-1).log()
        if a.dense is not None:
            _same_vocab(lb.shape[-1], a.dense.shape[-1])
            la = a.dense[lo:hi]
            kl = torch.linalg.vecdot(eb, lb - la) * (-c).exp() - c
            if (bad := kl.isnan()).any():  # 0 x -inf where the baseline gives a token no mass: that term is 0
                lbn, lan = lb[bad] - c[bad, None], la[bad]
                p = lbn.exp()
                kl[bad] = torch.where(p > 0, p * (lbn - lan), 0.0).sum(dim=-1)
            return kl.double()
        assert a.ids is not None and a.values is not None
        ids, known = _known(a.ids[lo:hi], lb.shape[-1])
        return _binned(lb.gather(1, ids) - c[:, None], a.values[lo:hi], known)
    assert b.ids is not None and b.values is not None
    bids, bvals = b.ids[lo:hi], b.values[lo:hi]
    if a.dense is not None:
        ids, known = _known(bids, a.dense.shape[-1])
        return _binned(bvals, a.dense[lo:hi].gather(1, ids), known)
    # Both sparse: bins are the artifact's top-k ids that the baseline's top-k also holds.
    assert a.ids is not None and a.values is not None
    aids = a.ids[lo:hi]
    match = aids[:, :, None] == bids[:, None, :]
    known = match.any(dim=-1) & (aids >= 0)
    return _binned(bvals.gather(1, match.int().argmax(dim=-1)), a.values[lo:hi], known)


def _known(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    known = (ids >= 0) & (ids < vocab)
    return ids.where(known, 0), known


def _binned(lb: torch.Tensor, la: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """KL between both distributions coarse-grained to the ``known`` ids plus one bin for all other ids."""
    import torch

    lb = lb.double().where(known, -math.inf)
    la = la.double().where(known, -math.inf)
    pb, pa = lb.exp(), la.exp()
    terms = torch.where(pb > 0, pb * (lb - la), 0.0).sum(dim=-1)
    rb = (1.0 - pb.sum(dim=-1)).clamp(0.0, 1.0)
    ra = (1.0 - pa.sum(dim=-1)).clamp(0.0, 1.0)
    tail = torch.where(rb > 1e-9, rb * (rb.log() - ra.clamp_min(1e-30).log()), 0.0)
    return terms + tail


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

    def add_scores(self, s: TokenScores) -> None:
        """A batch's per-token figures (:func:`score_rows`)."""
        self.nll_sum += float(s.nll.sum(dtype=np.float64))
        self.tokens += len(s.nll)
        if s.kl is not None and s.agree is not None:
            self.agree += int(s.agree.sum())
            self.compared += len(s.kl)
            self.kl.append(s.kl)

    def add(self, w: Window, lp: LogProbs, base: BaselineWindow | None = None) -> None:
        """One window's numpy log-probabilities, against the baseline's numpy arrays (:meth:`BaselineStore.get`)."""
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
