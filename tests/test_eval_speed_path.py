"""The batched, on-device scoring of ``quantkit eval`` gives the numbers of a plain per-window computation.

``quantkit eval`` runs the transformers engine over batches of windows and compares the artifact's log-probabilities
with the stored baseline's on the device where they are (:func:`quantkit.evaluation.metrics.score_rows`). Here the
real SmolLM2-135M-Instruct and a ``quantkit rtn`` artifact of it (the session's ``smollm2_rtn``, read only: nothing
here writes into it) are scored that way, with a batch size that does not divide the number of windows (and a last
window shorter than the others), and the perplexities, KLD and top-1 agreement are checked against a straightforward
computation written here: plain torch, one window at a time, KL in float64 from full float32 distributions. On the
CPU (float32) they agree to 4 decimals; the CUDA variant runs the model in its bfloat16, where a batch of windows and
one window alone go through differently tiled matrix products.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from conftest import requires_gpu
from quantkit.engines.logits import EngineOptions, open_engine, scored_rows
from quantkit.evaluation import protocol
from quantkit.evaluation.evaluate import EvalOptions, evaluate

pytestmark = pytest.mark.e2e

CTX = 256
TOKENS = 1536  # 7 windows: six of BOS + 255 tokens and a last one of BOS + 6
BATCH = 3  # does not divide 7
STRIDED_TOKENS = 640  # with a stride of CTX / 2: a window scoring BOS + 255 tokens, three scoring 128, a last one 1


def reference(base: Path, art: Path, device: str, dtype: Any) -> dict[str, float]:
    """ppl of both models, KLD(base || art) and top-1 agreement, one window at a time in plain torch."""
    windows = protocol.build(base, dataset="heldout", ctx=CTX, max_tokens=TOKENS).windows
    assert len(windows) % BATCH and len({len(w.tokens) for w in windows}) == 2
    return compare(windows, hf_logprobs(base, windows, device, dtype), hf_logprobs(art, windows, device, dtype))


def hf_logprobs(path: Path, windows: list[Any], device: str, dtype: Any) -> list[Any]:
    """Each window's scored rows from a plain transformers forward pass, as float64 log-probabilities."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor([w.tokens], device=device)).logits[0, w.score_from - 1:-1]
            out.append(logits.float().log_softmax(-1).double())
    del model
    return out


def compare(windows: list[Any], lb: list[Any], la: list[Any]) -> dict[str, float]:
    """ppl of both, KLD(base || art) and top-1 agreement over the windows' scored rows (float64)."""
    import torch

    targets = [torch.tensor(w.tokens[w.score_from:], device=b.device) for w, b in zip(windows, lb)]
    n = sum(len(t) for t in targets)

    def ppl(lps: list[Any]) -> float:
        return math.exp(-sum(lp.gather(1, t[:, None]).sum().item() for lp, t in zip(lps, targets)) / n)

    kld = sum((b.exp() * (b - a)).sum().item() for b, a in zip(lb, la)) / n
    top1 = sum((b.argmax(-1) == a.argmax(-1)).sum().item() for b, a in zip(lb, la)) / n
    return {"tokens": n, "ppl_base": ppl(lb), "ppl": ppl(la), "kld": kld, "top1": top1}


def batched(base: Path, art: Path, device: str) -> tuple[dict[str, float], Any]:
    options = EvalOptions(dataset="heldout", ctx=CTX, max_tokens=TOKENS, engine="transformers", device=device,
                          batch=BATCH, write=False)
    report = evaluate([art], str(base), options)
    m = report.results[0].metrics
    return {"tokens": m.tokens, "ppl_base": report.baseline.metrics.ppl, "ppl": m.ppl, "kld": m.kld,
            "top1": m.top1}, report


def test_batched_on_device_scores_equal_the_per_window_reference_on_cpu(smollm2: Path, smollm2_rtn: Path) -> None:
    import torch

    ours, report = batched(smollm2, smollm2_rtn, "cpu")
    ref = reference(smollm2, smollm2_rtn, "cpu", torch.float32)
    assert report.kld_method.startswith("exact") and "memory (cpu)" in report.kld_method, report.kld_method
    assert report.results[0].engine["batch"] == BATCH
    assert ours["tokens"] == ref["tokens"] == TOKENS
    assert ours["kld"] > 0.1 and ours["top1"] < 0.9, ours  # a 4-bit artifact: the comparison has something to find
    for key in ("ppl_base", "ppl"):
        assert abs(ours[key] / ref[key] - 1) < 1e-5, (key, ours[key], ref[key])
    for key in ("kld", "top1"):
        assert round(ours[key], 4) == pytest.approx(round(ref[key], 4), abs=1.01e-4), (key, ours[key], ref[key])


