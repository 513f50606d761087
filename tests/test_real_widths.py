"""Defaults on the widths real checkpoints have, not only the reference model's powers of two.

SmolLM2-135M (hidden_size 576, intermediate_size 1536, 9 heads of 64, 3 key-value heads) is the case: 576 is not a
multiple of 128. W4A16's default group 128 cannot be made there, so quantkit picks the largest group size vLLM's
kernels take that divides every input width (64), says so in one line and records it; a group size the user gives
is used as given or refused. The schemes whose tiles are fixed at 128 (FP8 block, W4A8) are refused in one line
before anything loads; a tensor-parallel split is checked on heads, groups and blocks. A random model of that shape
(two layers, the reference tokenizer) runs through the real CLI on the CPU; other widths are sparse checkpoints
(real headers, no bytes) planned with ``--dry-run``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import TINY, quantkit, sparse_checkpoint
from quantkit.engines import parallel
from quantkit.manifest import read_manifest

pytestmark = pytest.mark.e2e

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "num_hidden_layers": 2, "vocab_size": 8192, "tie_word_embeddings": True, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
REASON = "the default group size 128 does not divide hidden_size = 576, num_attention_heads x head_dim (o_proj " \
         "input) = 576; using 64"


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random bf16 Llama of SmolLM2-135M's widths, two layers, saved by transformers with the reference
    tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("smollm2-shape")
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in SMOLLM2.items() if k != "architectures"}, dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def rtn_default(smollm2_shape: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``quantkit rtn MODEL OUT`` with no flags on the SmolLM2 shape: the artifact and what the run printed."""
    out = tmp_path_factory.mktemp("arts") / "rtn"
    proc = quantkit("rtn", smollm2_shape, out, check=True)
    return out, proc.stdout + proc.stderr


def _layers(config: dict) -> dict[str, list[int]]:
    """The tensors of one Llama decoder layer of ``config``'s widths, with the embeddings (for a sparse
    checkpoint)."""
    h, i, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads"))
    d, p = config.get("head_dim") or h // heads, "model.layers.0."
    return {"model.embed_tokens.weight": [config["vocab_size"], h], "model.norm.weight": [h],
            p + "self_attn.q_proj.weight": [heads * d, h], p + "self_attn.k_proj.weight": [kv * d, h],
            p + "self_attn.v_proj.weight": [kv * d, h], p + "self_attn.o_proj.weight": [h, heads * d],
            p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}


def _plan(model: Path, method: str, **fields: object) -> dict:
    """``--dry-run``'s plan of one output, in this process (the CLI prints this same object)."""
    from dataclasses import asdict

    from quantkit import api

    r = api.load_recipe(None, {"model.source": str(model), "output": "out-never-written",
                               **{f"quantize.{k}": v for k, v in fields.items()}}, base={"quantize": {"method": method}})
    return asdict(api.plan(r).outputs[0])


def test_default_group_size_on_576_is_64_said_once_and_recorded(rtn_default: tuple[Path, str]) -> None:
    out, printed = rtn_default
    said = [line for line in printed.splitlines() if "group size" in line]
    assert len(said) == 1 and "warning:" in said[0] and REASON in said[0], said
    m = read_manifest(out)
    q = m.quantization
    assert (q["group_size"], q["group_size_requested"]) == (64, None) and q["group_size_reason"].startswith(REASON)
    assert q["weights"] == "int4 group 64 symmetric" and any(n.startswith(REASON) for n in m.notes)
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (weights["weights"]["strategy"], weights["weights"]["group_size"]) == ("group", 64)


