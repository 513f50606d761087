"""``inspect`` (and ``doctor`` and ``eval``'s format column, which read the same description) on what quantkit
writes: a checkpoint of several compressed-tensors config groups is described group by group, the bits per weight
are the quantized layers' (the whole-model figure is named for what it is), and the legacy GPTQ layout folder inside
a ``--format gptq`` artifact has a real scheme and is checked against the artifact's manifest."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import TINY, quantkit

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]

# The reference model's projections: 8 layers of q, k, v, o (256x256, 128x256, 128x256, 256x256) and 3 MLP
# matrices of 256x768.
LAYER_WEIGHTS = 2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 768


def _projections(layers: str) -> list[str]:
    return [rf"re:^model\.layers\.{layers}\.(self_attn|mlp)\.\w+_proj$"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compressed-tensors checkpoint of three config groups, made with llm-compressor (round-to-nearest, no
    calibration): W8A16 first (layer 0, the group inspect described the whole model by), NVFP4A16 (layer 1) and
    W4A16_ASYM in groups of 32 (layers 2 to 7, most of the weights)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("inspection") / "mixed"
    int4 = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    groups = {"group_0": preset_name_to_scheme("W8A16", _projections("0")),
              "group_1": preset_name_to_scheme("NVFP4A16", _projections("1")),
              "group_2": QuantizationScheme(targets=_projections("[2-7]"), weights=int4)}
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16)
    oneshot(model=model, recipe=[QuantizationModifier(config_groups=groups, ignore=["lm_head"])])
    model.save_pretrained(out, save_compressed=True)
    assert list(json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]) == \
        ["group_0", "group_1", "group_2"]
    return out


def _stored_bits(folder: Path) -> float:
    """The layers' bits per weight counted here independently: the bytes of every decoder projection's ``weight*``
    tensor (packed values, scales, zero points, global scales; not the ``weight_shape`` record) over its weights."""
    from safetensors import safe_open

    stored = 0
    with safe_open(folder / "model.safetensors", "pt") as f:
        for name in f.keys():
            if re.search(r"_proj\.weight(?!_shape)", name) and name.startswith("model.layers."):
                t = f.get_tensor(name)
                stored += t.numel() * t.element_size()
    return stored * 8 / (8 * LAYER_WEIGHTS)


def test_inspect_describes_every_config_group_of_a_mixed_checkpoint(mixed: Path) -> None:
    """inspect read only the first config group: a model three quarters int4 showed as "W8A16, bits 8", and the
    NVFP4 layers were not mentioned. Now the scheme names every group (lowest bits first), each group has its
    scheme, bits, group size, symmetry and the layers and weights it covers, counted from the files."""
    shown = json.loads(quantkit("inspect", mixed, "--json", check=True).stdout)
    assert (shown["scheme"], shown["bits"], shown["ct_format"]) == ("NVFP4A16+W4A16_ASYM+W8A16", "4+4+8",
                                                                    "mixed-precision")
    groups = [{k: g[k] for k in ("scheme", "bits", "type", "group_size", "symmetric", "layers", "weights")}
              for g in shown["groups"]]
    assert groups == [
        {"scheme": "NVFP4A16", "bits": 4, "type": "float", "group_size": 16, "symmetric": True, "layers": 7,
         "weights": LAYER_WEIGHTS},
        {"scheme": "W4A16_ASYM", "bits": 4, "type": "int", "group_size": 32, "symmetric": False, "layers": 42,
         "weights": 6 * LAYER_WEIGHTS},
        {"scheme": "W8A16", "bits": 8, "type": "int", "group_size": 128, "symmetric": True, "layers": 7,
         "weights": LAYER_WEIGHTS}]
    assert [g["share"] for g in shown["groups"]] == [0.125, 0.75, 0.125]
    assert shown["bits_per_weight"] == pytest.approx(_stored_bits(mixed), abs=1e-4)
    table = quantkit("inspect", mixed, check=True).stdout
    assert "NVFP4A16+W4A16_ASYM+W8A16" in table and "4+4+8" in table


def test_doctor_and_eval_name_the_whole_mix(mixed: Path) -> None:
    """doctor said "compressed-tensors, W8A16" and eval's format column "compressed-tensors W8A16" of the same
    checkpoint: both read inspect's description, which now names every group."""
    from quantkit.engines.doctor import describe_artifact
    from quantkit.evaluation.evaluate import expand_targets

    assert describe_artifact(mixed)["scheme"] == "NVFP4A16+W4A16_ASYM+W8A16"
    assert [t.format for t in expand_targets([mixed], "transformers")] == \
        ["compressed-tensors NVFP4A16+W4A16_ASYM+W8A16"]


def test_inspect_bits_per_weight_are_the_quantized_layers(tiny_rtn: Path) -> None:
    """inspect's "bits per weight" was every weight file's bytes over the source's parameters (embeddings and
    lm_head included: 9.7 for int4), where the manifest, docs/formats.md and --target-bits mean the quantized
    layers' bits. Now bits_per_weight is the quantized layers' (int4 in groups of 128 with bf16 scales: 4.125) and
    the whole-model figure is bits_per_parameter."""
    shown = json.loads(quantkit("inspect", tiny_rtn, "--json", check=True).stdout)
    assert shown["bits_per_weight"] == pytest.approx(4 + 16 / 128)
    source_parameters = json.loads((tiny_rtn / "quantkit.json").read_text())["source"]["parameters"]
    assert shown["bits_per_parameter"] == round(8 * shown["size_bytes"] / source_parameters, 2) > 8
    assert shown["scheme"] == json.loads((tiny_rtn / "quantkit.json").read_text())["quantization"]["scheme"]


