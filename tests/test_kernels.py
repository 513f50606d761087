"""quantkit.engines.vllm.kernels and kernel_sweep, the parts that need no GPU: which kernels vLLM 0.26.0 could run each
scheme with on Hopper, how each is forced, what a real vLLM log says was used, the choice and the serve command.

Artifact configs come from compressed-tensors' own presets (the library that writes them) and from the legacy and
ModelOpt layouts quantkit writes; the logs are the H200 runs kept in bench/results/h200/.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from quantkit.engines.vllm import kernel_sweep, kernels
from quantkit.engines.vllm.kernels import Configuration, LogFacts, Measurement

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "bench" / "results" / "h200"

# preset, compressed-tensors format, as quantkit's producers write them
CT = {"awq": ("W4A16_ASYM", "pack-quantized"), "gptq": ("W4A16", "pack-quantized"), "rtn": ("W4A16", "pack-quantized"),
      "gptq-w8": ("W8A16", "pack-quantized"), "fp8-static": ("FP8", "float-quantized"),
      "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"), "fp8-block": ("FP8_BLOCK", "float-quantized"),
      "int8": ("W8A8", "int-quantized"), "nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"),
      "nvfp4-w4a4": ("NVFP4", "nvfp4-pack-quantized"), "mxfp4": ("MXFP4A16", "mxfp4-pack-quantized"),
      "mxfp4-w4a4": ("MXFP4", "mxfp4-pack-quantized")}
FP4 = ("nvfp4", "nvfp4-w4a4", "mxfp4", "mxfp4-w4a4")


def ct_artifact(tmp: Path, kind: str, moe: bool = False, **weights: object) -> Path:
    """A checkpoint folder whose config.json holds compressed-tensors' own serialization of a preset scheme."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset, fmt = CT[kind]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    for k, v in weights.items():
        setattr(scheme.weights, k, v)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, quant_method="compressed-tensors", format=fmt)
    cfg = {"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
           "quantization_config": qc.model_dump(mode="json", exclude_none=True)}
    if moe:
        cfg["num_local_experts"] = 8
    folder = tmp / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def legacy_artifact(tmp: Path, kind: str) -> Path:
    """quantkit's legacy layouts (producers/legacy.py): AutoAWQ GEMM and GPTQ v1 configs, written in float16."""
    qc = {"awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": ["lm_head"]},
          "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                   "static_groups": False, "true_sequential": True}}[kind]
    folder = tmp / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"dtype": "float16", "quantization_config": qc}))
    return folder


def names(cands: list[kernels.Candidate]) -> list[str]:
    return [c.kernel.name for c in cands]


# ------------------------------------------------------------------------------------------------------------------
# What the artifact is and which kernels could run it


def test_compressed_tensors_schemes(tmp_path: Path) -> None:
    got = {k: kernels.read_quantization(ct_artifact(tmp_path, k)).schemes[0] for k in CT}
    assert {k: s.family for k, s in got.items()} == {
        "awq": "wna16", "gptq": "wna16", "rtn": "wna16", "gptq-w8": "wna16", "fp8-static": "fp8",
        "fp8-dynamic": "fp8", "fp8-block": "fp8-block", "int8": "int8", "nvfp4": "nvfp4", "nvfp4-w4a4": "nvfp4",
        "mxfp4": "mxfp4", "mxfp4-w4a4": "mxfp4"}
    # the layer as vLLM's log names it: "Using MarlinNvFp4LinearKernel for NVFP4 GEMM"
    assert {got[k].layer for k in FP4} == {"NVFP4", "MXFP4"} and got["mxfp4"].group_size == 32
    assert got["nvfp4"].activation_scales is None and got["nvfp4-w4a4"].activation_scales == "group"
    assert not got["awq"].symmetric and got["gptq"].symmetric and got["gptq"].group_size == 128
    assert (got["fp8-static"].weight_scales, got["fp8-static"].activation_scales) == ("tensor", "tensor")
    assert (got["fp8-dynamic"].weight_scales, got["fp8-dynamic"].activation_scales) == ("channel", "token")
    assert got["int8"].layer == "CompressedTensorsW8A8Int8"


