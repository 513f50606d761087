"""TensorRT-LLM through ModelOpt, end to end on the reference model (issue 7).

Each quantization of models/quantkit-tiny is built with tp=1 (and each quantized layout but FP4 with tp=2) by the
real producer (quantkit's calibration loader here, ModelOpt in the .venv-trt environment as a subprocess; the fp8
build through the CLI), once for every test that reads it, and the exports are read back as tensors:

* the TensorRT-LLM checkpoint: config fields, the exact tensor names, dtypes, and scales that dequantize back to the
  source weights (so a dropped or wrong scale fails), and the tp=2 shards put back together bit-equal to tp=1;
* the unified Hugging Face checkpoint: hf_quant_config.json, the scale tensors, the tokenizer.

Exports are never loaded with plain transformers: it ignores ``quant_method: modelopt`` and would load them wrong.
Skipped (with the reason) when no ModelOpt environment is available; ``make install`` builds .venv-trt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit import api, integrity, recipe
from quantkit.errors import QuantkitError
from quantkit.producers.trt import pyenv
from quantkit.engines.vllm import kernels
from quantkit.manifest import read_manifest
from quantkit.source import vet

from conftest import quantkit

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "quantkit-tiny"
CALIBRATION = {"dataset": "mixed", "samples": 8, "seq_len": 128}


def _environment() -> tuple[pyenv.TrtEnvironment | None, str]:
    try:
        return pyenv.probe(None), ""
    except QuantkitError as e:
        return None, e.message


ENV, WHY = _environment()
needs_modelopt = pytest.mark.skipif(ENV is None, reason=f"no ModelOpt environment ({WHY}); `make install` builds "
                                    ".venv-trt")

# quantization -> (kv_cache asked, quant_algo, kv_cache_quant_algo, weight dtype in the TensorRT-LLM checkpoint)
CASES = {
    "fp8": ("fp8", "FP8", "FP8", torch.float8_e4m3fn),
    "int8_sq": ("int8", "W8A8_SQ_PER_CHANNEL", "INT8", torch.int8),
    "int4_awq": ("auto", "W4A16_AWQ", None, torch.int8),
    "w4a8_awq": ("fp8", "W4A8_AWQ", "FP8", torch.int8),
    "nvfp4": ("auto", "NVFP4", None, torch.uint8),
    "w4a16_nvfp4": ("auto", "W4A16_NVFP4", None, torch.uint8),
    "none": ("auto", None, None, torch.bfloat16),
}
# NVFP4 (two E2M1 values a byte, an FP8 E4M3 scale per 16 inputs under an FP32 scale per tensor): built at tp=1 only;
# its tensor-parallel split is ModelOpt's code path for every group-quantized format, which int4_awq covers at tp=2.
FP4 = ("nvfp4", "w4a16_nvfp4")
# Largest ||dequantized - source|| / ||source|| per linear weight (measured: fp8 0.027, int8 0.016, int4 0.121).
MAX_REL_ERROR = {"fp8": 0.05, "int8_sq": 0.03, "int4_awq": 0.2, "w4a8_awq": 0.2, "nvfp4": 0.2, "w4a16_nvfp4": 0.2,
                 "none": 0.0}
# TensorRT-LLM module -> the source module(s) it holds (its GatedMLP calls the activated branch "fc").
LINEARS = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.dense": ("self_attn.o_proj",), "mlp.fc": ("mlp.gate_proj",), "mlp.gate": ("mlp.up_proj",),
           "mlp.proj": ("mlp.down_proj",)}
COLUMN_PARALLEL = ("attention.qkv", "mlp.fc", "mlp.gate")
ROW_PARALLEL = ("attention.dense", "mlp.proj")
# Scale tensors each quantized linear carries, per quantization.
LINEAR_SCALES = {
    "fp8": {"weights_scaling_factor", "activation_scaling_factor"},
    "int8_sq": {"weights_scaling_factor", "activation_scaling_factor", "prequant_scaling_factor"},
    "int4_awq": {"weights_scaling_factor", "prequant_scaling_factor"},
    "w4a8_awq": {"weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor",
                 "prequant_scaling_factor"},
    "nvfp4": {"weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor"},
    "w4a16_nvfp4": {"weights_scaling_factor", "weights_scaling_factor_2"},
    "none": set(),
}
KV_SCALES = {"kv_cache_scaling_factor", "k_cache_scaling_factor", "v_cache_scaling_factor"}
QUANTS = list(CASES)
# tp=2 for each quantized layout whose shards split differently (per-tensor FP8, per-channel INT8 with SmoothQuant,
# INT4 groups with AWQ, W4A8's second scale). Not for "none": its bf16 tensors split along the same dimensions as
# every quantized format's weights, and its other tensors are those of every tp=2 build above.
TP2_QUANTS = [q for q in QUANTS if q not in (*FP4, "none")]
# The one build made through the CLI (``build-trt --checkpoint-only --json``, test_cli_build_trt_checkpoint_only_json
# reads its output); the other tests read it as the fp8 tp=1 build, as they read every build made through the API.
CLI_BUILD = ("fp8", 1)


def _recipe(tmp_path: Path, **quantize: object) -> Path:
    path = tmp_path / "trt.yaml"
    path.write_text(json.dumps({"model": {"source": str(TINY)}, "output": "art", "calibration": CALIBRATION,
                                "quantize": {"method": "trt", **quantize}}))
    return path


def _build_one(root: Path, quantization: str, tp: int) -> Path:
    out = root / f"{quantization}-tp{tp}"
    r = recipe.load(None, base={
        "model": {"source": str(TINY)}, "output": str(out), "calibration": CALIBRATION,
        "quantize": {"method": "trt", "quantization": quantization, "kv_cache": CASES[quantization][0], "tp": tp}})
    api.quantize_one(r, r.quantize, out)
    return out


def _build_cli(root: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """``build-trt --checkpoint-only --json`` of the fp8 recipe, with ``--python`` relative to where the user is
    (the repository, as ``--python .venv-trt/bin/python``): the ModelOpt worker runs in another directory and must
    still find it."""
    quantization, tp = CLI_BUILD
    out = root / f"{quantization}-tp{tp}"
    recipe_file = _recipe(root, quantization=quantization, kv_cache=CASES[quantization][0], tp=tp)
    proc = quantkit("build-trt", recipe_file, "--checkpoint-only", "--json", "--python",
                    os.path.relpath(ENV.python, ROOT), "-o", str(out), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


# The tensor-parallel sizes a test needs built, beyond its own ``tp`` parameter.
TPS_NEEDED = {"test_tp2_shards_reassemble_to_tp1": (1, 2)}
CLI_TEST = "test_cli_build_trt_checkpoint_only_json"


class Builds:
    """The module's ModelOpt builds, each made once: ``builds(quantization, tp)`` -> the artifact folder;
    ``builds.cli()`` -> the CLI build's folder and its finished process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[tuple[str, int], Future] = {}

    def submit(self, quantization: str, tp: int) -> Future:
        key = (quantization, tp)
        if key not in self.futures:
            self.futures[key] = self.pool.submit(_build_cli, self.root) if key == CLI_BUILD else \
                self.pool.submit(_build_one, self.root, quantization, tp)
        return self.futures[key]

    def __call__(self, quantization: str, tp: int) -> Path:
        made = self.submit(quantization, tp).result()
        return made[0] if (quantization, tp) == CLI_BUILD else made

    def cli(self) -> tuple[Path, subprocess.CompletedProcess]:
        return self.submit(*CLI_BUILD).result()


