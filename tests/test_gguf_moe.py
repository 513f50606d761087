"""GGUF conversion of mixture-of-experts checkpoints, checked through llama.cpp itself.

A small random checkpoint of each family (``tests/moe_models.py``), in both expert layouts, converts to F16, and
from the hub layout also to F32 and Q4_K_M. llama.cpp's logits over 2,048 tokens of held-out text are compared with
transformers': the F32 file must match to float noise with the same top-1 everywhere, which shows every tensor,
key and routing rule is right; the F16 file must keep top-1 agreement >= 0.99 (llama.cpp rounds activations
to F16 for F16 weights, which now and then flips a router's choice). The two layouts of one checkpoint must give
byte-identical tensors. One artifact is served by a real llama.cpp server through ``quantkit smoke``, and what
llama.cpp cannot reproduce is refused up front with exit code 2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from moe_models import FAMILIES, make_moe
from quantkit.errors import SourceModelError
from quantkit.producers.gguf import convert as gguf_convert
from test_gguf import TINY, convert, heldout, hf_logits, llama_logits, tensor_types, top1  # noqa: F401

pytestmark = pytest.mark.e2e

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

N_TOKENS = 2048
LAYOUTS = ("split", "fused")
GGUF_ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama", "deepseek3": "deepseek2"}  # what llama.cpp runs each as
# llama.cpp's converter reads transformers 5's fused 3-D experts (save_original_format=False) for Qwen3-MoE only;
# Mixtral and DeepSeek-V3 in that layout are refused in one line (the hub's per-expert layout converts)
FUSED_CONVERTS = ("qwen3moe",)
FUSED_REFUSAL = {"mixtral": "Can not map tensor 'model.layers.0.mlp.experts.gate_up_proj'",
                 "deepseek3": "Unprocessed experts"}


@pytest.fixture(scope="module")
def ids(heldout: list[str]) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    out = tok(heldout[3])["input_ids"][:N_TOKENS]
    assert len(out) == N_TOKENS
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Both layouts of one random checkpoint per family (the same seed, so the same weights)."""
    root = tmp_path_factory.mktemp("moe")
    return {(f, layout): make_moe(f, root / f"{f}-{layout}", fused=layout == "fused")
            for f in FAMILIES for layout in LAYOUTS}


@pytest.fixture(scope="module")
def reference(checkpoints: dict, ids: list[int]) -> dict[str, np.ndarray]:
    """transformers' logits per family, from the hub layout (the fused one is checked to load the same)."""
    return {f: hf_logits(checkpoints[f, "split"], ids) for f in FAMILIES}


