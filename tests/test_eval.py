"""``quantkit eval`` end to end on models/quantkit-tiny: transformers and llama.cpp agree, KLD and top-1 catch a
broken artifact whose perplexity looks fine, gates exit 3, and the report, plot and manifest are written.

Every model run is real (transformers on CPU, llama.cpp on GGUF files written by ``quantkit gguf``); token counts
are kept small with ``--max-tokens`` so the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, quantkit, requires_gpu, token_gguf
from quantkit.engines.logits import LogProbs, log_softmax
from quantkit.evaluation.metrics import BaselineWindow, kld_rows
from quantkit.evaluation.protocol import make_windows

pytestmark = pytest.mark.e2e

# Zeroing the scales of these weights leaves perplexity within the default ratio gate (about 1.38x on the
# held-out tokens scored below) while the distributions move far from the baseline's: KLD about 0.7 nats.
BROKEN = ["model.layers.0.self_attn.o_proj.weight", "model.layers.7.self_attn.o_proj.weight",
          "model.layers.3.mlp.down_proj.weight", "model.layers.4.mlp.down_proj.weight"]


def _json(proc) -> dict:
    assert proc.stdout.strip(), f"no JSON on stdout (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def gguf_artifact(tiny_gguf_f32_f16, tmp_path_factory) -> Path:
    """F32 and F16 GGUF files of the reference model, one artifact folder, made by ``quantkit gguf``: the session's
    (tests/conftest.py), copied, as eval writes its report and results into the artifact."""
    out = tmp_path_factory.mktemp("eval") / "tiny-gguf"
    shutil.copytree(tiny_gguf_f32_f16, out)
    return out


@pytest.fixture(scope="session")
def gguf_eval(gguf_artifact) -> dict:
    """Both GGUF files scored by llama.cpp against the baseline scored by transformers (baseline from the
    manifest, report written into the artifact folder)."""
    proc = quantkit("eval", gguf_artifact, "--dataset", "heldout", "--max-tokens", "4096", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _json(proc)


@pytest.fixture(scope="session")
def broken_model(tmp_path_factory) -> Path:
    """An RTN int8 artifact with the weight scales of four projections zeroed, as a producer bug would ship
    it: sealed by quantkit's own writer, so only its numbers can tell."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from quantkit import artifact
    from quantkit.manifest import MANIFEST, read_manifest

    made = tmp_path_factory.mktemp("eval") / "rtn-w8"
    quantkit("rtn", TINY, made, "--bits", "8", check=True)
    with safe_open(made / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    tensors = load_file(made / "model.safetensors")
    for name in BROKEN:
        tensors[f"{name}_scale"] = torch.zeros_like(tensors[f"{name}_scale"])
    out = made.parent / "rtn-w8-zeroed-scales"
    with artifact.ArtifactWriter(out) as w:
        shutil.copytree(made, w.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST))
        save_file(tensors, w.path / "model.safetensors", metadata=metadata)
        w.commit(read_manifest(made))
    return out


def test_llamacpp_agrees_with_transformers_on_f32_and_f16(gguf_eval):
    base = gguf_eval["baseline"]
    assert base["engine"]["engine"] == "transformers"
    by_file = {Path(r["path"]).name: r for r in gguf_eval["results"]}
    assert set(by_file) == {"quantkit-tiny-F32.gguf", "quantkit-tiny-F16.gguf"}
    for r in by_file.values():
        assert r["engine"]["engine"] == "llama.cpp"
        assert r["tokens"] == base["tokens"] == 4096
        assert abs(r["ppl"] / base["ppl"] - 1) < 0.005, (r["label"], r["ppl"], base["ppl"])
        assert r["kld"] < 0.01 and r["top1"] > 0.95, r
        assert r["passed"]
    assert by_file["quantkit-tiny-F32.gguf"]["bits_per_weight"] > 31
    assert 15 < by_file["quantkit-tiny-F16.gguf"]["bits_per_weight"] < 17