def test_llamacpp_scores_only_the_scored_rows_and_gives_the_previous_paths_numbers(smollm2: Path) -> None:
    """The llama.cpp engine asks llama.cpp for logits at the scored positions only (its batch's per-token flags) and
    turns them into log-probabilities in place, in its own buffer (``logits()`` hands out copies). On the real
    model's own GGUF, with windows that score all their tokens (the first) and
    windows that score only their second half (a stride of ctx/2), each window's rows equal those of the previous
    path (``Llama.eval`` with ``logits_all``, every position's logits, the scored rows cut out), and ``quantkit
    eval``'s figures equal the plain per-window computation over those rows (baseline in transformers) to 4
    decimals."""
    import llama_cpp
    import torch

    gguf = smollm2 / json.loads((smollm2 / "BUILD.json").read_text())["original"]
    report = evaluate([gguf], str(smollm2), EvalOptions(dataset="heldout", ctx=CTX, max_tokens=STRIDED_TOKENS,
                                                        stride=CTX // 2, engine="llama.cpp", device="cpu", write=False))
    windows = report.protocol.windows
    assert windows[0].score_from == 1 and {w.score_from for w in windows[1:-1]} == {CTX // 2}, windows
    assert len(windows) == 5 and report.protocol.tokens_scored == STRIDED_TOKENS, windows
    engine = open_engine("llama.cpp", gguf, EngineOptions(ctx=CTX, device="cpu"))
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=CTX, n_batch=CTX, logits_all=True, flash_attn=True,
                          verbose=False)
    previous = []
    try:
        for w, rows in zip(windows, scored_rows(engine, windows), strict=True):
            llm.reset()
            llm.eval(list(w.tokens))
            full = torch.log_softmax(torch.from_numpy(llm.scores[w.score_from - 1:len(w.tokens) - 1]), dim=-1)
            assert rows.dense is not None and rows.dense.shape == full.shape, (w.index, full.shape)
            assert torch.allclose(rows.dense, full, rtol=0, atol=1e-5), (w.index, (rows.dense - full).abs().max())
            previous.append(full.double())
        # The rows are log-softmaxed in llama.cpp's own buffer, which the next window overwrites; what logits()
        # hands out is each window's own copy, still that window's after the next ones were decoded.
        kept = list(engine.logits(windows[:3]))
        for got, want in zip(kept, previous, strict=False):
            assert torch.allclose(torch.from_numpy(got.dense).double(), want, rtol=0, atol=1e-5)
    finally:
        engine.close()
        llm.close()
    ref = compare(windows, hf_logprobs(smollm2, windows, "cpu", torch.float32), previous)
    m = report.results[0].metrics
    ours = {"tokens": m.tokens, "ppl_base": report.baseline.metrics.ppl, "ppl": m.ppl, "kld": m.kld, "top1": m.top1}
    assert ours["tokens"] == ref["tokens"] == report.protocol.tokens_scored
    assert ours["kld"] > 1e-4 and ours["top1"] < 1, ours  # the GGUF's llama.cpp kernels differ: something to find
    for key in ("ppl_base", "ppl"):
        assert abs(ours[key] / ref[key] - 1) < 1e-5, (key, ours[key], ref[key])
    for key in ("kld", "top1"):
        assert round(ours[key], 4) == pytest.approx(round(ref[key], 4), abs=1.01e-4), (key, ours[key], ref[key])


@requires_gpu
def test_batched_on_device_scores_equal_the_per_window_reference_on_cuda(smollm2: Path, smollm2_rtn: Path) -> None:
    ours, report = batched(smollm2, smollm2_rtn, "cuda")
    ref = reference(smollm2, smollm2_rtn, "cuda", "auto")
    assert "GPU memory" in report.kld_method, report.kld_method
    assert ours["tokens"] == ref["tokens"] == TOKENS
    # bfloat16: the batched and the single-window products may round a logit differently, by one bfloat16 ulp.
    for key in ("ppl_base", "ppl"):
        assert abs(ours[key] / ref[key] - 1) < 1e-3, (key, ours[key], ref[key])
    assert abs(ours["kld"] - ref["kld"]) < 1e-3 and abs(ours["top1"] - ref["top1"]) < 3e-3, (ours, ref)


@pytest.mark.unit
def test_the_torch_comparison_equals_numpys_for_every_pairing(tmp_path: Path) -> None:
    """Dense against dense (exact), and the binned bound of a sparse artifact (vLLM, SGLang) or a top-k baseline:
    :func:`score_rows` in torch gives what :func:`kld_rows` gives in numpy, row by row."""
    import numpy as np
    import torch

    from quantkit.engines.logits import LogProbs, Rows, Window, log_softmax
    from quantkit.evaluation.metrics import BaselineStore, kld_rows, score_rows

    rng = np.random.default_rng(0)
    vocab, k = 300, 8
    windows = [Window(index=i, tokens=tuple(int(t) for t in rng.integers(0, vocab, 9)), score_from=1 + i)
               for i in range(3)]
    n = [w.n_scored for w in windows]
    logits = rng.normal(size=(sum(n), vocab)) * 3
    logits[0, :3] = -np.inf  # ids the baseline gives no mass at all: their terms are 0, not 0 x -inf
    lb = log_softmax(logits)
    la = log_softmax(logits + rng.normal(size=logits.shape))
    order = np.argsort(-la, axis=-1)[:, :k]
    sparse = LogProbs(ids=order, values=np.take_along_axis(la, order, -1), target=la[np.arange(len(la)), 0])
    cuts = np.cumsum([0, *n])
    for topk in (None, k):
        store = BaselineStore(tmp_path / f"s{topk}", sum(n), topk)
        store.root.mkdir()
        store.put_rows(Rows(windows, dense=torch.from_numpy(lb)))
        for art in (LogProbs(dense=la), sparse):
            got = np.concatenate([score_rows(Rows.of(w, _rows_of(art, cuts[i], cuts[i + 1])), store).kl
                                  for i, w in enumerate(windows)])
            want = np.concatenate([kld_rows(store.get(w), _rows_of(art, cuts[i], cuts[i + 1]))
                                   for i, w in enumerate(windows)])
            assert np.allclose(got, want, rtol=1e-5, atol=1e-7), (topk, art.dense is None)
            assert got.mean() > 0.05


def _rows_of(lp: Any, lo: int, hi: int) -> Any:
    from quantkit.engines.logits import LogProbs

    if lp.dense is not None:
        return LogProbs(dense=lp.dense[lo:hi])
    return LogProbs(ids=lp.ids[lo:hi], values=lp.values[lo:hi], target=lp.target[lo:hi])


@pytest.mark.unit
def test_the_vllm_worker_reads_flat_logprobs_as_it_reads_the_dicts() -> None:
    """vLLM's prompt log-probabilities as ``append_logprobs_for_next_position`` stores them, both ways: a list of
    per-position dicts ({id: Logprob(logprob, rank)}, the prompt token first, deduplicated when it is in the top-k)
    and a FlatLogprobs (start/end indices over flat columns, the prompt token's entry first, nothing deduplicated;
    the first prompt position empty). The worker's whole-array reading of the flat one equals its reading of the
    dicts, and both equal the distributions they came from."""
    import importlib.util
    from collections import namedtuple
    from types import SimpleNamespace

    import numpy as np

    from quantkit.engines.logits import log_softmax
    from quantkit.engines.vllm import logits as vllm_logits

    spec = importlib.util.spec_from_file_location("_logits_worker", vllm_logits.WORKER)
    worker = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(worker)
    Logprob = namedtuple("Logprob", "logprob rank decoded_token")
    rng = np.random.default_rng(1)
    vocab, k, score_from = 64, 5, 3
    tokens = [int(t) for t in rng.integers(0, vocab, 12)]
    lp = log_softmax(rng.normal(size=(len(tokens), vocab)) * 2)  # row p: the distribution of token p
    tokens[6] = int(np.argmax(lp[6]))  # a prompt token inside its position's top-k
    dicts: list[Any] = [None]
    flat = SimpleNamespace(start_indices=[0], end_indices=[0], token_ids=[], logprobs=[])
    for p in range(1, len(tokens)):
        top = np.argsort(-lp[p], kind="stable")[:k]
        rank = int((lp[p] > lp[p, tokens[p]]).sum()) + 1
        ids, values, ranks = [tokens[p], *top.tolist()], [float(lp[p, tokens[p]]), *lp[p, top].tolist()], \
            [rank, *range(1, k + 1)]
        dicts.append({i: Logprob(v, r, None) for i, v, r in zip(ids, values, ranks)})
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += ids
        flat.logprobs += values
        flat.end_indices.append(len(flat.token_ids))
    from_flat = worker._window_arrays(np, flat, tokens, score_from, k)
    from_dicts = worker._window_arrays(np, dicts, tokens, score_from, k)
    rows = lp[score_from:]
    truth = (rows[np.arange(len(rows)), tokens[score_from:]], np.argsort(-rows, axis=1, kind="stable")[:, :k])
    for got in (from_flat, from_dicts):
        assert np.allclose(got[0], truth[0], atol=1e-6) and (got[1] == truth[1]).all()
        assert np.allclose(got[2], np.take_along_axis(rows, truth[1], 1), atol=1e-6)


def test_each_served_engine_of_the_speed_bench_scores_an_artifact_it_runs(smollm2: Path, smollm2_rtn: Path,
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/eval_speed.py's SGLang part stopped at quantkit's own refusal on an H100 (2026-12-07): it scored the RTN
    artifact, and SGLang 0.5.17 runs W4A16 only in Marlin, whose tiles do not divide SmolLM2's 576-wide layers. Each
    served engine's artifact (the bench's SCORED) passes that engine's check, made as the bench makes it."""
    from quantkit.engines.logits import check_compatible
    from quantkit.errors import UsageError

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import eval_speed

    made = eval_speed.artifacts(smollm2, tmp_path, ["sglang"])
    assert set(made) == {eval_speed.SCORED["sglang"]}
    check_compatible("sglang", made[eval_speed.SCORED["sglang"]])
    assert eval_speed.SCORED["vllm"] == eval_speed.SCORED["transformers"] == "rtn"
    check_compatible("vllm", smollm2_rtn)
    with pytest.raises(UsageError, match="Marlin"):
        check_compatible("sglang", smollm2_rtn)
