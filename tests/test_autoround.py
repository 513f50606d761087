"""AutoRound through llm-compressor (``quantkit autoround``) and GPTQ's importance-weighted observer, end to end.

AutoRound runs through the CLI on models/quantkit-tiny with real calibration (8 samples of 128 tokens, 10 tuning
steps per layer, so CI stays short); the test reads what is on disk (the quantization config, the packed tensors,
scales whose signs show AutoRound's full-range rounding, lm_head and the embeddings untouched), loads the artifact
back in transformers, and requires it to be closer to the base model than round-to-nearest on held-out text.
GPTQ ``--imatrix`` must reach llm-compressor's importance-weighted observer with importance data (its fallback to
uniform MSE says so in a warning line).

Torch runs single-threaded in process, as in test_compressed.py (a shared 2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
pytest.importorskip("auto_round")
from safetensors import safe_open  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from quantkit import calibration, recipe  # noqa: E402
from quantkit.cli.main import app  # noqa: E402
from quantkit.formats.specs import AutoRoundSpec, GptqSpec  # noqa: E402
from quantkit.producers import modifiers  # noqa: E402

from conftest import TINY, kld, log_probs, quantkit  # noqa: E402

CONFIG = json.loads((TINY / "config.json").read_text())
ARGS = {"autoround": ["autoround", "--samples", "8", "--seq-len", "128", "--iterations", "10", "--batch-size", "4"],
        "autoround-4-samples": ["autoround", "--samples", "4", "--seq-len", "64", "--iterations", "2"]}

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def build(tmp_path_factory, tiny_rtn):
    """Build an artifact through the CLI (in process) once per module; "rtn" is the session's (tests/conftest.py:
    ``quantkit rtn`` with the verb's defaults, read only)."""
    root = tmp_path_factory.mktemp("autoround")
    done: dict[str, Path] = {"rtn": tiny_rtn}

    def _build(name: str) -> Path:
        if name not in done:
            verb, *flags = ARGS[name]
            res = CliRunner().invoke(app, [verb, str(TINY), str(root / name), *flags, "--json"])
            assert res.exit_code == 0, f"quantkit {verb} failed:\n{res.output}\n{res.stderr}"
            done[name] = root / name
        return done[name]

    return _build


