"""llm-compressor producers (awq, gptq, fp8, int8, rtn) and the legacy AutoAWQ/GPTQ layouts, end to end.

Every verb runs through the CLI on models/quantkit-tiny with real calibration (few, short samples), and the test
reads what is on disk: the quantization config, each tensor's name, dtype and shape, lm_head and the embeddings
untouched, the artifact loading back in transformers with finite logits. The legacy layouts are compared bit for
bit with AutoAWQ 0.2.9's own packing code. AWQ and GPTQ must beat round-to-nearest in KL divergence from the
base model on held-out text.

Torch runs single-threaded here: on a shared 2-core machine, OpenMP threads spin-waiting on busy cores make
llm-compressor's many small ops an order of magnitude slower, and one thread is as fast when the cores are idle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
from safetensors import safe_open  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from quantkit import calibration, recipe  # noqa: E402
from quantkit.cli.main import app  # noqa: E402
from quantkit.producers import legacy, modifiers  # noqa: E402

from conftest import TINY, kld, log_probs, quantkit, requires_gpu  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
CONFIG = json.loads((TINY / "config.json").read_text())
LAYERS = CONFIG["num_hidden_layers"]

# artifact name -> the command line after MODEL OUTPUT (real calibration, kept small for CI)
ARTIFACTS: dict[str, list[str]] = {
    "awq": ["awq", "--samples", "8", "--seq-len", "128", "--format", "autoawq"],
    "gptq": ["gptq", "--samples", "32", "--seq-len", "256", "--format", "gptq"],
    "rtn": ["rtn"],  # the session's tiny_rtn (tests/conftest.py), made so
    "fp8": ["fp8", "--kv-cache-fp8", "--samples", "4", "--seq-len", "128"],
    "fp8-dynamic": ["fp8", "--scheme", "dynamic"],
    "fp8-block": ["fp8", "--scheme", "block"],
    "int8": ["int8", "--samples", "8", "--seq-len", "128"],
    "int8-rtn": ["int8", "--weights", "rtn", "--samples", "8", "--seq-len", "128"],
    "w4a8": ["w4a8", "--weights", "rtn"],
    "rtn-mixed": ["rtn", "--target-bits", "6"],  # reads calibration only for its sensitivity pass
}


pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def build(tmp_path_factory, tiny_rtn):
    """Build an artifact through the CLI (in process) once per module; returns (folder, the --json result). "rtn" is
    the session's (tests/conftest.py: ``quantkit rtn`` with the verb's defaults, read only), its manifest standing for
    the result."""
    root = tmp_path_factory.mktemp("compressed")
    done: dict[str, tuple[Path, dict]] = {"rtn": (tiny_rtn, json.loads((tiny_rtn / "quantkit.json").read_text()))}

    def _build(name: str) -> tuple[Path, dict]:
        if name not in done:
            verb, *flags = ARTIFACTS[name]
            out = root / name
            res = CliRunner().invoke(app, [verb, str(TINY), str(out), *flags, "--json"])
            assert res.exit_code == 0, f"quantkit {verb} failed:\n{res.output}\n{res.stderr}"
            done[name] = (out, json.loads(res.stdout)[0])
        return done[name]

    return _build


@pytest.fixture(scope="module")
def source_tensors() -> dict[str, Any]:
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def heldout_windows() -> Any:
    """8 windows of 256 held-out tokens the model never saw (2048 tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    text, _ = calibration.eval_text("heldout")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[i * 256:(i + 1) * 256] for i in range(8)])


