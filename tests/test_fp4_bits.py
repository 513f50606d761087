"""FP4 with a bits target (issue 40) and the sensitivity cache (the pace issue), end to end on SmolLM2-135M-Instruct.

``nvfp4 --target-bits 5.5`` through the real CLI and llm-compressor on the real model (widths 576 and 1536), round to
nearest on a small calibration (2 x 64 tokens: the sensitivity pass is one forward per layer group, 120 of them):
the checkpoint holds both config groups (NVFP4 and the default int8 weight-only), its bits counted from the files
sit within the tolerance of the target and equal the plan's, every module carries its group's scheme and scales (the
coverage check), transformers evaluates it (``quantkit eval --engine transformers``) with a lower KLD than plain
NVFP4's on the same tokens. On the reference model (32 layer groups, a cheaper pass) the second run of the same
command reads the sensitivity from the cache (the manifest's note says so), a changed calibration measures it again. Mixes vLLM 0.26 was not measured loading are refused in one
line before anything loads. The coverage check's mix rule fails a module with another group's scales.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
from typer.testing import CliRunner  # noqa: E402

from quantkit.cli.main import app  # noqa: E402
from quantkit.formats.specs import Nvfp4Spec  # noqa: E402
from quantkit.producers import coverage, mixed, modifiers  # noqa: E402

from conftest import SMOLLM2, TINY, quantkit  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]

CALIB = ["--samples", "2", "--seq-len", "64"]
TARGET = 5.5
MIX = ["nvfp4", "--algorithm", "rtn", "--target-bits", str(TARGET)]
CACHED = "sensitivity of the 32 layer groups was read from quantkit's cache"


@pytest.fixture(scope="module")
def made(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain NVFP4 and the NVFP4 mix at 5.5 bits of SmolLM2, and the mix of the reference model twice (the second
    reads the cache), each made in this process with quantkit's cache in a folder of its own; returns each
    artifact's folder and manifest."""
    root = tmp_path_factory.mktemp("fp4-bits")
    runs = {"plain": (smollm2, ["nvfp4", "--algorithm", "rtn", "--observer", "minmax"]),
            "mixed": (smollm2, [*MIX, *CALIB]), "tiny": (TINY, [*MIX, *CALIB]), "again": (TINY, [*MIX, *CALIB])}
    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTKIT_CACHE_DIR", str(root / "cache"))
        for name, (source, (verb, *flags)) in runs.items():
            folder = root / name
            res = CliRunner().invoke(app, [verb, str(source), str(folder), *flags, "--json"])
            assert res.exit_code == 0, f"quantkit {verb} failed:\n{res.output}\n{res.stderr}"
            out[name] = (folder, json.loads((folder / "quantkit.json").read_text()))
    out["cache"] = root / "cache"
    return out


def test_mix_holds_both_groups_at_the_target(made: dict[str, Any]) -> None:
    folder, manifest = made["mixed"]
    q = manifest["quantization"]
    groups = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
    formats = {g["format"]: g["weights"] for g in groups.values()}
    assert set(formats) == {"nvfp4-pack-quantized", "pack-quantized"}, formats
    assert (formats["pack-quantized"]["num_bits"], formats["pack-quantized"]["type"]) == (8, "int")
    assert formats["pack-quantized"]["strategy"] == "channel" and formats["pack-quantized"]["symmetric"]
    m = q["mixed"]
    assert abs(m["measured_bits"] - TARGET) <= mixed.TOLERANCE
    assert m["measured_bits"] == pytest.approx(m["planned_bits"], abs=1e-3)
    assert 0 < m["units_at_high"] < m["units"] == 120
    assert m["high"].startswith("int8 per-channel") and m["low"].startswith("nvfp4")
    assert q["scheme"] == "NVFP4A16+W8A16" and q["coverage"]["expected"] == q["coverage"]["quantized"] == 210
    assert m["sensitivity"]["cache"] == "written" and m["sensitivity"]["proxy"].startswith("round-to-nearest nvfp4")


def test_every_module_stored_as_planned(made: dict[str, Any]) -> None:
    """Each module's tensors are its group's: FP4 packed bytes with E4M3 group scales and a global scale, or int8
    packed into int32 with one scale per output channel, as the plan gave it."""
    from safetensors import safe_open

    folder, manifest = made["mixed"]
    plan = {mod: u["bits"] for u in manifest["quantization"]["mixed"]["plan"] for mod in u["modules"]}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for module, bits in plan.items():
            if bits == 4:
                assert f.get_slice(f"{module}.weight_scale").get_dtype() == "F8_E4M3", module
                assert f"{module}.weight_global_scale" in names, module
            else:
                assert f.get_slice(f"{module}.weight_packed").get_dtype() == "I32", module
                assert f.get_slice(f"{module}.weight_scale").get_shape()[1] == 1, module
                assert f"{module}.weight_global_scale" not in names, module


