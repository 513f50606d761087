"""FP4 artifacts in the engines (issue 40 item 2): which arithmetic a W4A4 artifact is scored and served with, said in
one line and recorded in the manifest. Artifacts come from quantkit's own nvfp4/mxfp4 verbs on the reference model,
scored on this CPU by transformers, whose compressed-tensors forward emulates FP4 activations (``--numerics
emulated``, the default there) or, asked, leaves them in 32 bits (``--numerics weight-only``, what Hopper's Marlin FP4
runs). vLLM cannot run here: its side is the numerics vLLM 0.26's own log lines and a GPU's compute capability give,
and the GPU cases of scripts/gpu_cases.yaml (every FP4 artifact of the real model loaded with Marlin FP4 named)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from conftest import ROOT, TINY, quantkit
from quantkit.checkpoint import MXFP4, NVFP4, Fp4, fp4, read_config
from quantkit.engines import doctor, numerics, smoke
from quantkit.engines.vllm import kernels
from quantkit.errors import UsageError
from quantkit.formats.names import VLLM
from quantkit.progress import Reporter
from quantkit.evaluation.evaluate import EvalOptions, evaluate
from quantkit.manifest import read_manifest

pytestmark = pytest.mark.e2e

PROTOCOL = dict(dataset="heldout", max_tokens=1024, ctx=512, engine="transformers", device="cpu")


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """NVFP4 W4A4 and its W4A16 twin (round-to-nearest: the same weights), and MXFP4 W4A4, of the reference model."""
    root = tmp_path_factory.mktemp("fp4")
    made = {"nvfp4-w4a4": ("nvfp4", "--scheme", "w4a4", "--samples", "16", "--seq-len", "128"),
            "nvfp4-w4a16": ("nvfp4",), "mxfp4-w4a4": ("mxfp4", "--scheme", "w4a4")}
    for name, (verb, *args) in made.items():
        quantkit(verb, TINY, root / name, "--algorithm", "rtn", *args, "--quiet", check=True)
    return {name: root / name for name in made}


def test_the_checkpoint_says_fp4_and_w4a4(arts: dict[str, Path]) -> None:
    assert fp4(read_config(arts["nvfp4-w4a4"])) == Fp4(NVFP4, True)
    assert fp4(read_config(arts["nvfp4-w4a16"])) == Fp4(NVFP4, False)
    assert fp4(read_config(arts["mxfp4-w4a4"])) == Fp4(MXFP4, True)
    assert fp4(read_config(TINY)) is None and numerics.w4a4(arts["nvfp4-w4a16"]) is None


def test_emulated_w4a4_is_scored_apart_from_weight_only(arts: dict[str, Path]) -> None:
    """transformers scores a W4A4 artifact with FP4 activations emulated, or weight-only on request; weight-only is
    exactly the W4A16 twin's score (same weights), the emulated one is worse, and each result and manifest records
    which numerics it measured."""
    w4a4 = [arts["nvfp4-w4a4"], arts["mxfp4-w4a4"]]
    emulated = evaluate(w4a4, str(TINY), EvalOptions(**PROTOCOL, numerics="emulated"))
    assert [r.numerics for r in emulated.results] == [numerics.EMULATED] * 2
    assert read_manifest(arts["mxfp4-w4a4"]).evaluation.numerics == numerics.EMULATED
    auto = evaluate([*w4a4, arts["nvfp4-w4a16"]], str(TINY), EvalOptions(**PROTOCOL, numerics="auto"))
    nv, mx, twin = auto.results
    assert twin.numerics is None and nv.numerics == mx.numerics == numerics.EMULATED  # auto in transformers: emulated
    weight_only = evaluate(w4a4, str(TINY), EvalOptions(**PROTOCOL, numerics="weight-only"))
    nv, mx = weight_only.results
    assert nv.numerics == mx.numerics == numerics.WEIGHT_ONLY
    assert nv.to_json()["numerics"] == numerics.WEIGHT_ONLY
    assert read_manifest(arts["nvfp4-w4a4"]).evaluation.numerics == numerics.WEIGHT_ONLY
    assert nv.metrics.kld == pytest.approx(twin.metrics.kld, rel=1e-6)  # activations untouched: the twin's numerics
    for e, w in zip(emulated.results, weight_only.results):
        assert e.metrics.kld > w.metrics.kld * 1.2, (e.target.label, e.metrics.kld, w.metrics.kld)


def test_the_cli_records_and_refuses_numerics(arts: dict[str, Path], tmp_path: Path) -> None:
    p = quantkit("eval", arts["nvfp4-w4a4"], "--dataset", "heldout", "--max-tokens", "1024", "--ctx", "512",
                 "--engine", "transformers", "--device", "cpu", "--numerics", "emulated", "--report-dir", tmp_path,
                 "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)["results"][0]
    assert result["numerics"] == "emulated w4a4" and result["engine"]["numerics"] == "emulated w4a4"
    assert "NVFP4 W4A4 artifact with its activations quantized to FP4 and back" in p.stderr
    assert "transformers (emulated w4a4)" in (tmp_path / "report.md").read_text()
    before = read_manifest(arts["nvfp4-w4a16"]).evaluation
    p = quantkit("eval", arts["nvfp4-w4a16"], "--numerics", "emulated", "--report-dir", tmp_path / "refused")
    assert p.returncode == 2 and p.stderr.startswith("error: --numerics emulated: ") and \
        "is not an FP4 W4A4 checkpoint" in p.stderr.splitlines()[0], p.stderr
    assert not (tmp_path / "refused").exists()
    assert read_manifest(arts["nvfp4-w4a16"]).evaluation == before  # nothing scored, nothing written
    for name, options, message in [("nvfp4-w4a4", {"numerics": "bf16"}, "choose one of auto, emulated, weight-only"),
                                   ("mxfp4-w4a4", {"numerics": "emulated", "engine": "vllm"},
                                    "no MXFP4 emulation kernel")]:
        with pytest.raises(UsageError, match=message):
            evaluate([arts[name]], None, EvalOptions(**{**PROTOCOL, **options}))


def test_doctor_says_which_numerics_the_gpu_gives(arts: dict[str, Path]) -> None:
    """Here (no GPU): what this machine scores instead. On a GPU, from the probe's compute capability: weight-only
    below Blackwell (a warning: the artifact does not get the numerics it asks for), FP4 arithmetic from 10.0 (MXFP4
    only with FlashInfer, which vLLM's MXFP4 W4A4 kernel needs)."""
    report = doctor.check(arts["nvfp4-w4a4"], VLLM, include_quantkit=False)
    line = next(c for c in report.checks if c.name == doctor.NUMERICS_CHECK)
    assert line.status == "ok" and "no GPU here" in line.message and "emulated w4a4" in line.message
    h200 = {"torch": {"cuda_available": True, "devices": ["NVIDIA H200"], "capabilities": [[9, 0]]}, "modules": {}}
    nv, mx = Fp4(NVFP4, True), Fp4(MXFP4, True)
    hopper = doctor._numerics_check(nv, h200, TINY)
    assert hopper.status == "warn" and "vLLM on NVIDIA H200 (compute capability 9.0) runs this NVFP4 W4A4 artifact " \
                                      "weight-only (Marlin FP4: this GPU has no FP4 arithmetic)" in hopper.message
    b200 = {"torch": {**h200["torch"], "devices": ["NVIDIA B200"], "capabilities": [[10, 0]]}, "modules": {}}
    blackwell = doctor._numerics_check(nv, b200, TINY)
    assert blackwell.status == "ok" and "(w4a4)" in blackwell.message
    assert doctor._numerics_check(mx, b200, TINY).status == "warn"
    assert doctor._numerics_check(mx, {**b200, "modules": {"flashinfer": True}}, TINY).status == "ok"


@pytest.mark.parametrize("line, asked, expected", [
    ("Using MarlinNvFp4LinearKernel for NVFP4 GEMM", "auto", numerics.MARLIN_WEIGHT_ONLY),
    ("Using MarlinMxFp4LinearKernel for MXFP4 GEMM", "weight-only", numerics.WEIGHT_ONLY),
    ("Using EmulationNvFp4LinearKernel for NVFP4 GEMM", "emulated", numerics.EMULATED),
    ("Using FlashInferCutlassNvFp4LinearKernel for NVFP4 GEMM", "auto", numerics.W4A4),
    ("Using MacheteLinearKernel for CompressedTensorsWNA16", "auto", None),
])
def test_vllm_numerics_from_its_log(line: str, asked: str, expected: str | None) -> None:
    """What vLLM ran a W4A4 artifact with is read from the kernel line its init_nvfp4/mxfp4_linear_kernel logs (the
    format of vLLM 0.26.0's source), as eval and smoke read their worker's and server's logs."""
    log = f"(EngineCore pid=9) INFO 12-04 10:00:00 [__init__.py:933] {line}\n"
    used = [k for _, k in kernels.log_facts(log).linear]
    assert numerics.of_vllm_kernels(used, asked) == expected
    assert numerics.vllm_args(asked, moe=True) == ({} if asked == "auto" else {
        "linear_backend": {"emulated": "emulation", "weight-only": "marlin"}[asked],
        "moe_backend": {"emulated": "emulation", "weight-only": "marlin"}[asked]})


def test_smoke_records_what_the_server_ran(tmp_path: Path) -> None:
    """smoke reads the kernel line of the vLLM server's log into the run's numerics; a log that names none (a server
    that died first) records nothing and falls back to saying doctor's prediction."""
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=5) INFO 12-04 10:00:00 [__init__.py:933] Using MarlinNvFp4LinearKernel for NVFP4 "
                   "GEMM\n(APIServer pid=5) WARNING 12-04 10:00:01 [marlin.py:34] Your GPU does not have native "
                   "support for FP4 computation but FP4 quantization is being used.\n")
    said = Console(record=True, width=400)
    run = smoke.SmokeRun(tmp_path, VLLM, log)
    smoke._say_numerics(run, Fp4(NVFP4, True), Reporter(said, quiet=True), [])
    assert run.data["numerics"] == numerics.MARLIN_WEIGHT_ONLY and run.to_json()["numerics"] == run.data["numerics"]
    assert "vLLM runs this NVFP4 W4A4 artifact weight-only (Marlin FP4" in said.export_text()
    log.write_text("ValueError: no kernel\n")
    died = smoke.SmokeRun(tmp_path, VLLM, log)
    predicted = doctor.Check(doctor.NUMERICS_CHECK, "warn", "vLLM on NVIDIA H200 runs it weight-only")
    smoke._say_numerics(died, Fp4(NVFP4, True), Reporter(said, quiet=True), [predicted])
    assert "numerics" not in died.data and said.export_text().splitlines()[-1].endswith("runs it weight-only")