@pytest.fixture(scope="module")
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    """The builds, through quantkit's API (one through the CLI).

    Every build the selected tests will ask for is started up front, two at a time: most of a build is the
    ModelOpt process importing torch, transformers and modelopt, which is single-threaded.
    """
    builds = Builds(tmp_path_factory.mktemp("trt"))
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is not request.module:
            continue
        if item.originalname == CLI_TEST:
            builds.submit(*CLI_BUILD)
        elif "quantization" in params:
            for tp in TPS_NEEDED.get(item.originalname, (params.get("tp", 1),)):
                builds.submit(params["quantization"], tp)
    yield builds
    builds.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    return load_file(TINY / "model.safetensors")


def _config() -> dict:
    return json.loads((TINY / "config.json").read_text())


def _ranks(art: Path) -> list[dict[str, torch.Tensor]]:
    files = sorted((art / "trtllm-ckpt").glob("rank*.safetensors"))
    return [load_file(f) for f in sorted(files, key=lambda f: int(f.stem.removeprefix("rank")))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (also for FP8, where NaN-free ``==`` is not the same question)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's INT4 layout: (out/2, in) bytes, output rows 2i in the low nibble and 2i+1 in the high one."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(packed.shape[0] * 2, packed.shape[1]).float()


# The 16 values of FP4 E2M1 by their 4-bit code: sign in bit 3, then 2 exponent bits and 1 mantissa bit.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 layout: (out, in/2) bytes, input column 2j in the low nibble and 2j+1 in the high one."""
    b = packed.view(torch.uint8).long()
    return torch.stack([E2M1[b & 0xF], E2M1[b >> 4]], dim=2).reshape(packed.shape[0], packed.shape[1] * 2)


def _dequantize(quantization: str, t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The weight a TensorRT-LLM linear computes with: quantized values x scales, x the AWQ/SmoothQuant
    pre-quant scale that multiplies its input."""
    w, s = t[prefix + "weight"], t.get(prefix + "weights_scaling_factor")
    if quantization == "none":
        return w.float()
    if quantization == "fp8":
        out = w.float() * s.float()
    elif quantization == "int8_sq":
        out = w.float() * s.float()[:, None]
    elif quantization in FP4:  # each block of 16 x its FP8 scale x the tensor's FP32 scale
        out = _unpack_fp4(w) * s.float().repeat_interleave(16, dim=1) * t[prefix + "weights_scaling_factor_2"].float()
    else:
        group = w.shape[1] // s.shape[1]
        out = _unpack_int4(w) * s.float().repeat_interleave(group, dim=1)
    pre = t.get(prefix + "prequant_scaling_factor")
    return out * pre.float()[None, :] if pre is not None else out


def _expected_names(quantization: str, layers: int) -> set[str]:
    names = {"lm_head.weight", "transformer.ln_f.weight", "transformer.vocab_embedding.weight"}
    for i in range(layers):
        p = f"transformer.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_layernorm.weight"}
        for mod in LINEARS:
            names |= {p + f"{mod}.weight"} | {p + f"{mod}.{s}" for s in LINEAR_SCALES[quantization]}
        if CASES[quantization][2]:
            names |= {p + f"attention.{s}" for s in KV_SCALES}
    return names


def _split_dim(name: str, shard: torch.Tensor, config: dict) -> int | None:
    """The dimension TensorRT-LLM splits a tensor along for tensor parallelism (None: replicated on every rank)."""
    if name == "lm_head.weight":
        return 0
    if name == "transformer.vocab_embedding.weight":
        return config["embedding_sharding_dim"] if config.get("use_parallel_embedding") else None
    module, _, leaf = name.rpartition(".")
    per_tensor = shard.numel() == 1
    if module.endswith(COLUMN_PARALLEL):  # output channels split: weight rows and per-row scales
        return 0 if leaf == "weight" or (leaf == "weights_scaling_factor" and not per_tensor) else None
    if module.endswith(ROW_PARALLEL):  # input channels split: weight columns, per-input scales, group scales
        if leaf == "weight" or (leaf == "weights_scaling_factor" and shard.dim() == 2):
            return 1
        return 0 if leaf == "prequant_scaling_factor" else None
    return None


def _merge(name: str, shards: list[torch.Tensor], config: dict) -> torch.Tensor:
    """Put one tensor's shards back together; replicated tensors must be bit-equal on every rank."""
    dim = _split_dim(name, shards[0], config)
    if dim is None:
        assert all(_same(s, shards[0]) for s in shards[1:]), f"{name} differs between ranks"
        return shards[0]
    if ".attention.qkv." in name and dim == 0:  # each rank holds [q_r; k_r; v_r]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        parts: list[list[torch.Tensor]] = [[], [], []]
        for s in shards:
            q = s.shape[0] * heads // (heads + 2 * kv_heads)
            kv = (s.shape[0] - q) // 2
            for part, piece in zip(parts, torch.split(s, [q, kv, kv], dim=0)):
                part.append(piece)
        return torch.cat([torch.cat(p, dim=0) for p in parts], dim=0)
    return torch.cat(shards, dim=dim)


# ------------------------------------------------------------------------------------------------------------
# The TensorRT-LLM checkpoint


@needs_modelopt
@pytest.mark.slow
@pytest.mark.parametrize("quantization,tp", [(q, tp) for q in QUANTS for tp in (1, 2) if tp == 1 or q not in FP4])
def test_trtllm_checkpoint_config_and_tensors(build, quantization: str, tp: int) -> None:
    art = build(quantization, tp)
    _, algo, kv_algo, weight_dtype = CASES[quantization]
    cfg = json.loads((art / "trtllm-ckpt" / "config.json").read_text())
    assert cfg["architecture"] == "LlamaForCausalLM"
    assert cfg["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert cfg["quantization"]["quant_algo"] == algo
    assert cfg["quantization"]["kv_cache_quant_algo"] == kv_algo
    if algo:
        assert "lm_head" in cfg["quantization"]["exclude_modules"]
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        assert cfg["quantization"]["group_size"] == 128
    if quantization in FP4:
        assert cfg["quantization"]["group_size"] == 16
    assert [p.name for p in sorted((art / "trtllm-ckpt").glob("rank*.safetensors"))] == \
        [f"rank{r}.safetensors" for r in range(tp)]

    src = _config()
    expected = _expected_names(quantization, src["num_hidden_layers"])
    for rank, t in enumerate(_ranks(art)):
        assert set(t) == expected, f"rank {rank}: unexpected {sorted(set(t) - expected)[:5]}, " \
                                   f"missing {sorted(expected - set(t))[:5]}"
        for name, tensor in t.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module.rpartition("layers.")[2].split(".", 1)[-1] in LINEARS:
                assert tensor.dtype == weight_dtype, name
            elif leaf == "weights_scaling_factor" and quantization in FP4:  # E4M3 scales of 16-value blocks
                assert tensor.dtype == torch.float8_e4m3fn, name
                assert tensor.shape == (t[module + ".weight"].shape[0], t[module + ".weight"].shape[1] * 2 // 16)
                assert torch.isfinite(tensor.float()).all() and (tensor.float() >= 0).all(), name
            elif leaf in ("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor") \
                    or leaf in KV_SCALES:
                assert tensor.dtype == torch.float32, name
                assert torch.isfinite(tensor).all() and (tensor > 0).all(), f"{name}: scales must be positive"
            elif leaf == "prequant_scaling_factor":
                assert tensor.dtype == torch.bfloat16 and (tensor > 0).all(), name
            else:
                assert tensor.dtype == torch.bfloat16, name

    m = read_manifest(art)
    assert m.kind == "tensorrt-llm"
    assert m.quantization["quant_algo"] == algo and m.quantization["world_size"] == tp
    engine = m.quantization["engine"]
    if (quantization, tp) == CLI_BUILD:  # --checkpoint-only: step 2 skipped (test_cli_build_trt_checkpoint_only_json)
        assert engine["status"] == "skipped" and not (art / "engine").exists()
    elif not ENV.tensorrt_llm:  # step 2 says what is missing and what was produced instead
        assert engine["status"] == "unavailable" and not (art / "engine").exists()
        assert f"tensorrt_llm is not installed in {ENV.python}" in m.notes[0]
        assert "trtllm-build --checkpoint_dir trtllm-ckpt --output_dir engine" in m.notes[0]
        assert f"--workers {tp}" in m.notes[0]
    assert integrity.verify(art).ok


@needs_modelopt
@pytest.mark.slow
@pytest.mark.parametrize("quantization", QUANTS)
def test_trtllm_scales_dequantize_to_the_source_weights(build, source, quantization: str) -> None:
    """Quantized values x their scales (x the pre-quant scale) give back the source weights, within the
    format's own rounding error: a dropped, transposed or mis-assigned scale fails this."""
    (t,) = _ranks(build(quantization, 1))
    for i in range(_config()["num_hidden_layers"]):
        for mod, hf_names in LINEARS.items():
            want = torch.cat([source[f"model.layers.{i}.{n}.weight"].float() for n in hf_names], dim=0)
            got = _dequantize(quantization, t, f"transformer.layers.{i}.{mod}.")
            assert got.shape == want.shape, mod
            rel = ((got - want).norm() / want.norm()).item()
            assert rel <= MAX_REL_ERROR[quantization], f"layer {i} {mod}: relative error {rel:.4f}"
    assert _same(t["transformer.vocab_embedding.weight"], source["model.embed_tokens.weight"])
    assert _same(t["lm_head.weight"], source["lm_head.weight"])


@needs_modelopt
@pytest.mark.slow
@pytest.mark.parametrize("quantization", TP2_QUANTS)
def test_tp2_shards_reassemble_to_tp1(build, quantization: str) -> None:
    (full,) = _ranks(build(quantization, 1))
    ranks = _ranks(build(quantization, 2))
    config = json.loads((build(quantization, 2) / "trtllm-ckpt" / "config.json").read_text())
    split = 0
    for name, want in full.items():
        shards = [r[name] for r in ranks]
        if _split_dim(name, shards[0], config) is not None:
            split += 1
            assert all(s.numel() * 2 == want.numel() for s in shards), f"{name} is not halved"
        assert _same(_merge(name, shards, config), want), f"{name}: tp=2 shards do not reassemble to tp=1"
    assert split >= 5 * _config()["num_hidden_layers"] + 2  # every linear weight, the embedding and lm_head


# ------------------------------------------------------------------------------------------------------------
# The unified Hugging Face checkpoint


@needs_modelopt
@pytest.mark.slow
@pytest.mark.parametrize("quantization", QUANTS)
def test_unified_hf_checkpoint(build, source, quantization: str) -> None:
    art = build(quantization, 1)
    hf = art / "hf"
    _, algo, kv_algo, _ = CASES[quantization]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).is_file(), name
    assert (hf / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()
    t = load_file(hf / "model.safetensors")
    layers = _config()["num_hidden_layers"]
    linears = [f"model.layers.{i}.{n}" for i in range(layers) for names in LINEARS.values() for n in names]
    if algo is None:
        assert not (hf / "hf_quant_config.json").exists()
        assert all(_same(t[k], source[k]) for k in source)
        return
    if kv_algo == "INT8":  # ModelOpt's unified export carries FP8 KV scales only; INT8 stays in trtllm-ckpt/
        kv_algo = None
        assert any("model-dtype KV cache" in n for n in read_manifest(art).notes)
    q = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == algo and q["kv_cache_quant_algo"] == kv_algo
    # vLLM 0.26 loads ModelOpt's FP8 and NVFP4 exports; the others are refused before a server starts
    assert (kernels.vllm_refusal(hf) is None) == (quantization in ("fp8", *FP4))
    assert json.loads((hf / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    weight_dtype = {"fp8": torch.float8_e4m3fn, "int8_sq": torch.int8}.get(quantization, torch.uint8)
    for lin in linears:
        assert t[lin + ".weight"].dtype == weight_dtype, lin
        if quantization in FP4:  # vLLM's ModelOpt NVFP4 names: E4M3 block scales, the FP32 tensor scale beside
            assert t[lin + ".weight_scale"].dtype == torch.float8_e4m3fn, lin
            assert (t[lin + ".weight_scale_2"] > 0).all(), lin
        else:
            assert t[lin + ".weight_scale"].dtype == torch.float32, lin
            assert (t[lin + ".weight_scale"] > 0).all(), lin
        if quantization not in ("int4_awq", "w4a16_nvfp4"):
            assert (t[lin + ".input_scale"] > 0).all(), lin
        if quantization == "w4a16_nvfp4":  # weight-only: no activation scale for vLLM to misread
            assert lin + ".input_scale" not in t, lin
    if kv_algo:
        for i in range(layers):
            assert (t[f"model.layers.{i}.self_attn.k_proj.k_scale"] > 0).all()
            assert (t[f"model.layers.{i}.self_attn.v_proj.v_scale"] > 0).all()
    if quantization == "fp8":  # no smoothing to fold: each weight dequantizes on its own
        for lin in linears:
            want = source[lin + ".weight"].float()
            got = t[lin + ".weight"].float() * t[lin + ".weight_scale"].float()
            assert ((got - want).norm() / want.norm()).item() <= MAX_REL_ERROR["fp8"], lin


@needs_modelopt
@pytest.mark.slow
@pytest.mark.parametrize("quantization", QUANTS)
def test_unified_hf_checkpoint_counts_the_models_parameters(build, quantization: str) -> None:
    """As a source (``gguf`` repacks a ModelOpt NVFP4 export; ``eval``'s bits per weight divide by it) the export
    counts the reference model's parameters: its 4-bit weights unpacked from two a byte, none of the weight, input
    and KV-cache scales or AWQ's pre_quant_scale that ModelOpt adds (:func:`quantkit.source.quantization_tensor`)."""
    assert vet(build(quantization, 1) / "hf").num_parameters == 10_490_112


# ------------------------------------------------------------------------------------------------------------
# The command line


@needs_modelopt
@pytest.mark.slow
def test_cli_build_trt_checkpoint_only_json(build: Builds) -> None:
    art, proc = build.cli()
    (res,) = json.loads(proc.stdout)
    assert res["path"] == str(art) and res["kind"] == "tensorrt-llm"
    assert res["quantization"]["quant_algo"] == "FP8" and res["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert res["calibration"]["samples"] == CALIBRATION["samples"]
    assert res["quantization"]["engine"]["status"] == "skipped"
    assert "--checkpoint-only stops after step 1" in res["notes"][0]
    assert {"load_model", "calibrate", "export_trtllm", "export_hf"} <= set(res["timings"])
    for line in ("Writing the TensorRT-LLM checkpoint (tp=1, pp=1)", "Writing the unified Hugging Face checkpoint"):
        assert line in proc.stderr  # progress goes to stderr under --json
    assert (art / "hf" / "hf_quant_config.json").is_file()
    assert (art / "trtllm-ckpt" / "rank0.safetensors").is_file()
    assert not (art / "engine").exists()
    assert integrity.verify(art).ok


def test_cli_refuses_a_tp_the_model_cannot_shard(cli, tmp_path: Path) -> None:
    proc = cli("build-trt", _recipe(tmp_path, quantization="int4_awq", tp=4), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "tp=4" in proc.stderr and "int4_awq group size 128" in proc.stderr
    assert not (tmp_path / "art").exists()


def test_cli_names_a_python_without_modelopt(cli, tmp_path: Path) -> None:
    missing = cli("build-trt", _recipe(tmp_path), "--python", str(tmp_path / "nope" / "python"), cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr, missing.stderr
    if importlib.util.find_spec("modelopt") is None:
        bare = cli("build-trt", _recipe(tmp_path), "--python", sys.executable, cwd=tmp_path)
        assert bare.returncode == 1, bare.stderr
        assert "lacks nvidia-modelopt" in bare.stderr and "hint:" in bare.stderr
    assert not (tmp_path / "art").exists()


def test_cli_refuses_a_recipe_without_trt_output(cli, tmp_path: Path) -> None:
    path = tmp_path / "gguf.yaml"
    path.write_text(json.dumps({"model": {"source": str(TINY)}, "output": "art", "quantize": {"method": "gguf"}}))
    proc = cli("build-trt", path, cwd=tmp_path)
    assert proc.returncode == 2 and "no TensorRT-LLM output" in proc.stderr, proc.stderr


@pytest.mark.unit
def test_engine_step_says_what_is_missing_and_what_was_produced() -> None:
    """Step 2's decision, for the environments it can meet (described as data: nothing is imported or run)."""
    from quantkit.producers.trt import engine
    from quantkit.formats.specs import TrtLimits

    limits = TrtLimits(max_batch_size=4, max_input_len=512, max_seq_len=1024, max_num_tokens=2048,
                       paged_kv_cache=False, gemm_plugin=None)
    bare = pyenv.TrtEnvironment(python="/envs/modelopt/bin/python", origin="test", versions={})
    step = engine.status(bare, False, limits, 2)
    assert step.status == "unavailable"
    assert "tensorrt_llm is not installed in /envs/modelopt/bin/python" in step.note
    assert ("`trtllm-build --checkpoint_dir trtllm-ckpt --output_dir engine --max_batch_size 4 --max_input_len 512 "
            "--max_seq_len 1024 --max_num_tokens 2048 --kv_cache_type continuous --gemm_plugin disable "
            "--workers 2`") in step.note
    assert "hf/" in step.note and "quantization=modelopt" in step.note

    no_builder = pyenv.TrtEnvironment(python="/envs/trtllm/bin/python", origin="test",
                                      versions={"tensorrt_llm": "1.3.0"}, tensorrt_llm=True, engine_builder=False)
    step = engine.status(no_builder, False, limits, 1)
    assert step.status == "unavailable" and "tensorrt_llm 1.3.0" in step.note and "no engine builder" in step.note

    builder = pyenv.TrtEnvironment(python="/envs/trtllm/bin/python", origin="test",
                                   versions={"tensorrt_llm": "1.2.0"}, tensorrt_llm=True, engine_builder=True)
    assert engine.status(builder, False, limits, 1) is None
    assert engine.status(builder, True, limits, 1).status == "skipped"
