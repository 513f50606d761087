"""The names quantkit spells once (quantkit/formats/names.py): the registries are built from them, so what is left
to check is that no name is declared without its row, and that a name is the plain string manifests hold."""

from __future__ import annotations

import json

import pytest

from quantkit import formats
from quantkit.engines import registry
from quantkit.formats import kinds, names
from quantkit.formats.names import KindName, Method

pytestmark = pytest.mark.unit


def test_every_name_has_its_row() -> None:
    assert set(formats.methods()) == set(Method)  # a method without a format row could never be made
    assert [k.name for k in kinds.KINDS] == list(dict.fromkeys(k.name for k in kinds.KINDS))
    assert set(k.name for k in kinds.KINDS) == set(KindName)  # a kind without a test would never be recognised
    assert tuple(registry.BY_NAME) == names.ENGINES == tuple(e.name for e in registry.ENGINES)
    assert set(names.EVALUATING) | set(names.SERVING) == set(names.ENGINES)


def test_a_name_is_its_plain_string() -> None:
    assert json.dumps({"format": KindName.GGUF, "method": Method.TRT}) == '{"format": "gguf", "method": "trt"}'
    assert f"{Method.GPTQ}-w4" == "gptq-w4"
    assert all(type(row.method) is str for row in formats.FORMATS)  # the spec's literal: what manifests record
