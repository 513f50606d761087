"""GGUF on real pretrained weights: SmolLM2-135M-Instruct (``make real-models``), through llama.cpp's own converter.

quantkit's converter refused this checkpoint (its pre-tokenizer, llama.cpp's ``smollm``, was not one of the five it
matched); llama.cpp's converter knows it by its hash. With default flags ``quantkit gguf`` makes Q4_K_M; with
``--imatrix`` F16 and Q4_K_M with an importance matrix computed from 16 x 512 calibration tokens. Checked: the
F16 file's logits equal transformers' (float32) to float noise; both Q4_K_M files are scored by ``quantkit eval``
with the llama.cpp engine against the checkpoint in transformers, with bounds from measured values (2,048
held-out tokens, ctx 1024; measured KLD, top-1 in the bounds' comments) and margin; llama.cpp reads every file
back. Hidden size 576 is not a multiple of 256, so K-quant rows fall back (to Q5_0/Q8_0), as llama.cpp does.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from test_gguf import heldout, hf_logits, kl, llama_logits, top1  # noqa: F401

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")



@pytest.fixture(scope="module")
def made(smollm2: Path, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory,
         cli: Callable) -> dict[str, Any]:
    """The default-flags GGUF (the session's, copied: eval records its results in it) and one with a matrix, their
    Q4_K_M files scored by llama.cpp against SmolLM2 (the F16 file is compared with transformers logit by logit
    below, which says more than its score)."""
    root = tmp_path_factory.mktemp("real-gguf")
    plain, imx = root / "plain", root / "imatrix"
    shutil.copytree(smollm2_gguf, plain)
    cli("gguf", smollm2, imx, "-t", "F16", "-t", "Q4_K_M", "--imatrix", "--calib", "mixed", "--samples", "16",
        "--seq-len", "512", "--json", check=True)
    manifests = {k: json.loads((p / "quantkit.json").read_text()) for k, p in (("plain", plain), ("imatrix", imx))}
    files = {(k, t): (plain if k == "plain" else imx) / f for k, m in manifests.items()
             for t, f in m["quantization"]["files"].items()}
    proc = cli("eval", plain, files["imatrix", "Q4_K_M"], "--engine", "llama.cpp", "--baseline", smollm2, "--dataset",
               "heldout", "--max-tokens", "2048", "--ctx", "1024", "--report-dir", root / "report", "--json",
               timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_path = {r["path"]: r for r in json.loads(proc.stdout)["results"]}
    results = {key: next(r for p, r in by_path.items() if Path(p).resolve() == f.resolve()) for key, f in files.items()
               if key[1] == "Q4_K_M"}
    return {"plain": plain, "imatrix": imx, "eval": results, "files": files, "manifests": manifests}


def test_default_flags_make_q4_k_m(made: dict[str, Any], smollm2: Path) -> None:
    q = made["manifests"]["plain"]["quantization"]
    assert q["types"] == ["Q4_K_M"] and sorted(p.name for p in made["plain"].iterdir()) == [
        q["files"]["Q4_K_M"], "quantkit.json"]
    # llama.cpp's converter knows SmolLM2's tokenizer by its hash: quantkit did not have to name it
    assert q["pre_tokenizer"] == "smollm" and q["pre_tokenizer_from"] == "upstream"
    assert q["architecture"] == "llama" and q["source_architecture"] == "LlamaForCausalLM"
    assert q["intermediate"] == "BF16"
    fell = q["fallbacks"]["Q4_K_M"]  # 576-wide rows cannot hold 256-value K-quant blocks
    assert fell["blk.0.attn_q.weight"] == "Q5_0" and set(fell.values()) <= {"Q5_0", "Q5_1", "Q8_0"}
    # the floor a bits target is checked against before any work counts those fallbacks (5.25), and is one
    from quantkit.producers.gguf import convert, target_bits

    floor = target_bits.floor_bits("Q4_K_M", convert.plan(smollm2).tensors)
    assert 5 < floor <= target_bits.file_bits(made["plain"] / q["files"]["Q4_K_M"])


def test_f16_logits_equal_transformers(smollm2: Path, made: dict[str, Any], heldout: list[str]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    ids = tok(heldout[3])["input_ids"][:512]
    ref = hf_logits(smollm2, ids)
    f16 = llama_logits(made["files"]["imatrix", "F16"], ids)
    assert top1(ref, f16) >= 0.99, top1(ref, f16)
    assert kl(ref, f16) < 1e-3, kl(ref, f16)


def test_q4_k_m_scored_by_llamacpp(made: dict[str, Any]) -> None:
    assert set(made["eval"]) == {("plain", "Q4_K_M"), ("imatrix", "Q4_K_M")}, made["eval"]
    plain, imx = made["eval"]["plain", "Q4_K_M"], made["eval"]["imatrix", "Q4_K_M"]
    for r in (plain, imx):
        assert r["engine"]["engine"] == "llama.cpp" and r["tokens"] == 2048 and r["passed"], r
    # measured: Q4_K_M KLD 0.0589, top-1 0.878 (6.27 bits/weight); with the importance matrix 0.0333 / 0.907 (over
    # 4,096 tokens, scored until 2026-12-05: 0.0561 / 0.887 and 0.0310 / 0.919)
    assert plain["kld"] < 0.08 and plain["top1"] > 0.85, plain
    assert imx["kld"] < 0.045 and imx["top1"] > 0.88, imx
    assert imx["kld"] < 0.8 * plain["kld"]  # the matrix really helps
    assert 5.5 < plain["bits_per_weight"] < 7


def test_imatrix_artifact_named_from_the_converted_file(made: dict[str, Any]) -> None:
    q = made["manifests"]["imatrix"]["quantization"]
    im = q["imatrix"]
    assert im["file"].startswith("imatrix/") and im["types"] == ["Q4_K_M"]
    names = {t.name for t in gguf.GGUFReader(made["files"]["imatrix", "F16"]).tensors}
    entries = {t.name.removesuffix(".in_sum2") for t in gguf.GGUFReader(made["imatrix"] / im["file"]).tensors
               if t.name.endswith(".in_sum2")}
    # q, k, v, o, gate, up, down of all 30 blocks, each the name of a tensor llama.cpp's converter wrote
    assert len(entries) == 30 * 7 and entries <= names
    assert im["entries"] == len(entries) and not any("no entry" in n for n in made["manifests"]["imatrix"]["notes"])


def test_llamacpp_reads_every_file_back(made: dict[str, Any]) -> None:
    for folder in (made["plain"], made["imatrix"]):
        for f in folder.glob("*.gguf"):
            logits = llama_logits(f, [1, 504, 3458, 282])
            assert logits.shape[0] == 4 and np.isfinite(logits).all(), f


def test_llama_server_answers_the_question(made: dict[str, Any], cli: Callable) -> None:
    """`quantkit smoke` asks the real llama-server a question with one right answer: the F16 file names Paris, and
    an answer without the expected text is a failed gate (exit 3), not a pass. (The Q4_K_M file made without an
    importance matrix answered "La femme de France, le Grand Croix, ..." here while its completion still began
    " Paris": a loss that KLD alone does not show, and the reason smoke can ask.)"""
    f16 = made["files"]["imatrix", "F16"].name
    ask = ("smoke", made["imatrix"], "--file", f16, "--chat-prompt", "What is the capital of France?")
    ok = cli(*ask, "--expect", "Paris", "--json", timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    run = json.loads(ok.stdout)["runs"][0]
    assert run["expect"] == {"text": "Paris", "in": "chat answer", "found": True}
    assert "paris" in run["chat"]["text"].lower() and run["completion"]["prompt"] == "The capital of France is"
    wrong = cli(*ask, "--expect", "Berlin", timeout=600)
    assert wrong.returncode == 3, wrong.stderr[-2000:]
    assert "does not contain 'Berlin'" in wrong.stderr and "Traceback" not in wrong.stderr