def test_fp4_experts_are_scored_through_a_dense_copy(tmp_path: Path) -> None:
    """transformers 5.17 leaves FP4 expert tensors unloaded ("UNEXPECTED"), which would score without an error: an
    FP4 mixture of experts is scored through compressed-tensors' dense copy, weight-only, and says so; emulating its
    activations there is refused in one line."""
    moe = ROOT / "models" / "quantkit-tiny-moe"
    art = tmp_path / "moe-nvfp4-w4a4"
    quantkit("nvfp4", moe, art, "--scheme", "w4a4", "--algorithm", "rtn", "--samples", "16", "--seq-len", "128",
             "--quiet", check=True)
    (r,) = evaluate([art], None, EvalOptions(**PROTOCOL)).results
    assert r.numerics == numerics.DENSE_COPY and "dense copy" in r.engine["loaded"]
    assert 0 < r.metrics.kld < 0.5 and r.metrics.top1 > 0.6  # uninitialised experts score nothing like this
    with pytest.raises(UsageError, match="only through a dense copy"):
        evaluate([art], None, EvalOptions(**{**PROTOCOL, "numerics": "emulated"}))
    cpu = doctor._numerics_check(Fp4(NVFP4, True), {"torch": {"cuda_available": False}}, art)
    assert "runs this NVFP4 W4A4 artifact weight-only: transformers 5.17 cannot reload FP4 experts" in cpu.message
