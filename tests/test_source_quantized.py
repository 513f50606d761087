"""A quantized checkpoint given as a source counts the parameters the model has, not the elements that store them.

Bits per weight (``eval``'s table, ``inspect``'s ``bits_per_parameter``) divide by the source's parameter count, and
GGUF's NVFP4 repack takes a quantized checkpoint as its source. Counting stored elements put quantkit-tiny's NVFP4
checkpoint at 7,737,656 parameters, packed bytes and scales included, and its GGUF file at 12.64 bits per weight for
9.3. Each artifact here is quantkit's own, of the reference model, resolved as a source as ``gguf`` or ``eval``
would: every one must count the reference model's 10,490,112.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, quantkit
from quantkit import source
from quantkit.recipe import ModelSpec

pytestmark = pytest.mark.e2e

PARAMETERS = 10_490_112  # models/quantkit-tiny (tests/test_source.py)
CALIBRATION = ("--samples", "4", "--seq-len", "64")
BUILDS = {
    "nvfp4": ("nvfp4", "--algorithm", "rtn"),  # FP4 packed two a byte, no weight_shape: unpacked by the config's bits
    "fp8": ("fp8", *CALIBRATION),  # one FP8 value an element, with weight and input scales
    "gptq": ("gptq", *CALIBRATION, "--format", "gptq"),  # int4 packed in int32 with weight_shape, + the legacy copy
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each artifact made once through the command line; the gptq artifact's legacy GPTQ layout (``gptq/``: qweight,
    qzeros, scales, g_idx, its bits in quantization_config) is a checkpoint of its own."""
    root = tmp_path_factory.mktemp("quantized-sources")
    for name, (verb, *flags) in BUILDS.items():
        quantkit(verb, TINY, root / name, *flags, "--quiet", check=True)
    return {**{name: root / name for name in BUILDS}, "gptq legacy layout": root / "gptq" / "gptq"}


@pytest.mark.parametrize("name", [*BUILDS, "gptq legacy layout"])
def test_a_quantized_source_counts_the_models_parameters(artifacts: dict[str, Path], name: str) -> None:
    assert source.resolve(ModelSpec(source=str(artifacts[name]))).num_parameters == PARAMETERS
