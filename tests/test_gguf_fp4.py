"""FP4 in GGUF at the pinned llama.cpp (b11312), for real: MXFP4_MOE, and checkpoints that are already FP4.

* MXFP4_MOE on the MoE reference model (Qwen3-MoE, 8 experts): every expert tensor is MXFP4 and every other matrix
  Q8_0 in the file, llama.cpp loads it and ``quantkit eval`` scores it (bounds from the measured values, below);
* MXFP4_MOE on the dense reference model is llama.cpp's Q8_0 of the same intermediate, byte for byte: the type has
  no MXFP4 for a model without experts;
* an NVFP4 checkpoint made by llm-compressor (NVFP4A16, round to nearest, lm_head kept) is repacked by llama.cpp's
  converter into GGUF NVFP4 without loss: dequantized by gguf-py, every repacked matrix equals compressed-tensors'
  own decompression of the checkpoint bit for bit, and ``quantkit eval`` against the checkpoint in transformers
  measures only llama.cpp's 8-bit activations (KLD 0.00027, top-1 0.990, 4,096 held-out tokens at ctx 1024); its
  tensors are tagged to keep 8-bit activations (llama.cpp would use FP4 ones on Blackwell); llama-server serves it;
* what the converter cannot make right is refused before any work with exit code 2 and one line: compressed-tensors
  MXFP4 (no llama.cpp pull request found converts it for a dense model), any other quantized compressed-tensors
  checkpoint (it would be dequantized and quantized again), another type from an NVFP4 checkpoint, NVFP4 from float
  weights.

quantkit's own ModelOpt export (``build-trt`` w4a16_nvfp4, its ``hf/`` checkpoint) is repacked the same way, by the
converter's original ModelOpt path (skipped without the ModelOpt environment, ``.venv-trt``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT, TINY
from test_trt import CALIBRATION, needs_modelopt
from quantkit import api, recipe
from quantkit.errors import UsageError
from quantkit.producers.gguf import quantize, target_bits

pytestmark = pytest.mark.e2e

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE = ROOT / "models" / "quantkit-tiny-moe"
EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
EVAL = ("--engine", "llama.cpp", "--dataset", "heldout", "--max-tokens", "4096", "--ctx", "1024", "--json")
SCHEMES = ("NVFP4A16", "MXFP4A16", "W4A16")


def tensors(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def file_type(path: Path) -> int:
    f = gguf.GGUFReader(path).fields["general.file_type"]
    return int(f.parts[f.data[0]][0])


def made(path: Path) -> dict[str, Path]:
    """The artifact's files by type."""
    m = json.loads((path / "quantkit.json").read_text())
    return {t: path / f for t, f in m["quantization"]["files"].items()}