def test_wna16_candidates_on_hopper(tmp_path: Path) -> None:
    sym = kernels.read_quantization(ct_artifact(tmp_path, "gptq")).schemes[0]
    asym = kernels.read_quantization(ct_artifact(tmp_path, "awq")).schemes[0]
    w8 = kernels.read_quantization(ct_artifact(tmp_path, "gptq-w8")).schemes[0]
    assert names(kernels.candidates(sym)) == ["MacheteLinearKernel", "MarlinLinearKernel", "ExllamaLinearKernel",
                                              "TritonW4A16LinearKernel"]
    assert names(kernels.candidates(asym)) == ["MacheteLinearKernel", "MarlinLinearKernel", "TritonW4A16LinearKernel"]
    assert names(kernels.candidates(w8)) == ["MacheteLinearKernel", "MarlinLinearKernel", "ExllamaLinearKernel"]
    why = {c.kernel.name: c.reason for c in kernels.assess(sym)}
    assert "Ampere" in why["AllSparkLinearKernel"] and "FP8 activations" in why["CutlassW4A8LinearKernel"]
    assert "conch" in why["ConchLinearKernel"] and "humming" in why["HummingLinearKernel"]
    # an optional package vLLM finds makes its kernel a candidate, in vLLM's order
    assert names(kernels.candidates(sym, packages={"conch"}))[2] == "ConchLinearKernel"


def test_group_size_and_act_order_narrow_the_list(tmp_path: Path) -> None:
    g32 = kernels.read_quantization(ct_artifact(tmp_path, "gptq", group_size=32)).schemes[0]
    assert names(kernels.candidates(g32))[0] == "MarlinLinearKernel"  # Machete takes groups of 64/128 only
    assert kernels.default_kernel(g32) == "MarlinLinearKernel"
    ordered = kernels.read_quantization(ct_artifact(tmp_path, "rtn", actorder="group")).schemes[0]
    assert ordered.act_order and "TritonW4A16LinearKernel" not in names(kernels.candidates(ordered))


def test_scaled_mm_candidates(tmp_path: Path) -> None:
    q = {k: kernels.read_quantization(ct_artifact(tmp_path, k)).schemes[0]
         for k in ("fp8-static", "fp8-dynamic", "fp8-block", "int8")}
    assert names(kernels.candidates(q["fp8-static"])) == [
        "MarlinFP8ScaledMMLinearKernel", "CutlassFP8ScaledMMLinearKernel", "PerTensorTorchFP8ScaledMMLinearKernel"]
    assert names(kernels.candidates(q["fp8-dynamic"]))[-1] == "ChannelWiseTorchFP8ScaledMMLinearKernel"
    assert names(kernels.candidates(q["fp8-block"])) == [
        "DeepGemmFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel", "MarlinFP8ScaledMMLinearKernel",
        "TritonFp8BlockScaledMMKernel"]
    assert names(kernels.candidates(q["int8"])) == ["CutlassInt8ScaledMMLinearKernel", "TritonInt8ScaledMMLinearKernel"]
    # FP8 Marlin is first in vLLM's list but off on Hopper unless its test switch is set: not the default
    assert kernels.default_kernel(q["fp8-static"]) == "CutlassFP8ScaledMMLinearKernel"


def test_moe_backends(tmp_path: Path) -> None:
    w4 = kernels.read_quantization(ct_artifact(tmp_path, "gptq", moe=True))
    fp8 = kernels.read_quantization(ct_artifact(tmp_path, "fp8-static", moe=True))
    block = kernels.read_quantization(ct_artifact(tmp_path, "fp8-block", moe=True))
    assert w4.moe and names(kernels.candidates(w4.schemes[0], moe=True)) == ["MARLIN"]
    assert names(kernels.candidates(fp8.schemes[0], moe=True)) == ["VLLM_CUTLASS", "TRITON", "MARLIN"]
    assert names(kernels.candidates(block.schemes[0], moe=True)) == ["DEEPGEMM", "TRITON", "MARLIN"]
    moe_configs = [c for c in kernels.configurations(fp8) if c.kind == "moe"]
    assert [(c.name, c.args) for c in moe_configs] == [("moe:TRITON", {"moe_backend": "triton"}),
                                                       ("moe:MARLIN", {"moe_backend": "marlin"})]


