"""GGUF refusals: early, and each saying what is wrong.

What the command line alone decides (an output that exists, an importance matrix that is not there, a type name that
is not one) is refused before the source's weights are hashed and before llama.cpp's converter plans the file: the
converter is made unavailable here (``$QUANTKIT_LLAMACPP_CONVERT`` naming an empty folder, the plans of this process
forgotten), so a refusal that came after it would be the missing converter's instead. A refusal that only the
converter can make (a tokenizer it cannot read) names the condition that failed and the file that is missing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT, TINY
from gguf_spec import make
from quantkit import api, recipe, source as source_mod
from quantkit.errors import OutputExistsError, RecipeError, SourceModelError, UsageError
from quantkit.producers.gguf import PRODUCER, convert, tools

pytestmark = pytest.mark.unit

TINY_MOE = ROOT / "models" / "quantkit-tiny-moe"


@pytest.fixture
def no_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's converter cannot be found, and no plan of it is remembered: running it raises MissingToolError."""
    empty = tmp_path / "no-converter"
    empty.mkdir()
    monkeypatch.setenv(tools.CONVERT_ENV_VAR, str(empty))
    monkeypatch.setattr(convert, "_plans", {})


def gguf_recipe(out: Path, **quantize: object) -> recipe.Recipe:
    return recipe.load(None, {"model.source": str(TINY), "output": str(out)},
                       base={"quantize": {"method": "gguf", **quantize}})


def rtn_recipe(out: Path) -> recipe.Recipe:
    return recipe.load(None, {"model.source": str(TINY), "output": str(out)}, base={"quantize": {"method": "rtn"}})


@pytest.mark.parametrize("method", ["gguf", "rtn"])
@pytest.mark.parametrize("force, words", [(False, "already exists"), (True, "was not written by quantkit")])
def test_an_existing_output_is_refused_before_any_work(method: str, force: bool, words: str, tmp_path: Path,
                                                       no_converter: None) -> None:
    """Without --force an output that exists, with it a folder of the user's: refused with the weights unhashed and
    the converter never started (for GGUF it would be the missing converter's error otherwise)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    r = gguf_recipe(out, types=["Q8_0"]) if method == "gguf" else rtn_recipe(out)
    src = source_mod.resolve(r.model)
    with pytest.raises(OutputExistsError, match=words):
        api.quantize_one(r, r.quantize, out, force=force, source=src)
    assert src._weights is None, "the source's weights were hashed before the refusal"
    assert (out / "notes.txt").read_text() == "the user's"


def test_a_missing_importance_matrix_is_refused_before_the_converter(tmp_path: Path, no_converter: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Named with where a relative path was looked for, and what to do instead."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"importance matrix nope\.gguf does not exist") as e:
        make(tmp_path / "out", ["Q4_K_M"], imatrix_file=Path("nope.gguf"))
    assert str(tmp_path) in e.value.message
    assert "--imatrix " in e.value.hint
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("types, words", [(["F16"], "F16 is written directly"),
                                          (["F16", "Q8_0"], "F16 and Q8_0 are written directly")])
def test_a_matrix_for_types_written_directly(types: list[str], words: str, tmp_path: Path,
                                             no_converter: None) -> None:
    """Refused from the command line alone (the converter never asked), in words that agree with the types."""
    r = gguf_recipe(tmp_path / "out", types=types, imatrix=True)
    with pytest.raises(UsageError, match=words):
        PRODUCER.check(r.quantize, source_mod.resolve(r.model))


def test_an_unknown_type_is_named_once_with_the_nearest_names(tmp_path: Path) -> None:
    """The list offers what can be chosen: not Q2_0 (always refused), NVFP4 only as what an NVFP4 checkpoint gives."""
    with pytest.raises(RecipeError) as e:
        gguf_recipe(tmp_path / "out", types=["Q8_0", "Q4_K_X"])
    said = e.value.message
    assert said.count("Q4_K_X") == 1, said
    assert "did you mean" in said and "Q4_K_M" in said.split("did you mean")[1].split(";")[0], said
    assert "Q2_0" not in said.replace("TQ2_0", ""), said
    assert "NVFP4 from an NVFP4 checkpoint only" in said, said


@pytest.mark.e2e
def test_a_tokenizer_the_converter_cannot_read_says_why(tmp_path: Path) -> None:
    """The MoE reference model without tokenizer_config.json: transformers then reads tokenizer.json as its model
    type's default tokenizer, which adds a token past config.json's vocab_size, and the converter's bare assert
    fails. The refusal gives the condition with its values, and the file that is missing."""
    model = tmp_path / "nocfg"
    shutil.copytree(TINY_MOE, model)
    (model / "tokenizer_config.json").unlink()
    with pytest.raises(SourceModelError) as e:
        convert.plan(model)
    said = e.value.message
    assert "max(tokenizer.vocab.values()) < vocab_size" in said, said
    assert "max(tokenizer.vocab.values()) is 8192" in said and "vocab_size is 8192" in said, said
    assert "no tokenizer_config.json" in said, said


@pytest.mark.e2e
def test_the_size_estimate_is_the_artifacts(tiny_gguf_q4_k_m: Path) -> None:
    """estimate_bytes is what the artifact takes (within 10%); the intermediate the quantizer reads, which sits beside
    it only while it is made, is working space (working_bytes), not part of it."""
    r = gguf_recipe(tiny_gguf_q4_k_m, types=["Q4_K_M"])
    src = source_mod.resolve(r.model)
    made = sum(f.stat().st_size for f in tiny_gguf_q4_k_m.glob("*.gguf"))
    assert abs(PRODUCER.estimate_bytes(r.quantize, src) / made - 1) < 0.10
    with_f16 = gguf_recipe(tiny_gguf_q4_k_m, types=["F16", "Q4_K_M"]).quantize  # the F16 file is the intermediate
    assert PRODUCER.working_bytes(r.quantize, src) - PRODUCER.working_bytes(with_f16, src) == src.size_bytes