def scores(proc: Any) -> dict[str, dict[str, Any]]:
    """``quantkit eval --json``'s results by file name."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {Path(r["path"]).name: r for r in json.loads(proc.stdout)["results"]}


def gguf_recipe(model: Path, out: Path, types: list[str]) -> Any:
    return recipe.load(None, {"model.source": str(model), "output": str(out)},
                       base={"quantize": {"method": "gguf", "types": types}})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference model quantized by llm-compressor, round to nearest, lm_head kept, saved compressed."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    root = tmp_path_factory.mktemp("fp4-checkpoints")
    out = {}
    for scheme in SCHEMES:
        model = transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype="auto")
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        model.save_pretrained(root / scheme, save_compressed=True)
        transformers.AutoTokenizer.from_pretrained(TINY).save_pretrained(root / scheme)
        out[scheme] = root / scheme
    return out


# ------------------------------------------------------------------------------------------------------------
# MXFP4_MOE


@pytest.fixture(scope="module")
def moe_mxfp4(tmp_path_factory: pytest.TempPathFactory, cli: Callable) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fp4-moe") / "moe"
    cli("gguf", MOE, out, "-t", "MXFP4_MOE", "-t", "Q4_K_M", "--json", check=True)
    return {"files": made(out), "eval": scores(cli("eval", out, *EVAL, timeout=600))}


def test_mxfp4_moe_makes_the_experts_mxfp4(moe_mxfp4: dict[str, Any]) -> None:
    path = moe_mxfp4["files"]["MXFP4_MOE"]
    assert file_type(path) == 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    found = tensors(path)
    experts = {n: t for n, t in found.items() if EXPERTS.fullmatch(n)}
    assert len(experts) == 2 * 3  # two MoE layers, gate/up/down, each one 3-D tensor of the 8 experts
    for name, t in experts.items():
        assert t.tensor_type.name == "MXFP4" and int(t.shape[2]) == 8, name
    others = {t.tensor_type.name for n, t in found.items() if n not in experts and len(t.shape) >= 2}
    assert others == {"Q8_0", "F32"}  # attention, embeddings, output: Q8_0; the routers stay F32
    assert found["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    # the experts' stored bits: 4-bit values with one 8-bit scale per 32 (4.25); the file's matrices with Q8_0
    assert target_bits.file_bits(path) == pytest.approx(4.754, abs=0.01)


def test_mxfp4_moe_is_read_back_and_scored_by_llama_cpp(moe_mxfp4: dict[str, Any]) -> None:
    """llama.cpp loads and scores both files; measured 2026-12-04: MXFP4_MOE KLD 0.0420, top-1 0.877, ppl ratio
    1.022 at 6.53 bits/weight (file); Q4_K_M KLD 0.0185, top-1 0.913 at 5.98. MXFP4 (power-of-two scales, no
    offsets) costs this model's experts more than Q4_K does."""
    mx = moe_mxfp4["eval"][moe_mxfp4["files"]["MXFP4_MOE"].name]
    q4 = moe_mxfp4["eval"][moe_mxfp4["files"]["Q4_K_M"].name]
    assert mx["engine"]["engine"] == "llama.cpp"
    assert 0.02 < mx["kld"] < 0.08 and mx["top1"] > 0.83 and mx["ppl_ratio"] < 1.05
    assert mx["kld"] > q4["kld"]
    assert mx["bits_per_weight"] == pytest.approx(6.53, abs=0.02)


def test_mxfp4_moe_of_a_dense_model_is_q8_0(tmp_path: Path) -> None:
    """No tensor of a dense model has experts, so llama.cpp writes every matrix Q8_0: the same bytes as its Q8_0."""
    res = api.quantize(gguf_recipe(TINY, tmp_path / "dense", ["BF16", "MXFP4_MOE"]))[0]
    files = made(res.path)
    q8 = tmp_path / "q8.gguf"
    quantize.quantize(files["BF16"], q8, "Q8_0")
    mx, ref = tensors(files["MXFP4_MOE"]), tensors(q8)
    assert file_type(files["MXFP4_MOE"]) == 38 and set(mx) == set(ref)
    assert "MXFP4" not in {t.tensor_type.name for t in mx.values()}
    for name, t in mx.items():
        assert t.tensor_type == ref[name].tensor_type and np.array_equal(t.data, ref[name].data), name
    assert res.manifest.quantization["fallbacks"] == {}


# ------------------------------------------------------------------------------------------------------------
# FP4 checkpoints


@pytest.fixture(scope="module")
def nvfp4(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cli: Callable) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fp4-nvfp4") / "nvfp4"
    cli("gguf", checkpoints["NVFP4A16"], out, "-t", "NVFP4", "--json", check=True)
    manifest = json.loads((out / "quantkit.json").read_text())
    return {"path": out, "file": made(out)["NVFP4"], "manifest": manifest,
            "eval": scores(cli("eval", out, *EVAL, timeout=600))}


