"""The engines registry is the one place an engine is described: these read its rows against the kinds table and the
engines' own modules (the recipe's and the CLI's --engine choices are built from quantkit/formats/names.py).

What each engine does with an artifact is tested end to end in test_eval.py, test_smoke.py and the GPU cases.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from quantkit import recipe
from quantkit.engines import registry, serving
from quantkit.formats import kinds, names

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_has_its_modules_and_a_name_of_its_own() -> None:
    for row in registry.ENGINES:
        assert row.logits or row.server, row.name
        if row.logits:
            module = importlib.import_module(row.logits)
            assert callable(module.load) and callable(module.refuse), row.logits
        if row.server:
            server = serving.get(row.name)
            assert isinstance(server, serving.Server) and server.name == row.name, row.server
            assert row.python is not None and row.python.env_var == f"QUANTKIT_{row.name.upper().replace('.', '')}" \
                "_PYTHON", row.name
        assert row.gpu == (row.name in (names.VLLM, names.TRTLLM, names.SGLANG)), row.name


def test_kinds_name_only_engines_that_can_do_it_and_every_engine_has_a_kind() -> None:
    for kind in kinds.KINDS:
        assert kind.evaluate is None or kind.evaluate in names.EVALUATING, kind.name
        assert kind.serve is None or kind.serve in names.SERVING, kind.name
    for row in registry.ENGINES:
        if row.name == names.SGLANG:  # never picked by --engine auto: it is asked for by name
            assert not row.evaluates() and not row.serves()
            continue
        assert bool(row.evaluates()) == bool(row.logits), row.name
        assert bool(row.serves()) == bool(row.server), row.name
    assert registry.get(names.LLAMACPP).evaluates() == registry.get(names.LLAMACPP).serves() == ("gguf",)


def test_an_engine_that_cannot_do_it_is_refused_by_the_recipe_with_the_choices() -> None:
    with pytest.raises(recipe.RecipeError, match="expected 'auto', 'transformers', 'llama.cpp', 'vllm' or 'sglang'"):
        recipe.validate({"model": {"source": "m"}, "output": "o", "quantize": {"method": "rtn"},
                         "evaluation": {"engine": "trtllm"}})
    schema = recipe.Recipe.model_json_schema()["$defs"]
    assert schema["SmokeSpec"]["properties"]["engine"]["enum"] == ["auto", *names.SERVING]