def test_mix_scores_below_plain_nvfp4_in_transformers(made: dict[str, Any]) -> None:
    (plain, _), (mix, _) = made["plain"], made["mixed"]
    proc = quantkit("eval", plain, mix, "--engine", "transformers", "--baseline", SMOLLM2, "--dataset", "heldout",
                    "--max-tokens", "1024", "--device", "cpu", "--max-kld", "100", "--max-ppl-ratio", "100",
                    "--min-top1", "0", "--json", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    kld = [r["kld"] for r in json.loads(proc.stdout)["results"]]  # in the order given
    assert 0 < kld[1] < kld[0], kld


def test_second_run_reads_the_sensitivity_from_the_cache(made: dict[str, Any]) -> None:
    first, second = made["tiny"][1], made["again"][1]
    assert not any(CACHED in n for n in first["notes"])
    assert any(CACHED in n for n in second["notes"]), second["notes"]
    m1, m2 = first["quantization"]["mixed"], second["quantization"]["mixed"]
    assert m2["sensitivity"]["cache"] == "read" and m2["sensitivity"]["cache_key"] == m1["sensitivity"]["cache_key"]
    assert m2["plan"] == m1["plan"]  # the same KLDs, so the same choice
    assert len(list(made["cache"].glob("sensitivity/*.json"))) == 2  # the reference model's and SmolLM2's


def test_a_changed_calibration_measures_again(made: dict[str, Any], tmp_path: Path) -> None:
    """Another calibration (another seed draws other samples) is another key: measured, not read."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTKIT_CACHE_DIR", str(made["cache"]))
        res = CliRunner().invoke(app, [MIX[0], str(TINY), str(tmp_path / "out"), *MIX[1:], *CALIB, "--seed", "1",
                                       "--json"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert not any(CACHED in n for n in manifest["notes"])
    assert manifest["quantization"]["mixed"]["sensitivity"]["cache"] == "written"
    assert manifest["calibration"]["tokens_sha256"] != made["tiny"][1]["calibration"]["tokens_sha256"]
    assert len(list(made["cache"].glob("sensitivity/*.json"))) == 3


@pytest.mark.cli
@pytest.mark.parametrize("args, words", [
    (["nvfp4", "--scheme", "w4a4", "--high", "int8"], "not measured loading nvfp4 w4a4 layers mixed with int8"),
    (["mxfp4", "--scheme", "w4a4"], "not measured loading mxfp4 w4a4 layers mixed with any 8-bit layers"),
    (["nvfp4", "--target-bits", "9"], "outside what nvfp4 and int8 layers mix to"),
])
def test_refused_before_loading(tmp_path: Path, args: list[str], words: str) -> None:
    target = [] if "--target-bits" in args else ["--target-bits", "5.5"]
    proc = quantkit(args[0], TINY, tmp_path / "out", *args[1:], *target)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Loading" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_coverage_holds_each_module_of_a_mix_to_its_own_scales() -> None:
    """The reference model quantized with an FP4 + FP8 plan passes the coverage check; a module given the other
    group's scale layout fails it, named."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype="auto")
    spec = Nvfp4Spec(method="nvfp4", algorithm="rtn", observer="minmax", target_bits=5.5, high="fp8")
    split = {4: ["re:.*mlp\\.(gate|up|down)_proj$"], 8: ["re:.*self_attn\\.(q|k|v|o)_proj$"]}
    oneshot(model=model, recipe=modifiers.plan(spec, split).build(["lm_head"]))
    config = json.loads((TINY / "config.json").read_text())
    assert coverage.check(model, ["lm_head"], config).ok
    victim = "model.layers.0.self_attn.q_proj"
    module = dict(model.named_modules())[victim]
    module.weight_scale.data = module.weight_scale.data.expand(-1, module.in_features // 16).contiguous()
    cov = coverage.check(model, ["lm_head"], config)
    assert cov.wrong_scales == [victim] and not cov.ok
    with pytest.raises(Exception, match="scales other than their scheme's"):
        cov.raise_for_failures()