def test_fp4_runs_on_marlin_on_hopper(tmp_path: Path) -> None:
    """Hopper has no FP4 tensor cores: every FP4 artifact's default is Marlin FP4 (weight-only numerics), as vLLM
    0.26.0 picked on the H200 (issue 40); the W4A4 numerics are reachable only through vLLM's NVFP4 emulation
    kernel, forced past Marlin; weight-only NVFP4 is always Marlin (init_nvfp4_linear_kernel forces it)."""
    q = {k: kernels.read_quantization(ct_artifact(tmp_path, k)) for k in FP4}
    assert {k: kernels.default_kernel(v.schemes[0]) for k, v in q.items()} == {
        "nvfp4": "MarlinNvFp4LinearKernel", "nvfp4-w4a4": "MarlinNvFp4LinearKernel",
        "mxfp4": "MarlinMxFp4LinearKernel", "mxfp4-w4a4": "MarlinMxFp4LinearKernel"}
    why = {c.kernel.name: c.reason for c in kernels.assess(q["nvfp4-w4a4"].schemes[0], packages={"flashinfer"})}
    assert "Blackwell" in why["CutlassNvFp4LinearKernel"] and "Blackwell" in why["FlashInferCutlassNvFp4LinearKernel"]
    assert names(kernels.candidates(q["nvfp4-w4a4"].schemes[0])) == ["MarlinNvFp4LinearKernel",
                                                                     "EmulationNvFp4LinearKernel"]
    assert names(kernels.candidates(q["nvfp4"].schemes[0], packages={"flashinfer", "fbgemm_gpu"})) == [
        "MarlinNvFp4LinearKernel"]
    emulated = [(c.name, c.env, c.args) for c in kernels.configurations(q["nvfp4-w4a4"])[1:]]
    assert emulated == [("EmulationNvFp4LinearKernel", {"VLLM_DISABLED_KERNELS": "MarlinNvFp4LinearKernel"}, {})]
    by_backend = kernels.configurations(q["nvfp4-w4a4"], force="backend")[1]
    assert by_backend.args == {"linear_backend": kernels.EMULATION_BACKEND}
    assert [c.name for c in kernels.configurations(q["mxfp4-w4a4"])] == ["default"]  # no MXFP4 emulation on CUDA
    default = kernels.configurations(q["mxfp4"])[0]
    log = "(EngineCore pid=7) INFO 12-04 10:00:01 [__init__.py:839] Using MarlinMxFp4LinearKernel for MXFP4 GEMM\n"
    assert kernels.log_facts(log).kernels() == ["MarlinMxFp4LinearKernel for MXFP4"]
    assert kernels.honoured(default, kernels.log_facts(log)) is True


def test_fp4_experts(tmp_path: Path) -> None:
    """NVFP4 experts go through their oracle (MARLIN on Hopper, the emulation backend for W4A4 by --moe-backend);
    MXFP4's method picks MarlinExperts itself and logs it in its own words."""
    nv = kernels.read_quantization(ct_artifact(tmp_path, "nvfp4-w4a4", moe=True))
    mx = kernels.read_quantization(ct_artifact(tmp_path, "mxfp4", moe=True))
    assert names(kernels.candidates(nv.schemes[0], moe=True)) == ["MARLIN", "EMULATION"]
    assert [(c.name, c.args) for c in kernels.configurations(nv) if c.kind == "moe"] == [
        ("moe:EMULATION", {"moe_backend": "emulation"})]
    assert kernels.default_kernel(mx.schemes[0], moe=True) == "MarlinExperts"
    assert [c.kind for c in kernels.configurations(mx)] == ["default"]
    log = ("INFO [nvfp4.py:239] Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['FLASHINFER_TRTLLM', "
           "'MARLIN'].\nINFO [compressed_tensors_moe_w4a4_mxfp4.py:60] Using MarlinExperts for MXFP4 MoE\n")
    assert kernels.log_facts(log).moe == ("MARLIN", "MarlinExperts")


