"""The method and kind names code compares against (quantkit/formats/names.py) are exactly the registries' own."""

from __future__ import annotations

import json

import pytest

from quantkit import formats
from quantkit.formats import kinds
from quantkit.formats.names import KindName, Method

pytestmark = pytest.mark.unit


def test_methods_are_the_formats_registrys() -> None:
    assert [m.value for m in Method] == list(dict.fromkeys(row.method for row in formats.FORMATS))


def test_kind_names_are_the_kinds_tables() -> None:
    assert [k.value for k in KindName] == [k.name for k in kinds.KINDS]
    assert {row.kind for row in formats.FORMATS} <= set(KindName)


def test_a_name_is_its_plain_string() -> None:
    assert json.dumps({"format": KindName.GGUF, "method": Method.TRT}) == '{"format": "gguf", "method": "trt"}'
    assert f"{Method.GPTQ}-w4" == "gptq-w4"