def test_report_plot_and_manifest_are_written(gguf_eval, gguf_artifact):
    report = gguf_artifact / "report.md"
    assert gguf_eval["report"] == str(report)
    text = report.read_text()
    for needle in ("| model | engine | format | size | bits/weight | ppl | ratio | KLD | top-1 | gates |",
                   "quantkit-tiny-F32.gguf", "quantkit-tiny-F16.gguf", "## Protocol", "## Gates",
                   gguf_eval["protocol"]["source_sha256"], "4,096", "size-vs-ppl.png"):
        assert needle in text, needle
    assert (gguf_artifact / "size-vs-ppl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((gguf_artifact / "quantkit.json").read_text())
    ev = manifest["evaluation"]
    assert ev["protocol"]["windows_sha256"] == gguf_eval["protocol"]["windows_sha256"]
    assert [Path(r["path"]).name for r in ev["results"]] == ["quantkit-tiny-F16.gguf", "quantkit-tiny-F32.gguf"]
    assert ev["passed"] is True and ev["report"] == "report.md"
    assert "report.md" in manifest["files"] and "size-vs-ppl.png" in manifest["files"]
    # The report is part of the artifact's seal now.
    assert quantkit("verify", gguf_artifact).returncode == 0


def test_base_against_itself_has_zero_kld_and_full_agreement(tmp_path):
    # Default dataset "auto" with HF_HUB_OFFLINE=1 (set by the runner) must fall back to the held-out split.
    proc = quantkit("eval", TINY, "--baseline", TINY, "--max-tokens", "2048", "--report-dir", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = _json(proc)
    assert data["protocol"]["source"] == "heldout" and data["protocol"]["dataset"] == "auto"
    assert any("HF_HUB_OFFLINE" in n for n in data["protocol"]["notes"])
    (r,) = data["results"]
    assert r["kld"] < 1e-6 and r["kld_max"] < 1e-4
    assert r["top1"] == 1.0
    assert r["ppl"] == pytest.approx(data["baseline"]["ppl"], rel=1e-9)
    assert data["kld_method"].startswith("exact")
    assert (tmp_path / "report.md").exists() and (tmp_path / "size-vs-ppl.png").exists()
    assert not (TINY / "report.md").exists()


def test_broken_artifact_fails_default_gates_although_its_ppl_passes(broken_model):
    proc = quantkit("eval", broken_model, "--dataset", "heldout", "--max-tokens", "4096", "--json")
    assert proc.returncode == 3, proc.stderr[-3000:]
    (r,) = _json(proc)["results"]
    gates = {g["gate"]: g for g in r["gates"]}
    assert gates["max_ppl_ratio"]["passed"] and r["ppl_ratio"] < 1.5, r  # perplexity alone would ship it
    assert not gates["max_kld"]["passed"] and r["kld"] > 0.5, r
    assert f"max_kld: kld {r['kld']:.4g} (limit <= 0.5) FAILED" in proc.stderr
    assert "FAIL: max_kld" in (broken_model / "report.md").read_text()
    evaluation = json.loads((broken_model / "quantkit.json").read_text())["evaluation"]
    assert evaluation["passed"] is False and evaluation["summary"]["gates"] == "fail"


def test_gate_flags_override_defaults_and_name_the_gate(broken_model, tmp_path):
    proc = quantkit("eval", broken_model, "--dataset", "heldout", "--ctx", "256",
                    "--max-tokens", "512", "--max-ppl-ratio", "1.01", "--max-kld", "100", "--min-top1", "0",
                    "--report-dir", tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "1 gate(s) failed" in proc.stderr
    assert "max_ppl_ratio: ppl_ratio" in proc.stderr and "(limit <= 1.01) FAILED" in proc.stderr
    assert "max_kld" not in proc.stderr.split("gate(s) failed")[1]


def test_recipe_verify_block_sets_protocol_and_gates(broken_model, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {TINY}\noutput: {tmp_path / 'unused'}\nquantize:\n  method: rtn\n"
                      "evaluation:\n  dataset: heldout\n  ctx: 256\n  max_tokens: 512\n"
                      "  gates:\n    max_ppl_ratio: 3.0\n    max_kld: 5.0\n    min_top1: 0.1\n")
    proc = quantkit("eval", broken_model, "--recipe", recipe, "--report-dir", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = _json(proc)
    assert data["protocol"]["ctx"] == 256 and data["protocol"]["tokens_scored"] == 512
    assert {g["gate"]: g["limit"] for g in data["results"][0]["gates"]} == {
        "max_ppl_ratio": 3.0, "max_kld": 5.0, "min_top1": 0.1}
    bad = quantkit("eval", broken_model, "--recipe", recipe, "--stride", "999", "--report-dir", tmp_path)
    assert bad.returncode == 2 and "--stride 999" in bad.stderr


def test_stride_and_max_tokens_change_the_tokens_scored():
    from quantkit import api
    from quantkit.evaluation.evaluate import EvalOptions

    runs = {}
    for stride in (None, 32):
        opts = EvalOptions(dataset="heldout", ctx=128, stride=stride, max_tokens=768, write=False)
        runs[stride] = api.evaluate([TINY], str(TINY), opts)
    flat, strided = runs[None], runs[32]
    assert flat.protocol.tokens_scored == strided.protocol.tokens_scored == 768
    assert flat.results[0].metrics.tokens == strided.results[0].metrics.tokens == 768
    assert len(flat.protocol.windows) == 7  # ceil(768 / 127): BOS + 127 tokens each
    assert len(strided.protocol.windows) == 1 + -(-(768 - 127) // 32)
    assert strided.protocol.tokens_evaluated > 3 * flat.protocol.tokens_evaluated
    # Every strided token after the first window is predicted from at least 95 tokens of context, so the
    # same tokens score better than with windows that restart every 127 tokens.
    assert strided.baseline.metrics.ppl < flat.baseline.metrics.ppl
    assert flat.protocol.windows_sha256 != strided.protocol.windows_sha256


def test_a_text_of_fewer_tokens_than_the_least_max_tokens_is_refused_before_scoring(tmp_path):
    """A two-word file was scored (2 tokens), gated and its verdict recorded; a text that gives fewer tokens than
    ``--max-tokens`` may keep is now a usage error, said before any model is scored and with nothing written."""
    from quantkit.evaluation.protocol import MIN_TOKENS

    (tmp_path / "short.txt").write_text("short text")
    proc = quantkit("eval", TINY, "--baseline", TINY, "--dataset", tmp_path / "short.txt", "--ctx", "128",
                    "--report-dir", tmp_path / "r")
    assert proc.returncode == 2, proc.stderr
    assert f"gives 2 tokens with the baseline's tokenizer; an evaluation scores at least {MIN_TOKENS}" in proc.stderr
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr and not (tmp_path / "r").exists()
    bad = quantkit("eval", TINY, "--baseline", TINY, "--max-tokens", str(MIN_TOKENS - 1))
    assert bad.returncode == 2 and f"greater than or equal to {MIN_TOKENS}" in bad.stderr, bad.stderr


def test_a_tokenizer_without_bos_is_held_to_the_least_tokens_scored(tmp_path):
    """Without BOS each window's first token has no context and is not scored, so ``--max-tokens 16`` scored 15,
    below the least an evaluation scores: the minimum is held on the tokens scored, with BOS or without."""
    from quantkit.errors import CalibrationError
    from quantkit.evaluation import protocol

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 8)
    with_bos = protocol.build(Path(TINY), dataset=str(text), ctx=128, max_tokens=protocol.MIN_TOKENS)
    assert with_bos.tokens_scored == protocol.MIN_TOKENS
    no_bos = tmp_path / "no-bos"
    no_bos.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(Path(TINY) / name, no_bos / name)
    config = json.loads((Path(TINY) / "tokenizer_config.json").read_text())
    del config["bos_token"], config["chat_template"]
    config["add_bos_token"] = False
    (no_bos / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CalibrationError, match=f"cut to --max-tokens {protocol.MIN_TOKENS} leaves "
                                               f"{protocol.MIN_TOKENS - 1} tokens to score"):
        protocol.build(no_bos, dataset=str(text), ctx=128, max_tokens=protocol.MIN_TOKENS)
    assert protocol.build(no_bos, dataset=str(text), ctx=128,
                          max_tokens=protocol.MIN_TOKENS + 1).tokens_scored == protocol.MIN_TOKENS


def test_max_tokens_beyond_the_text_is_said(tmp_path):
    """``--max-tokens 4096`` on a text of fewer tokens scored what there was, and only the count showed it: the
    protocol says so in a note, which the console and the report print."""
    from quantkit.evaluation import protocol

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 8)
    proto = protocol.build(Path(TINY), dataset=str(text), ctx=128, max_tokens=4096)
    assert proto.tokens_scored < 4096
    assert f"--max-tokens 4,096 asks for more than the text gives: its {proto.tokens_scored:,} tokens are all " \
           "scored" in proto.notes
    assert not protocol.build(Path(TINY), dataset=str(text), ctx=128, max_tokens=protocol.MIN_TOKENS).notes


def test_topk_baseline_store_bounds_the_exact_kld(broken_model):
    # The store a 128k-vocabulary model gets when its full distributions do not fit, forced here on 8k.
    from quantkit import api
    from quantkit.evaluation.evaluate import EvalOptions

    runs = {}
    for topk in (None, 64):
        opts = EvalOptions(dataset="heldout", ctx=256, max_tokens=512, kld_topk=topk, write=False)
        runs[topk] = api.evaluate([broken_model], None, opts)
    exact, bound = runs[None].results[0].metrics, runs[64].results[0].metrics
    assert runs[None].kld_method.startswith("exact") and runs[64].kld_method.startswith("lower bound: baseline top-64")
    assert 0.8 * exact.kld < bound.kld <= exact.kld + 1e-6
    assert (bound.ppl, bound.top1) == (exact.ppl, exact.top1)  # only KLD is approximated


@pytest.mark.unit
def test_windows_score_every_token_once():
    stream = list(range(10, 1010))
    for bos, ctx, stride in ((0, 64, None), (0, 64, 16), (0, 64, 63), (None, 64, None), (None, 64, 8)):
        windows = make_windows(stream, bos, ctx, stride)
        scored = [t for w in windows for t in w.tokens[w.score_from:]]
        assert all(len(w.tokens) <= ctx for w in windows)
        if bos is None and stride:
            assert scored == stream[1:]  # the very first token has no context and is never scored
        elif bos is None:
            assert len(scored) == len(stream) - len(windows)  # each window's first token has no context
        else:
            assert scored == stream
            assert all(w.tokens[0] == bos for w in windows)
    assert [w.score_from for w in make_windows(stream, 0, 64, 16)][:3] == [1, 64 - 16, 64 - 16]


@pytest.mark.unit
def test_binned_kld_bounds_the_exact_value_from_below():
    rng = np.random.default_rng(0)
    n, vocab = 32, 500
    logits = rng.normal(size=(n, vocab)) * 3
    lb = log_softmax(logits)
    la = log_softmax(logits + rng.normal(size=(n, vocab)))  # a perturbed copy, as a quantized model is
    exact = (np.exp(lb.astype(np.float64)) * (lb.astype(np.float64) - la)).sum(-1)
    stored = kld_rows(BaselineWindow(lb.argmax(-1), dense=lb.astype(np.float16)), LogProbs(dense=la))
    assert np.allclose(stored, exact, rtol=1e-3, atol=1e-5)  # the float16 store costs < 0.1%
    order = np.argsort(-lb, axis=-1)
    means = []
    for k in (5, 50, 400):
        ids = order[:, :k]
        top = BaselineWindow(lb.argmax(-1), ids=ids, values=np.take_along_axis(lb, ids, -1))
        binned = kld_rows(top, LogProbs(dense=la))
        assert np.all(binned <= exact + 1e-6)
        means.append(binned.mean())
    assert 0 < means[0] < means[1] < means[2] and means[2] > 0.99 * exact.mean()  # more bins, tighter bound
    # The artifact sparse too (vLLM): bins are the ids both sides know.
    a_ids = np.argsort(-la, axis=-1)[:, :400]
    sparse = LogProbs(ids=a_ids, values=np.take_along_axis(la, a_ids, -1), target=la[:, 0])
    both = kld_rows(top, sparse)
    assert np.all(both <= exact + 1e-6) and both.mean() > 0
    # Identical distributions: zero however they are binned.
    same = kld_rows(top, LogProbs(dense=lb))
    assert np.abs(same).max() < 1e-6


def test_refusals_before_any_model_loads(gguf_artifact, tmp_path):
    modelopt = tmp_path / "modelopt"
    shutil.copytree(TINY, modelopt)
    (modelopt / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    proc = quantkit("eval", modelopt, "--baseline", TINY, "--engine", "transformers")
    assert proc.returncode == 2 and "ModelOpt export" in proc.stderr and "--engine vllm" in proc.stderr
    # ModelOpt's INT4-AWQ is a TensorRT-LLM format: vLLM 0.26 has no method for it, so neither eval nor smoke
    # starts a vLLM that would die loading it
    (modelopt / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "W4A16_AWQ"}}')
    for argv in (("eval", modelopt, "--baseline", TINY), ("smoke", modelopt, "--engine", "vllm")):
        proc = quantkit(*argv)
        assert proc.returncode == 2 and "ModelOpt W4A16_AWQ export, which vLLM 0.26.0 does not load" in proc.stderr, \
            proc.stderr
        assert "Traceback" not in proc.stderr

    tampered = tmp_path / "tampered"
    shutil.copytree(gguf_artifact, tampered)
    with open(tampered / "quantkit-tiny-F16.gguf", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    proc = quantkit("eval", tampered, "--dataset", "heldout", "--max-tokens", "64")
    assert proc.returncode == 1 and "differ from its manifest" in proc.stderr

    proc = quantkit("eval", gguf_artifact, "--engine", "transformers")
    assert proc.returncode == 2 and "is GGUF" in proc.stderr


@pytest.mark.cli
def test_an_artifact_of_another_vocabulary_is_refused_before_any_model_loads(tmp_path):
    """llama.cpp failed with 'llama_decode failed (-1)' on an id past its vocabulary (exit 1), transformers refused
    only after scoring the baseline: every engine's artifact is now checked from its files first, exit 2."""
    vocab = json.loads((TINY / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    small = token_gguf(tmp_path / "small.gguf", tokens[:100])
    proc = quantkit("eval", small, "--baseline", TINY, "--report-dir", tmp_path / "r")
    assert proc.returncode == 2 and "vocabulary of 100 tokens" in proc.stderr and "8,192" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()

    swapped = tokens.copy()
    swapped[300], swapped[301] = swapped[301], swapped[300]
    other = token_gguf(tmp_path / "other.gguf", swapped)
    proc = quantkit("eval", other, "--baseline", TINY, "--report-dir", tmp_path / "r")
    assert proc.returncode == 2 and "another tokenizer" in proc.stderr and "token id 300" in proc.stderr, proc.stderr

    folder = tmp_path / "hf"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    proc = quantkit("eval", folder, "--baseline", TINY, "--engine", "transformers", "--report-dir", tmp_path / "r")
    assert proc.returncode == 2 and "vocabulary of 4,096 tokens" in proc.stderr, proc.stderr


def test_a_real_gguf_of_another_model_is_refused_clearly(tiny_gguf_q4_k_m, smollm2, tmp_path):
    """The QA report's case: a GGUF of the reference model (8,192 tokens, no manifest) against SmolLM2 (49,152)."""
    lone = tmp_path / "lone.gguf"
    shutil.copy(next(tiny_gguf_q4_k_m.glob("*.gguf")), lone)
    proc = quantkit("eval", lone, "--baseline", smollm2, "--report-dir", tmp_path / "r")
    assert proc.returncode == 2 and "vocabulary of 8,192 tokens" in proc.stderr and "49,152" in proc.stderr, \
        proc.stderr


@requires_gpu
def test_vllm_prompt_logprobs_match_transformers(tmp_path):
    import os

    from quantkit.engines.vllm.logits import PYTHON_ENV

    if not os.environ.get(PYTHON_ENV):
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            pytest.skip(f"vLLM is not installed here and {PYTHON_ENV} is not set")
    proc = quantkit("eval", TINY, "--baseline", TINY, "--engine", "vllm", "--dataset", "heldout",
                    "--max-tokens", "8192", "--report-dir", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = _json(proc)["results"]
    assert r["engine"]["engine"] == "vllm"
    assert abs(r["ppl_ratio"] - 1) < 0.01 and r["top1"] > 0.98 and r["kld"] < 0.01
