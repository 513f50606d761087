"""The architecture matrix (tests/data/architectures.yaml, scripts/arch_matrix.py) in CI.

The full matrix (every family x every format) is the script's job and its results are committed in
bench/results/arch_matrix.json; here the same code re-runs a chosen part of it through the real CLI, and each cell
must come out as recorded: a cell the table says works must still work, a gap must still fail with the recorded
reason. The choice is one cell per path a family takes through quantkit (compressed-tensors without data and with a
family's smoothing mappings, llama.cpp's converter and its k-quants), both tokenizers (byte-level BPE and Gemma 3's
SentencePiece), dense and mixture-of-experts families and a recorded gap. The rest checks the data: the results cover
the matrix, docs/architectures.md's table is the one the results render, the Gemma 3 tokenizer still equals
llama.cpp's, and every family has its vLLM case in scripts/gpu_cases.yaml.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quantkit.architectures import moe_family

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import arch_matrix as am  # noqa: E402
import gpu_case_file as cf  # noqa: E402

pytestmark = pytest.mark.unit

MATRIX = am.load_matrix()
RECORDED = am.read_results() or {"cells": []}
CELLS = {(c["family"], c["format"]): c for c in RECORDED["cells"]}

# What CI re-runs: one cell per path a family takes through quantkit, both tokenizers, dense and MoE, a recorded gap.
# Not re-run here (the matrix's full run records them): gptq and fp8-dynamic, whose path on a dense family is rtn's
# (llm-compressor with no smoothing mappings to resolve: what differs is the method, checked on the reference model by
# tests/test_compressed.py, on MoE checkpoints and vision-language ones), so olmo2 x gptq and phi3 x fp8-dynamic went.
CI_CELLS = [
    ("gemma", "rtn"),  # Gemma 3's SentencePiece tokenizer; compressed-tensors without calibration data
    ("cohere", "awq"),  # AWQ's smoothing mappings on attention and MLP in parallel from one norm
    ("glm4", "int8"),  # the recorded gap: SmoothQuant's mappings do not resolve on GLM-4's layout
    ("starcoder2", "gguf-f16"),  # llama.cpp's converter on LayerNorm, biases and a GELU MLP
    ("qwen2_moe", "gguf-q4_k_m"),  # an MoE with a gated shared expert through the converter and llama-quantize
]
# The paths: compressed-tensors without data or mappings, with smoothing mappings (AWQ, SmoothQuant), GGUF as converted
# and as llama-quantize's k-quants.
PATHS = {"rtn": "data-free", "gptq": "data-free", "fp8-dynamic": "data-free", "awq": "mappings", "int8": "mappings",
         "gguf-f16": "converted", "gguf-q4_k_m": "k-quant"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arch")


_REFERENCES: dict[str, am.Reference] = {}


def reference(family: am.Family) -> tuple[Path, am.Reference]:
    """The family's checkpoint and its reference logits, once per family for the whole module."""
    src = am.checkpoint(family, MATRIX)
    if family.name not in _REFERENCES:
        _REFERENCES[family.name] = am.Reference(src)
    return src, _REFERENCES[family.name]


def test_results_cover_the_matrix() -> None:
    """Every family x format has a recorded cell, and every gap says why."""
    missing = [(f, x) for f in MATRIX.families for x in MATRIX.formats if (f, x) not in CELLS]
    assert not missing, f"cells never run (scripts/arch_matrix.py run): {missing}"
    silent = [k for k, c in CELLS.items() if c["status"] != "ok" and not c["reason"]]
    assert not silent, f"gaps without a reason: {silent}"
    assert set(CELLS) <= {(f, x) for f in MATRIX.families for x in MATRIX.formats}, "cells of rows that are gone"


def test_ci_choice_covers_paths_tokenizers_moe_and_a_gap() -> None:
    assert set(PATHS) == set(MATRIX.formats), "a format of the matrix without its path here"
    assert {PATHS[x] for _, x in CI_CELLS} == set(PATHS.values())
    assert {MATRIX.families[f].tokenizer for f, _ in CI_CELLS} == set(MATRIX.tokenizers)
    moe = {f: moe_family({"model_type": MATRIX.families[f].model_type}) is not None for f, _ in CI_CELLS}
    assert any(moe.values()) and not all(moe.values()), moe
    assert any(CELLS[c]["status"] != "ok" for c in CI_CELLS if c in CELLS), "no recorded gap is re-run"


def test_the_pages_table_is_the_rendered_results() -> None:
    text = am.PAGE.read_text()
    block = text.split(am.MARK_START, 1)[1].split(am.MARK_END, 1)[0]
    assert block.strip() == am.markdown(RECORDED, MATRIX).strip(), \
        "docs/architectures.md's table is stale: run scripts/arch_matrix.py render"


def test_every_family_has_its_vllm_case() -> None:
    """One vLLM load case per family, tagged arch, producing the family's `gpu:` format from arch:FAMILY."""
    cases = {c.model[5:]: c for c in cf.load_cases(cf.CASES) if c.model.startswith("arch:")}
    assert set(cases) == set(MATRIX.families)
    for name, fam in MATRIX.families.items():
        c = cases[name]
        assert "arch" in c.tags and c.expect.loads and c.expect.quantization == "compressed-tensors"
        argv = MATRIX.formats[fam.gpu].argv
        assert [c.produce.verb, *c.produce.args] == list(argv), f"{c.name} does not make {fam.gpu}"


@pytest.mark.e2e
def test_gemma3_tokenizer_equals_llama_cpp() -> None:
    """The rebuilt SentencePiece model gives llama.cpp's ids for the Gemma 3 GGUF on every proof text."""
    folder = am.tokenizer_folder("gemma3", MATRIX)
    assert am.prove_spm(folder / "tokenizer.model", am.gemma3_gguf(MATRIX.tokenizers["gemma3"])) >= 100


@pytest.mark.e2e
@pytest.mark.parametrize("family,fmt", CI_CELLS, ids=[f"{f}-{x}" for f, x in CI_CELLS])
def test_cell_as_recorded(family: str, fmt: str, work: Path) -> None:
    recorded = CELLS.get((family, fmt))
    assert recorded is not None, f"{family} x {fmt} has no recorded result"
    fam = MATRIX.families[family]
    src, ref = reference(fam)
    cell = am.run_cell(fam, MATRIX.formats[fmt], src, ref, work)
    if recorded["status"] == "ok":
        assert cell.status == "ok", f"{family} x {fmt} worked when recorded, now {cell.status}: {cell.reason}"
    else:
        assert (cell.status, cell.reason) == (recorded["status"], recorded["reason"])
