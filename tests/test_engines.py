"""The engines registry is the one place an engine is described: these read its rows against the kinds table, the
engines' own modules and the places that must still spell engine names out (the recipe's and the CLI's choices).

What each engine does with an artifact is tested end to end in test_eval.py, test_smoke.py and the GPU cases.
"""

from __future__ import annotations

import importlib
import typing
from pathlib import Path

import pytest

from quantkit import recipe
from quantkit.cli import smoke as cli_smoke
from quantkit.engines import registry, serving
from quantkit.formats import kinds, names

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_has_its_modules_and_a_name_of_its_own() -> None:
    spelled = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
    assert [e.name for e in registry.ENGINES] == list(registry.BY_NAME) and set(registry.BY_NAME) == spelled
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
        assert kind.evaluate is None or kind.evaluate in registry.EVALUATING, kind.name
        assert kind.serve is None or kind.serve in registry.SERVING, kind.name
    for row in registry.ENGINES:
        if row.name == names.SGLANG:  # never picked by --engine auto: it is asked for by name
            assert not row.evaluates() and not row.serves()
            continue
        assert bool(row.evaluates()) == bool(row.logits), row.name
        assert bool(row.serves()) == bool(row.server), row.name
    assert registry.get(names.LLAMACPP).evaluates() == registry.get(names.LLAMACPP).serves() == ("gguf",)


def test_the_choices_spelled_outside_the_registry_are_its_engines() -> None:
    def choices(field: str, spec: type) -> set[str]:
        return set(typing.get_args(spec.model_fields[field].annotation))

    assert choices("engine", recipe.VerifySpec) == {"auto", *registry.EVALUATING}
    assert choices("engine", recipe.SmokeSpec) == {"auto", *registry.SERVING}
    assert set(cli_smoke.ENGINES) == {"auto", *registry.SERVING}
