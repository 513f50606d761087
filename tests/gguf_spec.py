"""Making GGUF artifacts through the API, as the CLI does (:func:`quantkit.api.quantize_one`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import TINY
from quantkit import api, recipe

CALIB = {"calibration.samples": 16, "calibration.seq_len": 256, "calibration.dataset": "mixed"}


def make(out: Path, types_: list[str], *, imatrix_: bool = False, imatrix_file: Path | None = None,
         model: Path = TINY, overrides: dict[str, Any] | None = None) -> api.ArtifactResult:
    """One GGUF artifact of ``model`` (16 x 256 calibration tokens when a matrix is computed), its spec validated as
    a recipe's (a bad one is a RecipeError, exit 2); ``overrides`` are further recipe fields
    (``{"calibration.min_expert_tokens": 1000}``)."""
    quantize = {"method": "gguf", "types": types_, "imatrix": imatrix_,
                **({"imatrix_file": str(imatrix_file)} if imatrix_file else {})}
    r = recipe.load(None, {"model.source": str(model), "output": str(out), **CALIB, **(overrides or {})},
                    base={"quantize": quantize})
    return api.quantize_one(r, r.quantize, out)