def test_nvfp4_checkpoint_is_repacked(nvfp4: dict[str, Any]) -> None:
    q = nvfp4["manifest"]["quantization"]
    assert q["types"] == ["NVFP4"] and q["intermediate"] is None and q["fallbacks"] == {}
    # 8 blocks x 7 matrices repacked; embeddings and the kept lm_head in the checkpoint's bf16; norms and the
    # per-matrix global scales F32
    assert q["repacked"]["NVFP4"] == {"from": "compressed-tensors nvfp4-pack-quantized",
                                      "tensor_types": {"BF16": 2, "F32": 73, "NVFP4": 56}}
    assert file_type(nvfp4["file"]) == 39  # LLAMA_FTYPE_MOSTLY_NVFP4
    assert target_bits.file_bits(nvfp4["file"]) == 4.5  # 64 E2M1 values and four E4M3 scales in 36 bytes


def test_weight_only_nvfp4_keeps_8_bit_activations(nvfp4: dict[str, Any]) -> None:
    """NVFP4A16 quantizes no activations: every repacked tensor is tagged prec_a4 false, which llama.cpp reads to
    keep 8-bit activations where it would use FP4 ones (Blackwell); upstream tags only ModelOpt's W4A16_NVFP4."""
    fields = gguf.GGUFReader(nvfp4["file"]).fields
    names, values = fields["general.tensor_extra.name"], fields["general.tensor_extra.prec_a4"]
    tagged = {bytes(names.parts[i]).decode(): bool(values.parts[j][0]) for i, j in zip(names.data, values.data)}
    repacked = {n for n, t in tensors(nvfp4["file"]).items() if t.tensor_type.name == "NVFP4"}
    assert tagged == dict.fromkeys(repacked, False)
    assert any("8-bit activations" in n for n in nvfp4["manifest"]["notes"])


def test_nvfp4_repack_is_lossless(checkpoints: dict[str, Path], nvfp4: dict[str, Any]) -> None:
    """Every repacked matrix, dequantized by gguf-py and times its global scale, is compressed-tensors' own
    decompression of the checkpoint exactly (attn_q/attn_k are compared as a multiset of rows: the converter
    permutes their rows for llama.cpp's rotary layout)."""
    from transformers import CompressedTensorsConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["NVFP4A16"], dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))
    found = tensors(nvfp4["file"])
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for i in range(model.config.num_hidden_layers):
        for short, hf in names.items():
            t = found[f"blk.{i}.{short}.weight"]
            assert t.tensor_type.name == "NVFP4"
            scale = found.get(f"blk.{i}.{short}.scale")
            got = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            got = got * (float(scale.data[0]) if scale is not None else 1.0)
            got = torch.from_numpy(got).to(torch.bfloat16)
            want = model.get_submodule(f"model.layers.{i}.{hf}").weight.detach()
            if short in ("attn_q", "attn_k"):
                got, want = (torch.sort(x.float(), dim=0).values for x in (got, want))
            assert torch.equal(got, want), f"blk.{i}.{short}"


def test_nvfp4_is_scored_against_its_checkpoint(nvfp4: dict[str, Any]) -> None:
    """Against the checkpoint in transformers only llama.cpp's arithmetic differs (its CPU kernel rounds
    activations to Q8_0): measured KLD 0.00027, top-1 0.990, ppl ratio 0.9995."""
    r = nvfp4["eval"][nvfp4["file"].name]
    assert r["engine"]["engine"] == "llama.cpp"
    assert r["kld"] < 0.002 and r["top1"] > 0.97 and abs(r["ppl_ratio"] - 1) < 0.01


def test_nvfp4_bits_per_weight_are_over_the_models_parameters(nvfp4: dict[str, Any]) -> None:
    """The repack's source is the NVFP4 checkpoint, whose parameters are the model's 10,490,112: counted as stored
    elements (packed bytes and scales) they were 7,737,656, and eval gave the file 12.64 bits per weight for its 9.3
    (docs/gguf.md's table says 9.32)."""
    assert nvfp4["manifest"]["source"]["parameters"] == 10_490_112
    file = nvfp4["file"]
    assert nvfp4["eval"][file.name]["bits_per_weight"] == round(8 * file.stat().st_size / 10_490_112, 3) < 9.5