def tensors(path: Path) -> dict[str, Any]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def qconfig(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def assert_untouched(t: dict[str, Any], source: dict[str, Any]) -> None:
    """lm_head, the embeddings and the norms are kept exactly (SmoothQuant/AWQ may rescale norms: not checked)."""
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert t[name].dtype == source[name].dtype and torch.equal(t[name], source[name]), name
    assert not any(k.startswith("lm_head.") and k != "lm_head.weight" for k in t)


def linear_shapes() -> dict[str, tuple[int, int]]:
    h, i = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def each_linear() -> list[tuple[str, tuple[int, int]]]:
    return [(f"model.layers.{n}.{name}", shape) for n in range(LAYERS) for name, shape in linear_shapes().items()]


def assert_loads(path: Path, windows: Any) -> None:
    log_probs(path, windows[:1])


# ------------------------------------------------------------------------------------------------------------
# int4 weight-only: AWQ, GPTQ, RTN


@pytest.mark.parametrize("name,symmetric", [("awq", False), ("gptq", True), ("rtn", True)])
def test_int4_pack_quantized(build, name, symmetric, source_tensors, heldout_windows):
    out, result = build(name)
    qc = qconfig(out)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == \
        (4, "int", "group", 128, symmetric)
    assert qc["ignore"] == ["lm_head"]
    t = tensors(out)
    for prefix, (o, i) in each_linear():
        assert f"{prefix}.weight" not in t
        assert t[f"{prefix}.weight_packed"].dtype == torch.int32
        assert tuple(t[f"{prefix}.weight_packed"].shape) == (o, i // 8)
        assert t[f"{prefix}.weight_scale"].dtype == torch.bfloat16
        assert tuple(t[f"{prefix}.weight_scale"].shape) == (o, i // 128)
        assert t[f"{prefix}.weight_shape"].tolist() == [o, i]
        if symmetric:
            assert f"{prefix}.weight_zero_point" not in t
        else:
            assert t[f"{prefix}.weight_zero_point"].dtype == torch.int32
            assert tuple(t[f"{prefix}.weight_zero_point"].shape) == (o // 8, i // 128)
    assert_untouched(t, source_tensors)
    manifest = json.loads((out / "quantkit.json").read_text())
    q = manifest["quantization"]
    assert q["scheme"] == ("W4A16" if symmetric else "W4A16_ASYM") and q["ct_format"] == "pack-quantized"
    assert (q["bits"], q["group_size"], q["symmetric"], q["algorithm"]) == (4, 128, symmetric, name)
    assert result["kind"] == manifest["kind"] == "compressed-tensors"
    if name == "rtn":
        assert manifest["calibration"] is None
    else:
        assert manifest["calibration"]["samples"] == int(ARTIFACTS[name][2])
        assert len(manifest["calibration"]["tokens_sha256"]) == 64
    assert_loads(out, heldout_windows)


def test_awq_mappings_from_the_architecture(build):
    out, _ = build("awq")
    q = json.loads((out / "quantkit.json").read_text())["quantization"]
    assert q["awq_mappings_source"] == "its registry entry for LlamaForCausalLM"
    smooth = [m["smooth_layer"] for m in q["awq_mappings"]]
    assert smooth == ["re:.*input_layernorm$", "re:.*v_proj$", "re:.*post_attention_layernorm$", "re:.*up_proj$"]


def test_awq_cpu_workaround_is_scoped(build):
    """The pin_memory skip exists only while AWQ runs without an accelerator, and is undone afterwards."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    build("awq")
    assert IntermediatesCache.pin_memory.__qualname__ == "IntermediatesCache.pin_memory"
    notes = json.loads((build("awq")[0] / "quantkit.json").read_text())["notes"]
    assert any("pinning skipped" in n for n in notes) != torch.accelerator.is_available()


def test_quantized_beat_rtn_in_kl_divergence(build, heldout_windows):
    """On held-out text, AWQ and GPTQ (W4 g128, their defaults) are closer to the base model than RTN W4 g128."""
    base = log_probs(TINY, heldout_windows)
    scores = {name: kld(base, log_probs(build(name)[0], heldout_windows)) for name in ("rtn", "awq", "gptq")}
    assert 0 < scores["awq"] < scores["rtn"], scores
    assert 0 < scores["gptq"] < scores["rtn"], scores


# ------------------------------------------------------------------------------------------------------------
# FP8


def test_fp8_static_with_kv_cache(build, source_tensors, heldout_windows):
    out, _ = build("fp8")
    qc = qconfig(out)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["type"], group["weights"]["strategy"]) == ("float", "tensor")
    assert (group["input_activations"]["dynamic"], group["input_activations"]["strategy"]) == (False, "tensor")
    assert qc["kv_cache_scheme"]["num_bits"] == 8 and qc["kv_cache_scheme"]["type"] == "float"
    t = tensors(out)
    for prefix, shape in each_linear():
        assert t[f"{prefix}.weight"].dtype == torch.float8_e4m3fn and tuple(t[f"{prefix}.weight"].shape) == shape
        assert t[f"{prefix}.weight_scale"].numel() == 1 and t[f"{prefix}.input_scale"].numel() == 1
        assert t[f"{prefix}.input_scale"].item() > 0
    for n in range(LAYERS):
        for kv in ("k_scale", "v_scale"):
            assert t[f"model.layers.{n}.self_attn.{kv}"].numel() == 1
    assert_untouched(t, source_tensors)
    q = json.loads((out / "quantkit.json").read_text())["quantization"]
    assert (q["scheme"], q["kv_cache"]) == ("FP8", "fp8")
    assert_loads(out, heldout_windows)


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-block"])
def test_fp8_without_calibration(build, name, source_tensors, heldout_windows):
    out, _ = build(name)
    qc = qconfig(out)
    assert qc["format"] == "float-quantized" and qc["kv_cache_scheme"] is None
    acts = qc["config_groups"]["group_0"]["input_activations"]
    assert acts["dynamic"] is True
    t = tensors(out)
    for prefix, (o, i) in each_linear():
        assert t[f"{prefix}.weight"].dtype == torch.float8_e4m3fn
        assert f"{prefix}.input_scale" not in t
        expect = (o, 1) if name == "fp8-dynamic" else (o // 128, i // 128)
        assert tuple(t[f"{prefix}.weight_scale"].shape) == expect
    assert_untouched(t, source_tensors)
    manifest = json.loads((out / "quantkit.json").read_text())
    assert manifest["calibration"] is None
    assert manifest["quantization"]["scheme"] == {"fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}[name]
    assert_loads(out, heldout_windows)


# ------------------------------------------------------------------------------------------------------------
# INT8 SmoothQuant


@pytest.mark.parametrize("name", ["int8", "int8-rtn"])
def test_int8_smoothquant(build, name, source_tensors, heldout_windows):
    out, _ = build(name)
    qc = qconfig(out)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (8, "channel")
    assert (group["input_activations"]["dynamic"], group["input_activations"]["strategy"]) == (True, "token")
    t = tensors(out)
    for prefix, (o, i) in each_linear():
        assert t[f"{prefix}.weight"].dtype == torch.int8 and tuple(t[f"{prefix}.weight"].shape) == (o, i)
        assert tuple(t[f"{prefix}.weight_scale"].shape) == (o, 1)
        assert f"{prefix}.input_scale" not in t
    assert_untouched(t, source_tensors)
    # SmoothQuant folded its scales into the norms in front of q/k/v and gate/up
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(t[norm], source_tensors[norm])
    q = json.loads((out / "quantkit.json").read_text())["quantization"]
    assert q["algorithm"] == f"smoothquant+{'rtn' if name == 'int8-rtn' else 'gptq'}"
    assert q["smoothing_strength"] == 0.8 and q["smoothquant_mappings"]
    assert_loads(out, heldout_windows)


# ------------------------------------------------------------------------------------------------------------
# W4A8: int4 weights, FP8 activations


def test_w4a8_is_packed_for_vllm(build, source_tensors, heldout_windows):
    """vLLM's CompressedTensorsW4A8Fp8 reads int4 packed eight to an int32; compressed-tensors would infer one int4
    value per byte (int-quantized) for a float-activation scheme, so the format is asked for explicitly."""
    out, _ = build("w4a8")
    qc = qconfig(out)
    assert qc["format"] == "pack-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["group_size"], group["weights"]["symmetric"]) == \
        (4, 128, True)
    acts = group["input_activations"]
    assert (acts["type"], acts["num_bits"], acts["strategy"], acts["dynamic"]) == ("float", 8, "token", True)
    t = tensors(out)
    for prefix, (o, i) in each_linear():
        assert t[f"{prefix}.weight_packed"].dtype == torch.int32 and tuple(t[f"{prefix}.weight_packed"].shape) == \
            (o, i // 8)
        assert tuple(t[f"{prefix}.weight_scale"].shape) == (o, i // 128)
    assert_untouched(t, source_tensors)
    assert_loads(out, heldout_windows)


# ------------------------------------------------------------------------------------------------------------
# What --dry-run says against what the build made


def _planned(name: str) -> dict[str, Any]:
    """The --dry-run plan of an artifact of :data:`ARTIFACTS` (to a folder not made), as its JSON."""
    verb, *flags = ARTIFACTS[name]
    res = CliRunner().invoke(app, [verb, str(TINY), "/nonexistent/planned", *flags, "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["outputs"][0]


@pytest.mark.parametrize("name", ["w4a8", "rtn-mixed", "rtn"])
def test_the_size_estimate_is_the_built_size(build, name):
    """The dry run's disk estimate (also the free-space check) within a few percent of the artifact, an upper
    bound for a bits target: it counted W4A8's int4 weights as 8-bit (32% high) and any bits target as int4."""
    out, _ = build(name)
    built = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    estimate = _planned(name)["disk_bytes"]
    assert 0.97 * built <= estimate <= 1.05 * built, (name, estimate, built, estimate / built)


def test_a_bits_target_records_the_calibration_it_read(build):
    """rtn --target-bits reads calibration only for the sensitivity pass, which reads its first 2,048 tokens: the
    manifest, the plan and the summary say 4 x 512 (what was read), not the recipe's 128 x 512."""
    from quantkit.producers import mixed

    out, result = build("rtn-mixed")
    calib = result["calibration"]
    assert (calib["samples"], calib["seq_len"]) == (4, 512) and calib["tokens"] == mixed.SENSITIVITY_TOKENS
    assert result["quantization"]["mixed"]["sensitivity"]["tokens"] == mixed.SENSITIVITY_TOKENS
    assert _planned("rtn-mixed")["calibration"].startswith("mixed: 4 x 512 tokens")


# ------------------------------------------------------------------------------------------------------------
# Legacy layouts, bit for bit against AutoAWQ 0.2.9's code


def _ct_module(path: Path, prefix: str) -> legacy.QuantizedLinear:
    ckpt = legacy._Checkpoint(path)
    return legacy.unpack(ckpt, prefix, qconfig(path)["config_groups"]["group_0"]["weights"])


def test_autoawq_layout_matches_autoawq(build):
    gemm = pytest.importorskip("awq.modules.linear.gemm")
    from awq.utils.packing_utils import reverse_awq_order, unpack_awq

    out, _ = build("awq")
    cfg = json.loads((out / "autoawq" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": ["lm_head"]}
    assert cfg["dtype"] == "float16"
    t = tensors(out / "autoawq")
    assert t["lm_head.weight"].dtype == torch.float16 and not any(k.endswith("weight_packed") for k in t)
    for prefix, (o, i) in each_linear():
        assert tuple(t[f"{prefix}.qweight"].shape) == (i, o // 8) and t[f"{prefix}.qweight"].dtype == torch.int32
        assert tuple(t[f"{prefix}.qzeros"].shape) == (i // 128, o // 8)
        assert tuple(t[f"{prefix}.scales"].shape) == (i // 128, o) and t[f"{prefix}.scales"].dtype == torch.float16
    for n in (0, LAYERS - 1):
        for name in LINEARS:
            prefix = f"model.layers.{n}.{name}"
            q = _ct_module(out, prefix)
            scales = q.scales.t().to(torch.float16)
            zeros = q.zeros.t()
            # AutoAWQ packs a Linear holding exactly the dequantized weights: it must recover our codes
            lin = torch.nn.Linear(q.codes.shape[1], q.codes.shape[0], bias=False)
            idx = q.g_idx.long()
            lin.weight.data = (q.codes - q.zeros[:, idx]).float() * scales.t().float()[:, idx]
            ref = gemm.WQLinear_GEMM.from_linear(lin, 4, 128, scales=scales, zeros=zeros.float())
            assert torch.equal(t[f"{prefix}.qweight"], ref.qweight), prefix
            assert torch.equal(t[f"{prefix}.qzeros"], ref.qzeros), prefix
            assert torch.equal(t[f"{prefix}.scales"], ref.scales), prefix
            # and AutoAWQ's unpacking reads back our codes and zero points
            iw, iz = reverse_awq_order(*unpack_awq(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], 4), 4)
            assert torch.equal(torch.bitwise_and(iw, 15).int(), q.codes.t())
            assert torch.equal(torch.bitwise_and(iz, 15).int(), q.zeros.t())


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layout_matches_exllama_packing(build, tmp_path, bits):
    """GPTQ v1 layout == AutoAWQ's pack_exllama (the GPTQ/ExLlama layout) of the same codes and zero - 1."""
    pytest.importorskip("awq")
    from awq.utils.packing_utils import pack_exllama

    if bits == 4:
        out, _ = build("gptq")
        gdir = out / "gptq"
        cfg = json.loads((gdir / "config.json").read_text())["quantization_config"]
        assert json.loads((gdir / "quantize_config.json").read_text()) == cfg
        assert (cfg["quant_method"], cfg["bits"], cfg["group_size"], cfg["sym"], cfg["desc_act"],
                cfg["checkpoint_format"], cfg["damp_percent"]) == ("gptq", 4, 128, True, False, "gptq", 0.01)
        assert cfg["modules_in_block_to_quantize"] == [sorted(LINEARS)]
    else:
        # an int8 per-channel checkpoint made by a real `quantkit` process, then repacked through the API
        out = tmp_path / "rtn8"
        quantkit("rtn", TINY, out, "--bits", "8", "--group-size", "-1", check=True)
        gdir = tmp_path / "rtn8-gptq"
        info = legacy.write("gptq", out, gdir)
        assert (info["bits"], info["group_size"], info["modules"]) == (8, -1, LAYERS * len(LINEARS))
    t = tensors(gdir)
    per = 32 // bits
    for prefix, (o, i) in each_linear():
        q = _ct_module(out, prefix)
        groups = q.scales.shape[1]
        assert tuple(t[f"{prefix}.qweight"].shape) == (i // per, o)
        assert tuple(t[f"{prefix}.qzeros"].shape) == (groups, o // per)
        assert t[f"{prefix}.g_idx"].dtype == torch.int32 and tuple(t[f"{prefix}.g_idx"].shape) == (i,)
        ref_w, ref_z = pack_exllama(q.codes.t().contiguous(), (q.zeros - 1).t().contiguous(), bits)
        assert torch.equal(t[f"{prefix}.qweight"], ref_w), prefix
        assert torch.equal(t[f"{prefix}.qzeros"], ref_z), prefix
        assert torch.equal(t[f"{prefix}.scales"], q.scales.t().to(torch.float16))
        assert torch.equal(t[f"{prefix}.scales"].float(), q.scales.t().float()), "bf16 scales survive float16 exactly"


def test_legacy_from_a_sharded_checkpoint(build, tmp_path):
    """Large checkpoints come in shards, and a Linear's tensors may sit in different shards."""
    import shutil

    from safetensors.torch import save_file

    out, _ = build("gptq")
    t = tensors(out)
    names = sorted(t)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weight_map = {}
    for i in range(3):
        file = f"model-0000{i + 1}-of-00003.safetensors"
        save_file({k: t[k] for k in names[i::3]}, str(sharded / file))
        weight_map.update({k: file for k in names[i::3]})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(out / "config.json", sharded / "config.json")
    legacy.write("gptq", sharded, tmp_path / "gptq")
    index = json.loads((tmp_path / "gptq" / "model.safetensors.index.json").read_text())["weight_map"]
    single = tensors(out / "gptq")
    assert sorted(index) == sorted(single) and len(set(index.values())) == 3
    for name, file in index.items():
        with safe_open(str(tmp_path / "gptq" / file), "pt") as f:
            assert torch.equal(f.get_tensor(name), single[name]), name


def test_legacy_dequantizes_to_the_compressed_tensors_weights(build):
    """Repacking changes bits, not numbers: both layouts mean exactly the weights transformers decompresses."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out, _ = build("awq")
    args = qconfig(out)["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=args["weights"])
    ckpt = legacy._Checkpoint(out)
    prefix = "model.layers.3.mlp.down_proj"
    state = {k.removeprefix(prefix + "."): ckpt.get(k) for k in ckpt.weight_map if k.startswith(prefix + ".")}
    ct_weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    ours = _ct_module(out, prefix).dequantize()
    assert torch.equal(ours.to(ct_weight.dtype), ct_weight)


def test_pack_functions_on_random_codes():
    """Every code value and bit position, against AutoAWQ's packing code."""
    pytest.importorskip("awq")
    from awq.utils.packing_utils import pack_exllama

    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        codes = torch.randint(0, 2**bits, (64, 96), generator=g, dtype=torch.int32)
        ref_w, ref_z = pack_exllama(codes, codes, bits)
        assert torch.equal(legacy.pack_gptq_rows(codes, bits), ref_w)
        assert torch.equal(legacy.pack_gptq_cols(codes, bits), ref_z)
    from awq.utils.packing_utils import reverse_awq_order, unpack_awq

    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.int32)
    iw, iz = reverse_awq_order(*unpack_awq(legacy.pack_awq(codes), legacy.pack_awq(zeros), 4), 4)
    assert torch.equal(torch.bitwise_and(iw, 15).int(), codes)
    assert torch.equal(torch.bitwise_and(iz, 15).int(), zeros)


# ------------------------------------------------------------------------------------------------------------
# The real command line, recipes, refusals


def test_refusals_exit_2_without_traceback(tmp_path):
    out = tmp_path / "nope"
    for args, words in ((["awq", TINY, out, "--bits", "8", "--format", "autoawq"], "--bits 4"),
                        (["awq", TINY, out, "--group-size", "-1", "--format", "autoawq"], "per-channel"),
                        (["gptq", TINY, out, "--bits", "3"], "bits")):
        proc = quantkit(*args)
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()


def test_dry_run_on_an_existing_output_exits_as_the_build(tiny_rtn):
    """A dry run's plan that refuses (an existing output, no --force) exits 2 as the build does, after showing the
    plan; it printed "refuse" and exited 0, so a pre-flight check passed and the run then failed. --force plans."""
    for flags in ([], ["--json"]):
        proc = quantkit("rtn", TINY, tiny_rtn, "--dry-run", *flags)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: output {tiny_rtn} already exists") and "Traceback" not in proc.stderr
        shown = json.loads(proc.stdout)["outputs"][0]["action"] if flags else proc.stdout
        assert "refuse" in shown
    assert quantkit("rtn", TINY, tiny_rtn, "--dry-run", "--force").returncode == 0


def test_shipped_recipes_are_the_verbs_defaults():
    for name in ("awq", "gptq", "fp8", "fp8-dynamic", "fp8-block", "int8", "w4a8", "rtn"):
        path = recipe.find(name)
        assert path.read_text().startswith("# ")
        r = recipe.load(path, check_output_escape=False)
        assert r.output == f"out/{name}" and Path(r.model.source) == Path("models/quantkit-tiny")
        flags = {"fp8-dynamic": {"scheme": "dynamic"}, "fp8-block": {"scheme": "block"}}.get(name, {})
        default = type(r.quantize).model_validate({"method": r.quantize.method, **flags})
        assert r.quantize == default, f"{name}.yaml differs from the defaults of `quantkit {r.quantize.method}`"
        p = modifiers.plan(r.quantize)
        assert p.calibrate == ("calibration" in yaml.safe_load(path.read_text()))
        if p.calibrate:
            assert r.calibration.samples * r.calibration.seq_len <= 8192


def test_plan_table():
    from quantkit.formats.specs import AwqSpec, Fp8Spec, GptqSpec, Int8Spec, RtnSpec

    awq = modifiers.plan(AwqSpec(method="awq")).modifiers
    assert [n for n, _ in awq] == ["AWQModifier", "QuantizationModifier"] and awq[0][1]["offload_device"] is None
    offloaded = modifiers.plan(AwqSpec(method="awq", offload_activations=True)).build(["lm_head"])[0]
    assert offloaded.offload_device == "cpu"
    gptq = modifiers.plan(GptqSpec(method="gptq", act_order=False, damp=0.05))
    assert gptq.modifiers[0][1]["actorder"] is None and gptq.modifiers[0][1]["dampening_frac"] == 0.05
    assert modifiers.plan(GptqSpec(method="gptq", bits=8, group_size=-1)).scheme == "W8A16"
    channel = modifiers.plan(RtnSpec(method="rtn", group_size=-1)).modifiers[0][1]
    assert channel["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert not modifiers.plan(Fp8Spec(method="fp8", scheme="dynamic")).calibrate
    assert modifiers.plan(Fp8Spec(method="fp8", scheme="dynamic", kv_cache_fp8=True)).calibrate
    assert [n for n, _ in modifiers.plan(Int8Spec(method="int8", weights="rtn")).modifiers] == \
        ["SmoothQuantModifier", "QuantizationModifier"]
    built = modifiers.plan(Int8Spec(method="int8")).build(["lm_head"])
    assert type(built[0]).__name__ == "SmoothQuantModifier" and built[0].smoothing_strength == 0.8
    assert built[1].ignore == ["lm_head"] and built[1].scheme == "W8A8"


def test_patches_refuse_an_llmcompressor_they_were_not_read_against(monkeypatch):
    """A patch of llm-compressor internals on another version could silently do nothing (AWQ crashing on CPU again,
    mappings recorded as applied nowhere): it refuses in one line instead, and only where it applies."""
    from quantkit.errors import BackendError
    from quantkit.formats.specs import AwqSpec, RtnSpec
    from quantkit.producers import patches

    awq, rtn = modifiers.plan(AwqSpec(method="awq")), modifiers.plan(RtnSpec(method="rtn"))
    with patches.awq_resolved(awq) as names:  # the installed version is the one they were read against
        assert names == []
    monkeypatch.setattr(patches.versions, "version", lambda dist: "0.15.0")
    pinning = () if torch.accelerator.is_available() else (patches.awq_without_pin_memory,)  # patched only on CPU
    for patch in (patches.awq_resolved, *pinning):
        with pytest.raises(BackendError, match=r"written for llmcompressor 0\.14\.0\.1; 0\.15\.0 is installed"):
            with patch(awq):
                pass
        with patch(rtn):  # no AWQ: nothing is patched, so nothing is refused
            pass


@requires_gpu
def test_awq_on_gpu(tmp_path):
    out = tmp_path / "awq-gpu"
    res = CliRunner().invoke(app, ["awq", str(TINY), str(out), "--samples", "8", "--seq-len", "128",
                                   "--device", "cuda", "--json"])
    assert res.exit_code == 0, res.output
    assert qconfig(out)["format"] == "pack-quantized"
    assert not any("pinning skipped" in n for n in json.loads((out / "quantkit.json").read_text())["notes"])


@requires_gpu
def test_awq_offload_keeps_scales_on_gpu(tmp_path):
    """AWQ's cached inputs kept in host memory (--offload-activations) give bit for bit the weights and scales of the
    run that keeps them on the GPU (the default), so the memory it saves costs no quality."""
    outs = {}
    for flag in ("--offload-activations", "--no-offload-activations"):
        outs[flag] = tmp_path / flag.strip("-")
        res = CliRunner().invoke(app, ["awq", str(TINY), str(outs[flag]), "--samples", "8", "--seq-len", "128",
                                       "--device", "cuda", flag, "--json"])
        assert res.exit_code == 0, res.output
        summary = json.loads((outs[flag] / "quantkit.json").read_text())["quantization"]
        assert summary["offload_activations"] is (flag == "--offload-activations")
    on, off = (safe_open(str(o / "model.safetensors"), "pt") for o in outs.values())
    assert set(on.keys()) == set(off.keys())
    for key in on.keys():
        assert torch.equal(on.get_tensor(key), off.get_tensor(key)), key


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gptq_on_two_gpus(tmp_path):
    out = tmp_path / "gptq-ddp"
    proc = quantkit("gptq", TINY, out, "--samples", "16", "--seq-len", "128", "--num-gpus", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert qconfig(out)["format"] == "pack-quantized"
    assert json.loads(proc.stdout)[0]["quantization"]["scheme"] == "W4A16"



def test_dense_copy_scores_as_transformers_does(build, heldout_windows, tmp_path):
    """The transformers engine scores asymmetric MoE experts through a dense copy (transformers 5.17 cannot reload
    them): on the dense AWQ artifact, which transformers does load, the copy gives the same log-probabilities."""
    from quantkit.engines.transformers import dense_copy

    out, _ = build("awq")
    assert not dense_copy.needed(out)  # only mixture-of-experts checkpoints take the detour
    copy = dense_copy.write(out, tmp_path / "dense")
    assert "quantization_config" not in json.loads((copy / "config.json").read_text())
    a, b = log_probs(out, heldout_windows[:2]), log_probs(copy, heldout_windows[:2])
    assert (a - b).abs().max().item() < 1e-3