@pytest.mark.parametrize("where", ["flag", "recipe"])
def test_an_explicit_group_size_that_does_not_divide_is_refused(smollm2_shape: Path, tmp_path: Path,
                                                                where: str) -> None:
    out = tmp_path / "gptq"
    if where == "flag":
        proc = quantkit("gptq", smollm2_shape, out, "--group-size", "128")
    else:
        recipe = tmp_path / "gptq.yaml"
        recipe.write_text(f"model: {{source: {smollm2_shape}}}\noutput: {out}\n"
                          "quantize: {method: gptq, group_size: 128}\n")
        proc = quantkit("gptq", "--recipe", recipe, "-o", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--group-size 128 does not divide the layers' input width (hidden_size = 576" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_dry_run_shows_the_choice_and_a_given_size_is_kept(smollm2_shape: Path) -> None:
    proc = quantkit("gptq", smollm2_shape, "out-never-written", "--dry-run")
    assert proc.returncode == 0 and "note: out-never-written: " + REASON in " ".join(proc.stdout.split())
    for method in ("awq", "rtn"):
        assert [n[:len(REASON)] for n in _plan(smollm2_shape, method)["notes"]] == [REASON]
    assert _plan(smollm2_shape, "awq", format="autoawq")["notes"][0].startswith(REASON)
    assert _plan(smollm2_shape, "gptq", group_size=32)["notes"] == []


@pytest.mark.parametrize(("hidden", "heads", "chosen"), [(2880, 45, 64), (2080, 65, 32), (1000, 10, -1)])
def test_other_widths_pick_the_largest_kernel_group_that_divides(tmp_path: Path, hidden: int, heads: int,
                                                                 chosen: int) -> None:
    config = {**SMOLLM2, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
              "head_dim": hidden // heads, "intermediate_size": 4 * hidden, "num_hidden_layers": 1}
    model = sparse_checkpoint(tmp_path / f"h{hidden}", config, _layers(config))
    note = _plan(model, "rtn")["notes"][0]
    assert f"does not divide hidden_size = {hidden}" in note
    assert (f"using {chosen}," in note) if chosen > 0 else "using -1 (one scale per output channel)" in note


def test_awq_on_576_records_the_mapping_llm_compressor_skips(smollm2_shape: Path, tmp_path: Path) -> None:
    """AWQ scales by groups of its quantization scheme (64 here); with 3 key-value heads for 9 heads, v_proj's 192
    outputs are not o_proj's 576 inputs, so llm-compressor applies that mapping in no layer: the manifest says so."""
    out = tmp_path / "awq"
    quantkit("awq", smollm2_shape, out, "--samples", "4", "--seq-len", "64", check=True)
    m = read_manifest(out)
    used = {mp["smooth_layer"]: mp["applied_to"] for mp in m.quantization["awq_mappings"]}
    assert used == {"re:.*input_layernorm$": 2, "re:.*v_proj$": 0, "re:.*post_attention_layernorm$": 2,
                    "re:.*up_proj$": 2}
    assert any("applied in no layer (re:.*v_proj$ -> re:.*o_proj$)" in n for n in m.notes)
    assert m.quantization["group_size"] == 64


def test_schemes_with_tiles_fixed_at_128_are_refused_on_576(smollm2_shape: Path) -> None:
    refusals = {("fp8", "--scheme", "block"): "--scheme block quantizes in 128x128 weight blocks",
                ("w4a8",): "w4a8 quantizes in groups of 128"}
    for args, words in refusals.items():
        proc = quantkit(*args[:1], smollm2_shape, "out-never-written", *args[1:], "--dry-run")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert words in proc.stderr and "hidden_size = 576" in proc.stderr and "Traceback" not in proc.stderr
    for method, fields in (("fp8", {}), ("fp8", {"scheme": "dynamic", "kv_cache_fp8": True}), ("int8", {})):
        assert _plan(smollm2_shape, method, **fields)["action"] == "build"


def test_tp_splits_on_9_heads_and_3_kv_heads(rtn_default: tuple[Path, str], tmp_path: Path) -> None:
    """W4A16 group 64 on SmolLM2's shape splits over 3 GPUs (3 heads of 64 = 192 o_proj inputs, 512 down_proj
    inputs per GPU), never over 2; 128x128 FP8 blocks would not split over 3 (192 is not whole blocks)."""
    out, _ = rtn_default
    assert "9 attention heads are not divisible by 2" in "; ".join(parallel.problems(out, 2))
    assert parallel.problems(out, 3) == [] and parallel.largest_tp(out) == 3
    blocks = tmp_path / "fp8-block"
    blocks.mkdir()
    (blocks / "config.json").write_text(json.dumps({**SMOLLM2, "quantization_config": {"config_groups": {
        "group_0": {"weights": {"strategy": "block", "block_structure": [128, 128]}}}}}))
    assert any("= 192 (o_proj input per GPU) is not a multiple of the weight block 128" in p
               for p in parallel.problems(blocks, 3))
    proc = quantkit("smoke", out, "--engine", "vllm", "--tp", "2", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    if "GPU(s) visible" in proc.stderr:
        pytest.skip("this machine shows fewer than 2 GPUs to nvidia-smi; the shape check comes after that one")
    assert proc.returncode == 2 and "largest tensor-parallel size it allows is 3" in proc.stderr


def test_gptq_bits_target_defaults_to_group_32_with_zero_points(smollm2_shape: Path) -> None:
    """`gptq --target-bits B` with neither a group size nor a symmetry given mixes int4 in groups of 32 with zero
    points (the lowest KLD measured at equal bits) from 5.5 bits up, and says so; a given symmetry or group size, a
    lower target (at 5.0 bits the two layouts were level) and the other methods keep the plain default."""
    bits_target = "a bits target: int4 in groups of 32 with zero points"

    def notes(method: str, **fields: object) -> list[str]:
        """The plan's notes but the mix's own line (a bits target's plan: its two precisions), said for every mix."""
        return [n for n in _plan(smollm2_shape, method, **fields)["notes"] if not n.startswith("bits target ")]

    found = notes("gptq", target_bits=5.5)
    assert len(found) == 1 and found[0].startswith(bits_target), found
    for method, fields in (("gptq", {"target_bits": 5.5, "symmetric": True}), ("gptq", {"target_bits": 5.4}),
                           ("gptq", {}), ("awq", {"target_bits": 5.5}), ("rtn", {"target_bits": 5.5})):
        assert [n[:len(REASON)] for n in notes(method, **fields)] == [REASON], (method, fields)
    assert notes("gptq", target_bits=5.5, group_size=64) == []
    assert "int4 group 64 symmetric or int8" in _plan(smollm2_shape, "gptq", target_bits=5.5, group_size=64)["notes"][0]