def _tensors(path: Path) -> dict[str, Any]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_autoround_artifact(build):
    out = build("autoround")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "int", "group", 128, True)
    assert qc["ignore"] == ["lm_head"]
    t, src = _tensors(out), _tensors(TINY)
    h, i = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for n in range(CONFIG["num_hidden_layers"]):
        for name, (rows, cols) in (("self_attn.q_proj", (h, h)), ("mlp.down_proj", (h, i)), ("mlp.up_proj", (i, h))):
            prefix = f"model.layers.{n}.{name}"
            assert t[f"{prefix}.weight_packed"].dtype == torch.int32
            assert tuple(t[f"{prefix}.weight_packed"].shape) == (rows, cols // 8)
            scale = t[f"{prefix}.weight_scale"]
            assert tuple(scale.shape) == (rows, cols // 128) and torch.isfinite(scale).all()
            # full-range symmetric rounding: a group's largest-magnitude weight sets the scale's sign
            assert (scale < 0).any() and (scale > 0).any() and not (scale == 0).any(), prefix
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(t[name], src[name]), name
    manifest = json.loads((out / "quantkit.json").read_text())
    q = manifest["quantization"]
    assert (q["algorithm"], q["scheme"], q["bits"], q["group_size"], q["iterations"], q["batch_size"]) == \
        ("autoround", "W4A16", 4, 128, 10, 4)
    assert q["lr"] == pytest.approx(0.1) and q["auto_round"]
    assert q["coverage"] == {"expected": 7 * CONFIG["num_hidden_layers"], "quantized": 7 * CONFIG["num_hidden_layers"]}
    assert list(q["recipe"][0]) == ["AutoRoundModifier"] and q["recipe"][0]["AutoRoundModifier"]["iters"] == 10
    assert manifest["calibration"]["samples"] == 8
    assert any("torch.compile" in n for n in manifest["notes"])


def test_autoround_beats_rtn(build):
    """Loaded back by transformers, AutoRound (10 steps a layer) is closer to the base model than RTN on text
    neither saw."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(TINY)(calibration.eval_text("heldout")[0], add_special_tokens=False)["input_ids"]
    windows = torch.tensor([ids[k * 256:(k + 1) * 256] for k in range(4)])
    base = log_probs(TINY, windows)
    ar, rtn = (kld(base, log_probs(build(name), windows)) for name in ("autoround", "rtn"))
    assert 0 < ar < rtn, {"autoround": ar, "rtn": rtn}


def test_autoround_recipe_and_refusals(tmp_path):
    path = recipe.find("autoround")
    r = recipe.load(path, check_output_escape=False)
    assert r.output == "out/autoround" and r.quantize == AutoRoundSpec(method="autoround")
    assert r.calibration.samples * r.calibration.seq_len <= 8192
    p = modifiers.plan(AutoRoundSpec(method="autoround", group_size=64, iterations=50))
    (name, kwargs), = p.modifiers
    assert name == "AutoRoundModifier" and kwargs["iters"] == 50 and p.signed_scales and p.calibrate
    assert kwargs["config_groups"]["group_0"]["weights"]["group_size"] == 64
    out = tmp_path / "nope"
    for flags, words in ((["--iterations", "0"], "iterations"), (["--bits", "3"], "bits"),
                         (["--group-size", "96"], "group"),
                         (["--samples", "4", "--batch-size", "8"], "more than the 4 calibration samples")):
        for dry in ([], ["--dry-run"]):
            proc = quantkit("autoround", TINY, out, *flags, *dry)
            assert proc.returncode == 2, proc.stderr
            assert words in proc.stderr and "Traceback" not in proc.stderr and not out.exists()
    bad = tmp_path / "asym.yaml"
    bad.write_text(path.read_text().replace("symmetric: true", "symmetric: false"))
    proc = quantkit("autoround", "--recipe", bad, "--output", out)
    assert proc.returncode == 2 and "symmetric" in proc.stderr and not out.exists(), proc.stderr


def test_gptq_imatrix_observer_gets_importance(tmp_path):
    """``gptq --imatrix`` puts llm-compressor's imatrix_mse observer on the weights, and the observer sees each
    layer's activations during GPTQ's own calibration pass: without them it falls back to uniform MSE and warns."""
    p = modifiers.plan(GptqSpec(method="gptq", imatrix=True))
    assert p.modifiers[0][1]["config_groups"]["group_0"]["weights"]["observer"] == "imatrix_mse"
    assert modifiers.plan(GptqSpec(method="gptq")).modifiers[0][1]["config_groups"]["group_0"]["weights"][
        "observer"] == "imatrix_mse"  # the default
    assert "observer" not in modifiers.plan(GptqSpec(method="gptq", imatrix=False)).modifiers[0][1][
        "config_groups"]["group_0"]["weights"]
    out = tmp_path / "gptq-imatrix"
    proc = quantkit("gptq", TINY, out, "--samples", "4", "--seq-len", "64", "--imatrix",
                    env={"LLM_COMPRESSOR_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "GPTQ" in log, "llm-compressor's WARNING-level log was not shown: the check below would prove nothing"
    assert "Falling back to uniform MSE" not in log, log[-3000:]
    q = json.loads((out / "quantkit.json").read_text())["quantization"]
    assert q["observer"] == "imatrix_mse"
    assert q["recipe"][0]["GPTQModifier"]["config_groups"]["group_0"]["weights"]["observer"] == "imatrix_mse"


def test_gptq_after_awq_smooths_then_quantizes(tmp_path):
    """``gptq --awq`` runs llm-compressor's AWQ smoothing, then GPTQ: the manifest's recipe has both modifiers in
    that order, AWQ's mappings are recorded, and AWQ's scales really moved into the norms (the post-attention norm
    differs from the source's, as it never does after GPTQ alone)."""
    assert [name for name, _ in modifiers.plan(GptqSpec(method="gptq", awq=True)).modifiers] == [
        "AWQModifier", "GPTQModifier"]
    assert [name for name, _ in modifiers.plan(GptqSpec(method="gptq")).modifiers] == ["GPTQModifier"]
    out = tmp_path / "awq-gptq"
    proc = quantkit("gptq", TINY, out, "--awq", "--samples", "4", "--seq-len", "64", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = json.loads((out / "quantkit.json").read_text())["quantization"]
    assert q["algorithm"] == "awq+gptq" and [next(iter(m)) for m in q["recipe"]] == ["AWQModifier", "GPTQModifier"]
    assert q["awq_mappings"], q
    norm = "model.layers.0.post_attention_layernorm.weight"
    with safe_open(str(TINY / "model.safetensors"), "pt") as src, safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not torch.equal(src.get_tensor(norm), f.get_tensor(norm))


@pytest.mark.unit
def test_batch_larger_than_the_samples_is_refused_or_lowered_to_what_runs() -> None:
    """AutoRound runs at most all the samples in a step (auto-round 0.15 clamps its batch to them, silently): a
    --batch-size given above --samples is refused, the default 8 above them is lowered to what runs, so the manifest
    records the batch that ran."""
    from quantkit.errors import UsageError

    with pytest.raises(UsageError, match="--batch-size 8 is more than the 4 calibration samples"):
        modifiers.autoround_batch(AutoRoundSpec(method="autoround", batch_size=8), 4)
    assert modifiers.autoround_batch(AutoRoundSpec(method="autoround"), 4).batch_size == 4
    assert modifiers.autoround_batch(AutoRoundSpec(method="autoround", batch_size=4), 4).batch_size == 4
    gptq = GptqSpec(method="gptq")
    assert modifiers.autoround_batch(gptq, 1) is gptq


def test_the_manifest_records_the_batch_autoround_ran(build):
    """The default batch (8) with 4 samples: AutoRound runs batches of 4, and the manifest says 4, with why."""
    m = json.loads((build("autoround-4-samples") / "quantkit.json").read_text())
    assert m["quantization"]["batch_size"] == 4, m["quantization"]
    assert any("AutoRound's batch: 4" in n for n in m["notes"]), m["notes"]
