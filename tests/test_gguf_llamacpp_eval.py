"""quantkit's perplexity and KLD against llama.cpp's own ``llama-perplexity --kl-divergence``, on the same tokens.

``llama-perplexity`` tokenizes a text, cuts it into chunks of ``n_ctx`` tokens whose first token it replaces by
BOS (where the GGUF adds one), and scores the second half of each chunk; with ``--kl-divergence-base`` it stores the
tokens and the baseline's log-probabilities in a file. quantkit reads the tokens back from that file
(:func:`quantkit.evaluation.llama_perplexity.windows`) and scores exactly those positions with its own engines and
its own comparison (:func:`quantkit.evaluation.metrics.score_windows`, the code ``quantkit eval`` runs), twice:

* as ``quantkit eval`` does, the checkpoint in transformers as baseline, the GGUF files in llama-cpp-python. The
  baselines then differ in engine (the F32 GGUF in llama.cpp for llama-perplexity; they agree to float noise:
  tests/test_gguf.py): perplexity within 1%, KLD within 10%;
* the F32 GGUF as baseline in llama.cpp on both sides, so only the two programs differ: perplexity, KLD and top-1
  agreement equal to 4 decimals.

Checked for Q8_0, Q4_K_M and IQ4_XS (made with an importance matrix).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, TINY
from gguf_spec import make
from quantkit.engines.logits import EngineOptions, Window, open_engine
from quantkit.evaluation import llama_perplexity
from quantkit.evaluation.metrics import BaselineStore, Metrics, score_windows

pytestmark = pytest.mark.e2e

CTX = 512
CHUNKS = 8
TYPES = ["Q8_0", "Q4_K_M", "IQ4_XS"]


def lp_run(args: list[str], want: tuple[str, ...]) -> dict[str, float]:
    """llama-perplexity's summary figures (its log's lost summary handled by :func:`llama_perplexity.run`)."""
    return llama_perplexity.run([*args, "-c", str(CTX), "-b", str(CTX), "-t", "2"], want,
                                purpose="the llama.cpp cross-check").figures


def quantkit_scores(baseline: tuple[str, Path], paths: dict[str, Path], windows: list[Window],
                    tmp: Path) -> dict[str, Metrics]:
    """The baseline (``(engine, path)``) and each GGUF (llama.cpp) over ``windows``, as ``quantkit eval`` scores
    them (:func:`score_windows`)."""
    store = BaselineStore(tmp, sum(w.n_scored for w in windows))
    out = {}
    for label, kind, path in [("baseline", *baseline), *[(t, "llama.cpp", p) for t, p in paths.items()]]:
        engine = open_engine(kind, path, EngineOptions(ctx=CTX, device="cpu"))
        try:
            out[label] = score_windows(engine, windows, store, baseline=label == "baseline")
        finally:
            engine.close()
    return out


@pytest.fixture(scope="module")
def cross_check(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("xcheck")
    res = make(tmp / "art", ["F32", *TYPES], imatrix_=True)
    files = {t: res.path / f for t, f in res.manifest.quantization["files"].items()}
    with gzip.open(ROOT / "calibration" / "heldout.jsonl.gz", "rt", encoding="utf-8") as f:
        text = "\n\n".join(json.loads(line)["text"] for line in f if line.strip())
    (tmp / "text.txt").write_text(text, encoding="utf-8")
    base = tmp / "base.kld"
    lp_run(["-m", str(files["F32"]), "-f", str(tmp / "text.txt"), "--chunks", str(CHUNKS),
            "--kl-divergence-base", str(base)], want=())
    theirs = {t: lp_run(["-m", str(files[t]), "--kl-divergence-base", str(base), "--kl-divergence"],
                        want=("ppl", "ppl_base", "kld", "top1")) for t in TYPES}
    windows = llama_perplexity.windows(base, files["F32"])
    assert len(windows) == CHUNKS and all(len(w.tokens) == CTX for w in windows)
    assert all(w.tokens[0] == llama_perplexity.bos_to_add(files["F32"]) for w in windows)  # the tiny file adds BOS
    ours = quantkit_scores(("transformers", TINY), {t: files[t] for t in TYPES}, windows, tmp / "hf")
    both = quantkit_scores(("llama.cpp", files["F32"]), {t: files[t] for t in TYPES}, windows, tmp / "gguf")
    return {"theirs": theirs, "ours": ours, "both_llamacpp": both, "scored": sum(w.n_scored for w in windows)}


def test_the_same_tokens_are_scored(cross_check: dict[str, Any]) -> None:
    ours = cross_check["ours"]
    assert cross_check["scored"] == CHUNKS * (CTX - 1 - CTX // 2) == ours["baseline"].tokens
    assert all(ours[t].tokens == ours["baseline"].tokens for t in TYPES)


@pytest.mark.parametrize("type_name", TYPES)
def test_perplexity_and_kld_agree_with_llama_perplexity(cross_check: dict[str, Any], type_name: str) -> None:
    theirs, ours = cross_check["theirs"][type_name], cross_check["ours"]
    mine = ours[type_name]
    assert abs(mine.ppl / theirs["ppl"] - 1) < 0.01, (mine.ppl, theirs["ppl"])
    assert abs(ours["baseline"].ppl / theirs["ppl_base"] - 1) < 0.01, (ours["baseline"].ppl, theirs["ppl_base"])
    assert mine.kld is not None and abs(mine.kld / theirs["kld"] - 1) < 0.10, (mine.kld, theirs["kld"])


@pytest.mark.parametrize("type_name", TYPES)
def test_with_llamacpp_on_both_sides_the_figures_are_llama_perplexitys(cross_check: dict[str, Any],
                                                                       type_name: str) -> None:
    """The F32 file as baseline in quantkit's llama.cpp engine too: only the two programs differ, and perplexity,
    KLD and top-1 agreement equal llama-perplexity's to 4 decimals (its base file stores the baseline's
    log-probabilities in 16 bits, quantkit's store in float16)."""
    theirs, both = cross_check["theirs"][type_name], cross_check["both_llamacpp"]
    mine = both[type_name]
    assert abs(both["baseline"].ppl / theirs["ppl_base"] - 1) < 1e-4, (both["baseline"].ppl, theirs["ppl_base"])
    assert abs(mine.ppl / theirs["ppl"] - 1) < 1e-4, (mine.ppl, theirs["ppl"])
    assert mine.kld is not None and abs(mine.kld - theirs["kld"]) < 1e-4, (mine.kld, theirs["kld"])
    assert mine.top1 is not None and abs(mine.top1 - theirs["top1"] / 100) < 1e-4, (mine.top1, theirs["top1"])