def test_legacy_and_modelopt(tmp_path: Path) -> None:
    awq = kernels.read_quantization(legacy_artifact(tmp_path, "awq"))
    gptq = kernels.read_quantization(legacy_artifact(tmp_path, "gptq"))
    assert (awq.method, awq.schemes[0].layer, awq.schemes[0].symmetric) == ("auto_awq", "AutoAWQMarlinLinearMethod",
                                                                           False)
    assert (gptq.method, gptq.dtype) == ("auto_gptq", "float16")
    exllama = next(c for c in kernels.assess(gptq.schemes[0], gptq.dtype) if c.kernel.name == "ExllamaLinearKernel")
    assert exllama.usable and exllama.args == ()  # float16 already: no --dtype needed
    mo = tmp_path / "modelopt"
    mo.mkdir()
    (mo / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (mo / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8",
                                                                          "kv_cache_quant_algo": "FP8"}}))
    q = kernels.read_quantization(mo)
    assert (q.method, q.schemes[0].layer) == ("modelopt", "ModelOptFp8LinearMethod")
    # ModelOpt's FP8 MoE method does not allow vLLM's CUTLASS experts; compressed-tensors' does
    assert names(kernels.candidates(q.schemes[0], moe=True)) == ["TRITON", "MARLIN"]
    (mo / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    other = kernels.read_quantization(mo)
    assert other.schemes[0].family == "other" and kernels.configurations(other) == [
        Configuration("default", "default", ())]


def test_unquantized_has_only_the_default(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    q = kernels.read_quantization(tmp_path)
    assert q.method == "none" and [c.name for c in kernels.configurations(q)] == ["default"]


def test_unreadable_config_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no readable config.json"):
        kernels.read_quantization(tmp_path)


# ------------------------------------------------------------------------------------------------------------------
# Forcing a kernel


def test_marlin_is_forced_by_disabling_machete(tmp_path: Path) -> None:
    """The H200 measurement behind issue 16: Marlin instead of vLLM's Machete through VLLM_DISABLED_KERNELS."""
    q = kernels.read_quantization(ct_artifact(tmp_path, "gptq"))
    configs = {c.name: c for c in kernels.configurations(q)}
    assert configs["default"].expect == (("CompressedTensorsWNA16", "MacheteLinearKernel"),)
    marlin = configs["MarlinLinearKernel"]
    assert marlin.env == {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"} and marlin.args == {}
    triton = configs["TritonW4A16LinearKernel"]
    assert triton.env == {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel,MarlinLinearKernel"}
    exllama = configs["ExllamaLinearKernel"]
    assert exllama.args == {"dtype": "float16"}  # Exllama runs with float16 activations only


def test_force_through_the_linear_backend(tmp_path: Path) -> None:
    q = kernels.read_quantization(ct_artifact(tmp_path, "fp8-block"))
    configs = {c.name: c for c in kernels.configurations(q, force="backend")}
    assert configs["CutlassFp8BlockScaledMMKernel"].args == {"linear_backend": "cutlass"}
    assert configs["CutlassFp8BlockScaledMMKernel"].env == {}
    marlin = configs["MarlinFP8ScaledMMLinearKernel"]
    assert marlin.args == {"linear_backend": "marlin"} and marlin.env == {"VLLM_TEST_FORCE_FP8_MARLIN": "1"}
    with pytest.raises(ValueError, match="force must be"):
        kernels.configurations(q, force="nope")


def test_combine_merges_disabled_kernels() -> None:
    lin = Configuration("MarlinLinearKernel", "linear", (("L", "MarlinLinearKernel"),),
                        {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"})
    moe = Configuration("moe:TRITON", "moe", (("moe", "TRITON"),), {}, {"moe_backend": "triton"})
    both = kernels.combine(lin, moe)
    assert both.kind == "combined" and both.expect == lin.expect + moe.expect
    assert both.env == {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"} and both.args == {"moe_backend": "triton"}


# ------------------------------------------------------------------------------------------------------------------
# What real vLLM logs say


def test_facts_from_a_real_vllm_serve_log() -> None:
    facts = kernels.log_facts((H200 / "modelopt_fp8_vllm_serve.log").read_text())
    assert facts.quantization == "modelopt"
    assert facts.linear == (("ModelOptFp8LinearMethod", "CutlassFP8ScaledMMLinearKernel"),)
    assert facts.kernels() == ["CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod"]
    assert facts.moe == () and facts.error is None  # "kernel_config=KernelConfig(...)" is not a kernel


@pytest.mark.parametrize("row", json.loads((H200 / "vllm_matrix.json").read_text()), ids=lambda r: r["artifact"])
def test_predicted_default_matches_what_vllm_picked_on_the_h200(row: dict, tmp_path: Path) -> None:
    """For every artifact of the H200 matrix, the default this table predicts is the kernel vLLM 0.26.0 logged."""
    kind = {"awq-w4g128": "awq", "gptq-w4g128": "gptq", "rtn-w4g128": "rtn", "gptq-w8g128": "gptq-w8",
            "fp8-static": "fp8-static", "fp8-dynamic": "fp8-dynamic", "fp8-block": "fp8-block", "int8-sq": "int8",
            "autoawq": "awq", "gptq": "gptq"}[row["artifact"]]
    folder = legacy_artifact(tmp_path, kind) if row["format"] in ("awq", "gptq") else ct_artifact(tmp_path, kind)
    q = kernels.read_quantization(folder)
    log = "\n".join(f"INFO 11-29 12:00:38 [__init__.py:635] {line}" for line in row["kernels"])
    facts = kernels.log_facts(log + f"\nengine config: quantization={row['quantization']}, enforce_eager=True")
    default = kernels.configurations(q)[0]
    assert kernels.honoured(default, facts) is True
    assert facts.quantization == q.method


def test_silently_replaced_kernel_is_not_honoured() -> None:
    asked = Configuration("TritonW4A16LinearKernel", "linear", (("CompressedTensorsWNA16", "TritonW4A16LinearKernel"),))
    log = "(EngineCore pid=877) INFO 11-29 12:00:38 [compressed_tensors_wNa16.py:137] Using MarlinLinearKernel " \
          "for CompressedTensorsWNA16\n"
    assert kernels.honoured(asked, kernels.log_facts(log)) is False
    # two kernels for one layer type (another shape fell through) is not the forced configuration either
    two = log + log.replace("MarlinLinearKernel", "TritonW4A16LinearKernel")
    assert kernels.honoured(asked, kernels.log_facts(two)) is False
    assert kernels.honoured(Configuration("default", "default", ()), kernels.log_facts(log)) is None


def test_moe_backend_lines() -> None:
    log = ("INFO [fp8.py:325] Using TRITON Fp8 MoE backend out of potential backends: ['AITER', 'TRITON'].\n"
           "INFO [int_wna16.py:184] Using 'MARLIN' WNA16 MoE backend.\n")
    assert kernels.log_facts(log).moe == ("TRITON", "MARLIN")
    assert kernels.honoured(Configuration("moe:TRITON", "moe", (("moe", "TRITON"),)),
                            kernels.log_facts(log.splitlines()[0])) is True


def test_root_cause_error_wins_over_the_wrapper() -> None:
    log = ("(EngineCore pid=9) ValueError: Failed to find a kernel that can implement the WNA16 linear layer. "
           "Reasons: \n MacheteLinearKernel disabled by environment variable\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert kernels.log_facts(log).error.startswith("ValueError: Failed to find a kernel")


# ------------------------------------------------------------------------------------------------------------------
# Choosing, rendering


def measured(config: Configuration, b1: float, b16: float = 0.0, used: str | None = None) -> Measurement:
    kernel = used or (config.expect[0][1] if config.expect else "")
    facts = LogFacts("compressed-tensors", (("CompressedTensorsWNA16", kernel),) if kernel else ())
    return Measurement(config, "ok", facts, 0.05, {"1": b1, "16": b16})


def gptq_configs(tmp_path: Path) -> dict[str, Configuration]:
    return {c.name: c for c in kernels.configurations(kernels.read_quantization(ct_artifact(tmp_path, "gptq")))}


def test_choose_the_h200_example(tmp_path: Path) -> None:
    c = gptq_configs(tmp_path)
    runs = [measured(c["default"], 263, 3764), measured(c["MarlinLinearKernel"], 303, 4133),  # issue 16's figures
            measured(c["TritonW4A16LinearKernel"], 400, used="MarlinLinearKernel"),  # vLLM ignored the ask
            Measurement(c["ExllamaLinearKernel"], "failed", error="ValueError: ...")]
    choice = kernels.choose(runs)
    assert choice.configuration.name == "MarlinLinearKernel" and choice.measured
    assert "+15.2%" in choice.reason
    cmd = kernels.serve_command("org/llama-8b-gptq", choice.configuration)
    assert cmd.shell() == "VLLM_DISABLED_KERNELS=MacheteLinearKernel vllm serve org/llama-8b-gptq"
    assert "+9.8%" in kernels.choose(runs, batch=16).reason
    table = kernels.markdown(runs, choice)
    assert "**MarlinLinearKernel** (chosen)" in table and "asked for TritonW4A16LinearKernel" in table
    assert "failed: ValueError" in table


def test_a_kernel_that_loses_at_another_batch_is_passed_over(tmp_path: Path) -> None:
    """The 8B shape's sweep on an H200 (bench/results/h200/tune_gptq_8b.json): Exllama was fastest at batch 1 and
    half as fast at batch 16; Marlin gave up 3.5% at batch 64 for 12% at batches 1 and 16."""
    c = gptq_configs(tmp_path)

    def run(name: str, b1: float, b16: float, b64: float) -> Measurement:
        m = measured(c[name], b1, b16)
        m.decode_tok_s["64"] = b64
        return m

    runs = [run("default", 262.9, 3809.9, 9714.3), run("MarlinLinearKernel", 295.9, 4285.3, 9374.1),
            run("ExllamaLinearKernel", 322.4, 1805.3, 4873.6), run("TritonW4A16LinearKernel", 37.2, 591.0, 2257.8)]
    choice = kernels.choose(runs)
    assert choice.configuration.name == "MarlinLinearKernel"
    assert "passed over ExllamaLinearKernel (322 tok/s at batch 1, but -52.6% against the default at batch 16)" \
        in choice.reason
    assert "Triton" not in choice.reason  # slower at batch 1: nothing was given up for it
    assert kernels.choose(runs, max_loss=0.6).configuration.name == "ExllamaLinearKernel"
    assert kernels.choose(runs, max_loss=0.02).configuration.name == "default"  # Marlin's -3.5% at batch 64


def test_default_stays_within_the_margin(tmp_path: Path) -> None:
    c = gptq_configs(tmp_path)
    choice = kernels.choose([measured(c["default"], 300), measured(c["MarlinLinearKernel"], 305)])
    assert choice.configuration.kind == "default" and "3%" in choice.reason
    assert kernels.serve_command("m", choice.configuration).shell() == "vllm serve m"
    assert kernels.choose([Measurement(c["default"], "failed")]) is None


def test_unmeasured_combination_is_flagged() -> None:
    default = Configuration("default", "default", ())
    lin = Configuration("MarlinLinearKernel", "linear", (("L", "MarlinLinearKernel"),),
                        {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"})
    moe = Configuration("moe:TRITON", "moe", (("moe", "TRITON"),), {}, {"moe_backend": "triton"})
    runs = [Measurement(default, "ok", LogFacts(), 0.1, {"1": 100.0}),
            Measurement(lin, "ok", LogFacts(None, (("L", "MarlinLinearKernel"),)), 0.1, {"1": 120.0}),
            Measurement(moe, "ok", LogFacts(None, (), ("TRITON",)), 0.1, {"1": 110.0})]
    choice = kernels.choose(runs)
    assert not choice.measured and choice.configuration.kind == "combined"
    assert kernels.serve_command("m", choice.configuration).shell() == \
        "VLLM_DISABLED_KERNELS=MacheteLinearKernel vllm serve m --moe-backend triton"


def test_serve_command_flags() -> None:
    config = Configuration("x", "linear", (), {"A": "1 2"}, {"linear_backend": "marlin", "enforce_eager": True,
                                                            "compilation_config": {"mode": 0}, "skip": False})
    cmd = kernels.serve_command("/m", config, ["--quantization", "modelopt"])
    assert cmd.argv == ["vllm", "serve", "/m", "--linear-backend", "marlin", "--enforce-eager",
                        "--compilation-config", '{"mode": 0}', "--quantization", "modelopt"]
    assert cmd.shell().startswith("A='1 2' vllm serve /m")


def test_json_round_trip(tmp_path: Path) -> None:
    m = measured(gptq_configs(tmp_path)["MarlinLinearKernel"], 303, 3700)
    again = Measurement.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m and again.honoured is True


# ------------------------------------------------------------------------------------------------------------------
# The process side, with real processes


def test_run_logged_kills_the_whole_group_on_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); print('started', flush=True); "
            "time.sleep(60)")
    t = time.monotonic()
    rc, seconds = kernel_sweep.run_logged([sys.executable, "-c", code, str(pidfile)], {}, tmp_path / "x.log", 3)
    assert rc is None and time.monotonic() - t < 30 and "started" in (tmp_path / "x.log").read_text()
    grandchild = int(pidfile.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def test_child_without_vllm_is_a_failed_measurement(tmp_path: Path) -> None:
    """The real child script, run where vLLM is not installed: a failed run with vLLM's absence as the error."""
    folder = ct_artifact(tmp_path, "gptq")
    config = kernels.configurations(kernels.read_quantization(folder))[1]
    runtime = kernel_sweep.Runtime(sys.executable, {"PYTHONPATH": ""})
    m = kernel_sweep.run_configuration(folder, config, kernel_sweep.Bench(), runtime, tmp_path / "logs" / "m.log", 60)
    assert m.status == "failed" and "vllm" in m.error and m.honoured is None
    request = json.loads((tmp_path / "logs" / "m.request.json").read_text())
    assert request["engine_args"]["max_model_len"] == 2048 and request["batches"] == [1, 16]
    assert kernel_sweep.probe_packages(runtime) == frozenset()


def test_sweep_deadline_leaves_the_rest_not_run(tmp_path: Path) -> None:
    folder = ct_artifact(tmp_path, "gptq")
    updates: list[int] = []
    result = kernel_sweep.sweep(folder, kernel_sweep.Bench(), kernel_sweep.Runtime(sys.executable, {"PYTHONPATH": ""}),
                                tmp_path / "logs", deadline=time.monotonic(), on_update=lambda r: updates.append(
                                    len(r.measurements)))
    assert [m.status for m in result.measurements] == ["not run"] * 4 and updates == [1, 2, 3, 4]
    assert result.choice is None and json.loads(json.dumps(result.to_json()))["candidates"][0]["layer"] == \
        "CompressedTensorsWNA16"


def test_result_line() -> None:
    assert kernel_sweep.result_line("noise\nRESULT {\"a\": 1}\nRESULT {\"a\": 2}\ntail") == {"a": 2}
    assert kernel_sweep.result_line("RESULT {broken") is None and kernel_sweep.result_line("") is None


def test_modelopt_w4a16_nvfp4_names_marlin_from_the_warning() -> None:
    """vLLM 0.26's ModelOpt W4A16_NVFP4 method calls Marlin FP4 itself: no "Using ... Kernel" line, only the warning
    (the H200 run's load log). The fact is recorded as such instead of an empty kernel list; a log that names an FP4
    kernel class gets nothing added."""
    log = (ROOT / "tests" / "data" / "vllm_modelopt_w4a16_nvfp4_load.log").read_text()
    facts = kernels.log_facts(log)
    assert facts.quantization == "modelopt_fp4"
    assert facts.linear == (kernels.MARLIN_FP4_DIRECT,)
    named = kernels.log_facts(log + "\nINFO [nvfp4.py:1] Using MarlinNvFp4LinearKernel for NVFP4 GEMM\n")
    assert named.linear == (("NVFP4", "MarlinNvFp4LinearKernel"),)
