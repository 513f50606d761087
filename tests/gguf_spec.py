"""Making GGUF artifacts through the API with the fields the formats registry adds to the recipe's GGUF spec.

Until the recipe's ``GgufSpec`` has ``imatrix_file`` and validates types with
:func:`quantkit.producers.gguf.types.validate` (the formats registry wires both), the tests use this subclass;
:func:`make` then goes through :func:`quantkit.api.quantize_one` exactly as the CLI does.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from conftest import TINY
from quantkit import api, recipe
from quantkit.producers.gguf import types

CALIB = {"calibration.samples": 16, "calibration.seq_len": 256, "calibration.dataset": "mixed"}


class GgufSpec(recipe.GgufSpec):
    """The recipe's GGUF spec with ``imatrix_file`` and every type of the table."""

    imatrix_file: str | None = None

    @field_validator("types")
    @classmethod
    def _types(cls, v: list[str]) -> list[str]:
        return types.validate(v)


def make(out: Path, types_: list[str], *, imatrix_: bool = False, imatrix_file: Path | None = None,
         model: Path = TINY) -> api.ArtifactResult:
    """One GGUF artifact of ``model`` (16 x 256 calibration tokens when a matrix is computed)."""
    r = recipe.load(None, {"model.source": str(model), "output": str(out), **CALIB},
                    base={"quantize": {"method": "gguf", "types": ["Q4_K_M"]}})
    spec = GgufSpec(method="gguf", types=types_, imatrix=imatrix_,
                    imatrix_file=str(imatrix_file) if imatrix_file else None)
    return api.quantize_one(r, spec, out)
