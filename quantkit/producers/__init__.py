"""Producers: one module per format family, each with the same shape (see :mod:`quantkit.producers.base`).

The registry maps a recipe ``method`` to the module that produces it. Modules are imported only when used,
so a missing backend only matters to the verbs that need it.
"""

from __future__ import annotations

import importlib

from quantkit.producers.base import Producer

_MODULES = {
    "awq": "quantkit.producers.compressed",
    "gptq": "quantkit.producers.compressed",
    "fp8": "quantkit.producers.compressed",
    "int8": "quantkit.producers.compressed",
    "rtn": "quantkit.producers.compressed",
    "gguf": "quantkit.producers.gguf",
    "trt": "quantkit.producers.trt",
}


def get(method: str) -> Producer:
    """The producer for a recipe method."""
    module = importlib.import_module(_MODULES[method])
    return module.PRODUCER