def test_nvfp4_is_served_by_llama_server(nvfp4: dict[str, Any], cli: Callable) -> None:
    """llama.cpp's own server loads the file as NVFP4 and answers (SmolLM2's NVFP4A16 file answers "Paris")."""
    proc = cli("smoke", nvfp4["path"], "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "passed" and run["facts"]["file_type"] == "NVFP4"
    assert run["completion"]["completion_tokens"] > 0


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 3-bit magnitudes; the fourth bit is the sign


@needs_modelopt
def test_modelopt_nvfp4_export_is_repacked(tmp_path: Path, cli: Callable) -> None:
    """quantkit's own ModelOpt export (build-trt w4a16_nvfp4, its hf/ checkpoint) through the converter's original
    NVFP4 path: every matrix is ModelOpt's E2M1 values times its E4M3 block scales and FP32 tensor scale, exactly,
    and upstream tags W4A16_NVFP4 to keep 8-bit activations. Measured against the bf16 model (the file alone):
    KLD 0.0354, top-1 0.890, as compressed-tensors' NVFP4A16 (0.0347)."""
    from safetensors.torch import load_file

    art = tmp_path / "trt"
    r = recipe.load(None, base={"model": {"source": str(TINY)}, "output": str(art), "calibration": CALIBRATION,
                                "quantize": {"method": "trt", "quantization": "w4a16_nvfp4", "kv_cache": "auto"}})
    api.quantize_one(r, r.quantize, art)
    res = api.quantize(gguf_recipe(art / "hf", tmp_path / "gguf", ["NVFP4"]))[0]
    assert res.manifest.quantization["repacked"]["NVFP4"] == {
        "from": "modelopt W4A16_NVFP4", "tensor_types": {"BF16": 2, "F32": 73, "NVFP4": 56}}
    path = made(res.path)["NVFP4"]
    fields = gguf.GGUFReader(path).fields
    assert {bool(fields["general.tensor_extra.prec_a4"].parts[i][0])
            for i in fields["general.tensor_extra.prec_a4"].data} == {False}
    found, source = tensors(path), load_file(art / "hf" / "model.safetensors")
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    for gguf_name, hf in (("blk.2.attn_v", "model.layers.2.self_attn.v_proj"),
                          ("blk.5.ffn_down", "model.layers.5.mlp.down_proj")):
        packed = source[f"{hf}.weight"]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
        blocks = source[f"{hf}.weight_scale"].double().repeat_interleave(16, dim=1)
        want = lut[codes] * blocks * source[f"{hf}.weight_scale_2"].double()
        t = found[f"{gguf_name}.weight"]
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64))
        assert torch.equal(got * float(found[f"{gguf_name}.scale"].data[0]), want), gguf_name


def test_mxfp4_checkpoint_is_refused_in_one_line(checkpoints: dict[str, Path], tmp_path: Path,
                                                 cli: Callable) -> None:
    out = tmp_path / "out"
    proc = cli("gguf", checkpoints["MXFP4A16"], out, "-t", "MXFP4_MOE")
    assert proc.returncode == 2 and not out.exists()
    first = proc.stderr.strip().splitlines()[0]
    assert "compressed-tensors MXFP4" in first and "llama.cpp b11312" in first and "LlamaForCausalLM" in first
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("scheme,types,says", [
    ("W4A16", ["Q4_K_M"], "already quantized (compressed-tensors pack-quantized)"),
    ("NVFP4A16", ["Q4_K_M", "NVFP4"], "Q4_K_M would quantize its 4-bit weights a second time"),
    ("NVFP4A16", ["F16"], "F16 would quantize its 4-bit weights a second time"),
    (None, ["NVFP4"], "is written only by repacking a checkpoint already in that format"),
])
def test_what_the_converter_cannot_make_right_is_refused(checkpoints: dict[str, Path], tmp_path: Path,
                                                          scheme: str | None, types: list[str], says: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=re.escape(says)):
        api.quantize(gguf_recipe(checkpoints[scheme] if scheme else TINY, out, types))
    assert not out.exists()
