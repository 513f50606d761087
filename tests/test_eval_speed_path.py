"""The batched, on-device scoring of ``quantkit eval`` gives the numbers of a plain per-window computation.

``quantkit eval`` runs the transformers engine over batches of windows and compares the artifact's log-probabilities
with the stored baseline's on the device where they are (:func:`quantkit.evaluation.metrics.score_rows`). Here the
real SmolLM2-135M-Instruct and a ``quantkit rtn`` artifact of it are scored that way, with a batch size that does not
divide the number of windows (and a last window shorter than the others), and the perplexities, KLD and top-1
agreement are checked against a straightforward computation written here: plain torch, one window at a time, KL in
float64 from full float32 distributions. On the CPU (float32) they agree to 4 decimals; the CUDA variant runs the
model in its bfloat16, where a batch of windows and one window alone go through differently tiled matrix products.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from conftest import quantkit, requires_gpu
from quantkit.evaluation import protocol
from quantkit.evaluation.evaluate import EvalOptions, evaluate

pytestmark = pytest.mark.e2e

CTX = 256
TOKENS = 1536  # 7 windows: six of BOS + 255 tokens and a last one of BOS + 6
BATCH = 3  # does not divide 7


@pytest.fixture(scope="module")
def rtn(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("speed") / "rtn"
    quantkit("rtn", smollm2, out, "--quiet", check=True)
    return out


def reference(base: Path, art: Path, device: str, dtype: Any) -> dict[str, float]:
    """ppl of both models, KLD(base || art) and top-1 agreement, one window at a time in plain torch."""
    import torch
    from transformers import AutoModelForCausalLM

    windows = protocol.build(base, dataset="heldout", ctx=CTX, max_tokens=TOKENS).windows
    assert len(windows) % BATCH and len({len(w.tokens) for w in windows}) == 2

    def run(path: Path) -> list[Any]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        out = []
        with torch.no_grad():
            for w in windows:
                logits = model(torch.tensor([w.tokens], device=device)).logits[0, w.score_from - 1:-1]
                out.append(logits.float().log_softmax(-1).double())
        del model
        return out

    lb, la = run(base), run(art)
    targets = [torch.tensor(w.tokens[w.score_from:], device=device) for w in windows]
    n = sum(len(t) for t in targets)

    def ppl(lps: list[Any]) -> float:
        return math.exp(-sum(lp.gather(1, t[:, None]).sum().item() for lp, t in zip(lps, targets)) / n)

    kld = sum((b.exp() * (b - a)).sum().item() for b, a in zip(lb, la)) / n
    top1 = sum((b.argmax(-1) == a.argmax(-1)).sum().item() for b, a in zip(lb, la)) / n
    return {"tokens": n, "ppl_base": ppl(lb), "ppl": ppl(la), "kld": kld, "top1": top1}


def batched(base: Path, art: Path, device: str) -> tuple[dict[str, float], Any]:
    report = evaluate([art], str(base), EvalOptions(dataset="heldout", ctx=CTX, max_tokens=TOKENS, engine="transformers",
                                                     device=device, batch=BATCH, write=False))
    m = report.results[0].metrics
    return {"tokens": m.tokens, "ppl_base": report.baseline.metrics.ppl, "ppl": m.ppl, "kld": m.kld,
            "top1": m.top1}, report


def test_batched_on_device_scores_equal_the_per_window_reference_on_cpu(smollm2: Path, rtn: Path) -> None:
    import torch

    ours, report = batched(smollm2, rtn, "cpu")
    ref = reference(smollm2, rtn, "cpu", torch.float32)
    assert report.kld_method.startswith("exact") and "memory (cpu)" in report.kld_method, report.kld_method
    assert report.results[0].engine["batch"] == BATCH
    assert ours["tokens"] == ref["tokens"] == TOKENS
    assert ours["kld"] > 0.1 and ours["top1"] < 0.9, ours  # a 4-bit artifact: the comparison has something to find
    for key in ("ppl_base", "ppl"):
        assert abs(ours[key] / ref[key] - 1) < 1e-5, (key, ours[key], ref[key])
    for key in ("kld", "top1"):
        assert round(ours[key], 4) == pytest.approx(round(ref[key], 4), abs=1.01e-4), (key, ours[key], ref[key])


@requires_gpu
def test_batched_on_device_scores_equal_the_per_window_reference_on_cuda(smollm2: Path, rtn: Path) -> None:
    ours, report = batched(smollm2, rtn, "cuda")
    ref = reference(smollm2, rtn, "cuda", "auto")
    assert "GPU memory" in report.kld_method, report.kld_method
    assert ours["tokens"] == ref["tokens"] == TOKENS
    # bfloat16: the batched and the single-window products may round a logit differently, by one bfloat16 ulp.
    for key in ("ppl_base", "ppl"):
        assert abs(ours[key] / ref[key] - 1) < 1e-3, (key, ours[key], ref[key])
    assert abs(ours["kld"] - ref["kld"]) < 1e-3 and abs(ours["top1"] - ref["top1"]) < 3e-3, (ours, ref)
