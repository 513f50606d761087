"""Defaults on the widths real checkpoints have, not only the reference model's powers of two.

SmolLM2-135M (hidden_size 576, intermediate_size 1536, 9 heads of 64, 3 key-value heads) is the case: 576 is not a
multiple of 128, so a W4A16 default of group 128 cannot be made, and quantkit picks the largest group size vLLM's
kernels take that divides every input width (64), says so in one line and records it; a group size the user gives
is used as given or refused. A random model of that shape (two layers, the reference tokenizer) runs through the
real CLI on the CPU; the other widths are sparse checkpoints (real headers, no bytes) planned with ``--dry-run``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import TINY, quantkit, sparse_checkpoint
from quantkit import artifact

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


def _layers(config: dict, n: int = 1) -> dict[str, list[int]]:
    """The tensors of ``n`` Llama decoder layers of ``config``'s widths (for a sparse checkpoint)."""
    h, i, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads"))
    d = config.get("head_dim") or h // heads
    out: dict[str, list[int]] = {"model.embed_tokens.weight": [config["vocab_size"], h], "model.norm.weight": [h]}
    for n_ in range(n):
        p = f"model.layers.{n_}."
        out |= {p + "self_attn.q_proj.weight": [heads * d, h], p + "self_attn.k_proj.weight": [kv * d, h],
                p + "self_attn.v_proj.weight": [kv * d, h], p + "self_attn.o_proj.weight": [h, heads * d],
                p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
                p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
    return out


def _plan(model: Path, *args: str) -> dict:
    proc = quantkit(*args[:1], model, "out-never-written", *args[1:], "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["outputs"][0]


def test_default_group_size_on_576_is_64_said_once_and_recorded(smollm2_shape: Path, tmp_path: Path) -> None:
    out = tmp_path / "rtn"
    proc = quantkit("rtn", smollm2_shape, out, check=True)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "group size" in line]
    assert len(said) == 1 and "warning:" in said[0] and REASON in said[0], said
    q = artifact.read_manifest(out).quantization
    assert (q["group_size"], q["group_size_requested"]) == (64, None) and q["group_size_reason"].startswith(REASON)
    assert q["weights"] == "int4 group 64 symmetric"
    assert any(n.startswith(REASON) for n in artifact.read_manifest(out).notes)
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
    for verb in ("awq", "gptq", "rtn"):
        assert [n[:len(REASON)] for n in _plan(smollm2_shape, verb)["notes"]] == [REASON]
    assert _plan(smollm2_shape, "gptq", "--group-size", "32")["notes"] == []
    assert _plan(smollm2_shape, "awq", "--format", "autoawq")["notes"][0].startswith(REASON)


@pytest.mark.parametrize(("hidden", "heads", "chosen"), [(2880, 45, 64), (2080, 65, 32), (1000, 10, -1)])
def test_other_widths_pick_the_largest_kernel_group_that_divides(tmp_path: Path, hidden: int, heads: int,
                                                                 chosen: int) -> None:
    config = {**SMOLLM2, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
              "head_dim": hidden // heads, "intermediate_size": 4 * hidden, "num_hidden_layers": 1}
    model = sparse_checkpoint(tmp_path / f"h{hidden}", config, _layers(config))
    note = _plan(model, "rtn")["notes"][0]
    assert f"does not divide hidden_size = {hidden}" in note
    assert (f"using {chosen}," in note) if chosen > 0 else "using -1 (one scale per output channel)" in note
