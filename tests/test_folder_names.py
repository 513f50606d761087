"""What an output's default folder name means, as docs/recipes.md says it: the recipe's parameters, made before the
source is read, so an unset group size is named after the default 128 even where the source gets another size."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from quantkit import plan, recipe

pytestmark = pytest.mark.unit


def test_an_unset_group_size_names_the_folder_after_the_default(smollm2: Path, tmp_path: Path) -> None:
    """SmolLM2's 576-wide layers get group 64 (the plan's note) in a folder named gptq-w4g128, and the docs say so:
    the folder name is stable across reruns because no source is needed to make it."""
    r = recipe.load(None, {"model.source": str(smollm2), "output": str(tmp_path / "release")},
                    base={"outputs": [{"method": "gptq"}]})
    planned = plan.make(r).outputs[0]
    assert planned.name == "gptq-w4g128" and any("using 64" in note for note in planned.notes), planned
    docs = " ".join((ROOT / "docs" / "recipes.md").read_text().split())
    assert ("an unset `group_size` is named `g128`, the default, even where the source gets another size "
            "(SmolLM2's 576-wide layers get 64, in `gptq-w4g128`") in docs