@pytest.fixture(scope="module")
def gptq_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``--format gptq`` artifact (compressed-tensors, and the legacy GPTQ layout in gptq/), built once: about 7 s.
    Tests that change its files work on a copy."""
    art = tmp_path_factory.mktemp("inspection") / "art"
    quantkit("gptq", TINY, art, "--format", "gptq", "--samples", "8", "--seq-len", "64", "--quiet", check=True)
    return art


def test_inspect_the_legacy_gptq_folder_inside_an_artifact(gptq_artifact: Path, tmp_path: Path) -> None:
    """`inspect ART/gptq` printed "scheme False" (desc_act) and "manifest: none". Now it names the scheme from the
    legacy config (W4A16, group 128, symmetric), finds the artifact's manifest above it and checks the folder's
    files against it: a changed, an added and a removed file are each reported, exit 1."""
    art = Path(shutil.copytree(gptq_artifact, tmp_path / "art"))
    shown = json.loads(quantkit("inspect", art / "gptq", "--json", check=True).stdout)
    assert (shown["format"], shown["scheme"], shown["bits"], shown["group_size"], shown["symmetric"]) == \
        ("gptq", "W4A16", 4, 128, True)
    assert shown["method"] == "gptq" and shown["manifest"]["ok"] and shown["manifest"]["checked"] == 7
    assert 4.125 < shown["bits_per_weight"] < 4.5  # int4, bf16 scales, int4 zero points, act-order indices
    (art / "gptq" / "tokenizer_config.json").write_text("{}")
    (art / "gptq" / "extra.txt").write_text("x")
    (art / "gptq" / "generation_config.json").unlink()
    bad = quantkit("inspect", art / "gptq")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert all(s in bad.stderr for s in ("changed ['gptq/tokenizer_config.json']",
                                         "missing ['gptq/generation_config.json']", "not listed ['gptq/extra.txt']"))
    shutil.rmtree(art / "gptq")
    assert quantkit("inspect", art).returncode == 1  # and the artifact itself misses the folder's files


def test_inspect_table_shows_both_bits_figures_and_the_legacy_copy(gptq_artifact: Path) -> None:
    """The table showed one "bits per weight" and the size without the legacy gptq/ copy, though inspect knew the
    quantized layers' bits, the whole model's and that copy's bytes. Now each bits figure is labelled for what it
    counts, and the size row gives the copy's bytes apart (the bytes of gptq/'s weight file, not in the size)."""
    from quantkit.progress import fmt_bytes

    shown = json.loads(quantkit("inspect", gptq_artifact, "--json", check=True).stdout)
    legacy_weights = (gptq_artifact / "gptq" / "model.safetensors").stat().st_size
    assert shown["legacy_copy"] == {"path": str(gptq_artifact / "gptq"), "size_bytes": legacy_weights}
    assert shown["size_bytes"] == (gptq_artifact / "model.safetensors").stat().st_size
    table = quantkit("inspect", gptq_artifact, check=True).stdout
    assert re.search(rf"size\s+│ {re.escape(fmt_bytes(shown['size_bytes']))} \+ "
                     rf"{re.escape(fmt_bytes(legacy_weights))} legacy gptq/ copy", table)
    assert re.search(rf"bits per weight \(quantized layers\)\s+│ {shown['bits_per_weight']}\s", table)
    assert re.search(rf"bits per parameter \(whole model\)\s+│ {shown['bits_per_parameter']}\s", table)
    assert "legacy_copy" not in json.loads(quantkit("inspect", gptq_artifact / "gptq", "--json", check=True).stdout)


def test_inspect_table_shows_each_config_group_of_a_mix(mixed: Path, tiny_rtn: Path) -> None:
    """The table named the mix (NVFP4A16+W4A16_ASYM+W8A16, bits 4+4+8) but not what each group covers, which --json
    gives. Now each group has a row: its scheme, type and bits, grouping, symmetry, layers, weights and share. A
    checkpoint of one group has none (the rows above describe it)."""
    table = quantkit("inspect", mixed, check=True).stdout
    rows = {"NVFP4A16": f"float4 group 16 symmetric, 7 layers, {LAYER_WEIGHTS:,} weights (12%)",
            "W4A16_ASYM": f"int4 group 32 asymmetric, 42 layers, {6 * LAYER_WEIGHTS:,} weights (75%)",
            "W8A16": f"int8 group 128 symmetric, 7 layers, {LAYER_WEIGHTS:,} weights (12%)"}
    for scheme, row in rows.items():
        assert re.search(rf"│ {scheme}\s+│ {re.escape(row)}\s", table), (scheme, table)
    assert "layers," not in quantkit("inspect", tiny_rtn, check=True).stdout