@pytest.fixture(scope="module")
def converted(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe-gguf")
    results = {}
    for (family, layout), model_dir in checkpoints.items():
        if layout == "fused" and family not in FUSED_CONVERTS:
            continue
        types = ["F16", "F32", "Q4_K_M"] if layout == "split" else ["F16"]
        res = convert(model_dir, out / f"{family}-{layout}", types)
        results[family, layout] = {t: res.path / f for t, f in res.manifest.quantization["files"].items()}
        results[family, layout]["manifest"] = res.manifest
    return results


def test_fused_layout_really_is_fused(checkpoints: dict) -> None:
    from safetensors import safe_open

    for family in FAMILIES:
        keys = {}
        for layout in LAYOUTS:
            with safe_open(str(checkpoints[family, layout] / "model.safetensors"), framework="pt") as h:
                keys[layout] = set(h.keys())
        assert any(k.endswith("experts.gate_up_proj") for k in keys["fused"])
        assert not any(".experts.0." in k for k in keys["fused"])
        assert any(".experts.7." in k for k in keys["split"]) and not any("gate_up" in k for k in keys["split"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_matches_transformers(family: str, layout: str, converted: dict, reference: dict, ids: list[int],
                                  checkpoints: dict, tmp_path: Path) -> None:
    if layout == "fused" and family not in FUSED_CONVERTS:
        arch = json.loads((checkpoints[family, layout] / "config.json").read_text())["architectures"][0]
        with pytest.raises(SourceModelError, match=f"cannot convert {arch}: ValueError: {FUSED_REFUSAL[family]}"):
            convert(checkpoints[family, layout], tmp_path / "out", ["F16"])
        assert not (tmp_path / "out").exists()
        return
    files, ref = converted[family, layout], reference[family]
    q = files["manifest"].quantization
    config = json.loads((checkpoints[family, layout] / "config.json").read_text())
    assert q["source_architecture"] == config["architectures"][0] and q["architecture"] == GGUF_ARCH[family]
    if layout == "fused":
        assert np.allclose(hf_logits(checkpoints[family, layout], ids[:64]), ref[:64], atol=1e-4)

    if "F32" in files:  # the fused layout's tensors are checked to be identical to these
        f32 = llama_logits(files["F32"], ids)
        assert top1(ref, f32) == 1.0
        assert np.abs(ref - f32).max() < 0.01, "F32 logits differ from transformers"

    f16 = llama_logits(files["F16"], ids)
    assert top1(ref, f16) >= 0.99
    assert np.median(np.abs(ref - f16).max(-1)) < 0.03


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def test_deepseek_yarn_matches_transformers(tmp_path: Path, ids: list[int]) -> None:
    """DeepSeek-V3's long-context rope (YaRN, attention logits scaled by mscale_all_dim), past the original
    context: llama.cpp's deepseek2 graph reads it from the file's rope keys."""
    model_dir = make_moe("deepseek3", tmp_path / "yarn", rope_parameters=YARN)
    res = convert(model_dir, tmp_path / "out", ["F32"])
    ref = hf_logits(model_dir, ids)
    f32 = llama_logits(res.path / res.manifest.quantization["files"]["F32"], ids)
    assert top1(ref, f32) >= 0.999 and np.median(np.abs(ref - f32).max(-1)) < 1e-3


def test_qwen_yarn_matches_transformers(tmp_path: Path, ids: list[int]) -> None:
    """Qwen3-MoE with YaRN, which quantkit's own converter refused: llama.cpp's converter gets it right."""
    model_dir = make_moe("qwen3moe", tmp_path / "qwen-yarn", layers=2, experts=4,
                         rope_parameters={**YARN, "mscale": None, "mscale_all_dim": None})
    res = convert(model_dir, tmp_path / "out", ["F32"])
    ref = hf_logits(model_dir, ids[:512])
    f32 = llama_logits(res.path / res.manifest.quantization["files"]["F32"], ids[:512])
    assert top1(ref, f32) == 1.0 and np.abs(ref - f32).max() < 0.01


@pytest.mark.parametrize("family", FUSED_CONVERTS)
def test_layouts_give_identical_tensors(family: str, converted: dict) -> None:
    split = gguf.GGUFReader(converted[family, "split"]["F16"])
    fused = gguf.GGUFReader(converted[family, "fused"]["F16"])
    assert [t.name for t in split.tensors] == [t.name for t in fused.tensors]
    for a, b in zip(split.tensors, fused.tensors):
        assert np.array_equal(a.data, b.data), a.name


# The experts' and routers' GGUF tensors and keys llama.cpp's graph for each architecture reads.
EXPECTED = {
    "qwen3moe": ({"blk.1.ffn_gate_exps.weight": [8, 256, 256], "blk.1.ffn_down_exps.weight": [8, 256, 256],
                  "blk.1.ffn_gate_inp.weight": [8, 256], "blk.0.attn_q_norm.weight": [64]},
                 {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256}),
    "mixtral": ({"blk.1.ffn_up_exps.weight": [8, 256, 256], "blk.0.ffn_gate_inp.weight": [8, 256]},
                {"expert_count": 8, "expert_used_count": 2, "feed_forward_length": 256}),
    "deepseek3": ({"blk.0.ffn_gate.weight": [512, 256], "blk.1.ffn_gate_exps.weight": [8, 256, 256],
                   "blk.1.ffn_up_shexp.weight": [256, 256], "blk.1.exp_probs_b.bias": [8],
                   "blk.1.attn_kv_a_mqa.weight": [256 + 64, 256], "blk.1.attn_q_b.weight": [4 * 128, 256],
                   "blk.1.attn_k_b.weight": [4, 256, 64], "blk.1.attn_v_b.weight": [4, 64, 256]},
                  {"expert_count": 8, "expert_shared_count": 1, "expert_weights_scale": 2.5,
                   "expert_weights_norm": True, "expert_gating_func": 2, "expert_group_count": 4,
                   "expert_group_used_count": 2, "leading_dense_block_count": 1, "attention.q_lora_rank": 256,
                   "attention.kv_lora_rank": 256, "attention.key_length": 256 + 64, "attention.value_length": 256,
                   "attention.key_length_mla": 128, "attention.value_length_mla": 64, "attention.head_count_kv": 1,
                   "rope.dimension_count": 64}),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_tensors_and_keys(family: str, converted: dict) -> None:
    reader = gguf.GGUFReader(converted[family, "split"]["F16"])
    arch = reader.fields["general.architecture"].contents()
    shapes = {t.name: list(reversed([int(d) for d in t.shape])) for t in reader.tensors}
    want_shapes, want_keys = EXPECTED[family]
    for name, shape in want_shapes.items():
        assert shapes.get(name) == shape, name
    for key, value in want_keys.items():
        assert reader.fields[f"{arch}.{key}"].contents() == pytest.approx(value), key
    assert not any(".experts." in n or "kv_b" in n for n in shapes)
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.1.ffn_gate_inp.weight"] == "F32"


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_k_quant_loads(family: str, converted: dict, reference: dict, ids: list[int]) -> None:
    files = converted[family, "split"]
    types = tensor_types(files["Q4_K_M"])
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.ffn_gate_inp.weight"] == "F32"
    assert {"Q4_K", "Q6_K"} <= set(types.values())
    fell = files["manifest"].quantization["fallbacks"].get("Q4_K_M", {})
    # only MLA's per-head k_b (64-value rows) cannot hold 256-value K-quant blocks
    assert set(fell) == ({"blk.0.attn_k_b.weight", "blk.1.attn_k_b.weight"} if family == "deepseek3" else set())
    q4 = llama_logits(files["Q4_K_M"], ids[:256])
    assert np.isfinite(q4).all()
    # 4-bit random weights are noisy (correlation 0.72-0.84 here); an unrelated model's logits give about 0.04
    assert np.corrcoef(reference[family][:256].ravel(), q4.ravel())[0, 1] > 0.5


def test_moe_served_by_llamacpp(checkpoints: dict, tmp_path: Path, cli: Callable) -> None:
    out = tmp_path / "qwen3moe-gguf"
    cli("gguf", checkpoints["qwen3moe", "fused"], out, "-t", "Q4_K_M", check=True)
    proc = cli("smoke", out, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    run = res["runs"][0]
    assert res["ok"] and res["engine"] == "llama.cpp" and run["status"] == "passed"
    assert run["completion"]["text"].strip() and run["chat"]["text"].strip()
    assert run["decode_tokens_per_s"] > 0 and run["stopped"]


# ------------------------------------------------------------------------------------------------------------
# the converter's plan and gguf-py's Hugging Face -> GGUF name map (what importance matrices are named by)


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_is_the_written_file(family: str, checkpoints: dict, converted: dict) -> None:
    """The plan (made without writing) lists exactly the tensors, shapes and F16/F32 types of the written file."""
    for layout in LAYOUTS if family in FUSED_CONVERTS else ("split",):
        plan = gguf_convert.plan(checkpoints[family, layout])
        written = {t.name: (tuple(reversed([int(d) for d in t.shape])), t.tensor_type.name)
                   for t in gguf.GGUFReader(converted[family, layout]["F16"]).tensors}
        assert {t.name: (t.shape, t.type) for t in plan.tensors} == written
        assert plan.gguf_arch == GGUF_ARCH[family]


def test_hf_module_names_map_to_gguf_names(checkpoints: dict) -> None:
    plan = gguf_convert.plan(checkpoints["qwen3moe", "split"])
    assert plan.gguf_name("model.layers.0.self_attn.q_proj") == "blk.0.attn_q.weight"
    assert plan.gguf_name("model.layers.1.mlp.experts.up_proj") == "blk.1.ffn_up_exps.weight"
    assert plan.gguf_name("model.layers.0.mlp.gate") == "blk.0.ffn_gate_inp.weight"
    assert plan.gguf_name("model.layers.0.mlp.not_a_module") is None
    plan = gguf_convert.plan(checkpoints["deepseek3", "split"])
    assert plan.gguf_name("model.layers.1.mlp.experts.down_proj") == "blk.1.ffn_down_exps.weight"
    assert plan.gguf_name("model.layers.1.mlp.shared_experts.up_proj") == "blk.1.ffn_up_shexp.weight"


# ------------------------------------------------------------------------------------------------------------
# refusals: what llama.cpp would compute differently, before any work


# quantkit.producers.gguf.guards refuses what llama.cpp's converter would convert wrong (the architecture table's
# quirks, each measured there); the converter itself refuses what it cannot map, naming the architecture.
REFUSED = {
    "no-renormalisation": ("qwen3moe", {"norm_topk_prob": False}, "norm_topk_prob is false"),
    "dense-layers": ("qwen3moe", {"mlp_only_layers": [0]},
                     "cannot convert Qwen3MoeForCausalLM: ValueError: Can not map tensor "
                     "'model.layers.0.mlp.down_proj"),
    "rotate-half-mla": ("deepseek3", {"rope_interleave": False}, "rope_interleave is false"),
    "mla-biases": ("deepseek3", {"attention_bias": True}, "attention_bias is true"),
    "yarn-mscale": ("deepseek3", {"rope_parameters": {**YARN, "mscale": 1.0}}, "cannot reproduce rope parameters"),
    "no-scoring-func": ("deepseek3", {"scoring_func": None}, "config.json has no scoring_func"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_before_any_work(case: str, tmp_path: Path) -> None:
    family, overrides, message = REFUSED[case]
    model_dir = make_moe(family, tmp_path / case, layers=2, experts=4, **overrides)
    with pytest.raises(SourceModelError, match=message) as e:
        convert(model_dir, tmp_path / "out", ["Q4_K_M"])
    assert e.value.exit_code == 2 and e.value.hint
    assert not (tmp_path / "out").exists()


def test_multi_token_prediction_layers_are_left_out(tmp_path: Path) -> None:
    """DeepSeek-V3 checkpoints carry an MTP module as one layer past num_hidden_layers; logits never use it."""
    from safetensors.torch import load_file, save_file

    model_dir = make_moe("deepseek3", tmp_path / "mtp", layers=2, experts=4)
    weights = load_file(model_dir / "model.safetensors")
    extra = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in weights.items()
             if k.startswith("model.layers.1.")}
    extra["model.layers.2.eh_proj.weight"] = weights["model.layers.1.self_attn.o_proj.weight"].clone()
    save_file({**weights, **extra}, model_dir / "model.safetensors", metadata={"format": "pt"})
    res = convert(model_dir, tmp_path / "out", ["F16"])
    names = {t.name for t in gguf.GGUFReader(res.path / res.manifest.quantization["files"]["F16"]).tensors}
    # llama.cpp's converter leaves them out of the deepseek2 file (its --mtp exports them on their own)
    assert "blk.1.ffn_down_exps.weight" in names and not any(n.startswith("blk.2.") for n in names)


def test_refusal_through_the_cli(tmp_path: Path, cli: Callable) -> None:
    model_dir = make_moe("qwen3moe", tmp_path / "m", layers=2, experts=4, norm_topk_prob=False)
    proc = cli("gguf", model_dir, tmp_path / "out", "-t", "Q4_K_M")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and "always renormalises" in lines[0] and "hint:" in lines[1], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
