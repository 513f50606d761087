"""Engine servers: one module per engine, the same shape in each (:class:`quantkit.serve.base.Engine`).

:func:`detect` picks the engine an artifact is served by (``--engine auto``) from the artifact kinds table
(:mod:`quantkit.formats.kinds`): GGUF files go to llama.cpp, TensorRT-LLM engine folders and ModelOpt checkpoints to
TensorRT-LLM, every other Hugging Face checkpoint (compressed-tensors, AutoAWQ, GPTQ, plain) to vLLM. Modules are
imported only when used.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from quantkit.errors import UsageError
from quantkit.formats import kinds
from quantkit.serve.base import Engine

_MODULES = {"llama.cpp": "quantkit.serve.llamacpp", "vllm": "quantkit.serve.vllm", "trtllm": "quantkit.serve.trtllm"}
NAMES = tuple(_MODULES)


def get(name: str) -> Engine:
    """The engine called ``name`` (llama.cpp, vllm, trtllm)."""
    if name not in _MODULES:
        raise UsageError(f"unknown engine {name!r}", hint=f"choose one of: auto, {', '.join(NAMES)}")
    return importlib.import_module(_MODULES[name]).ENGINE


def detect(path: Path) -> str:
    """The engine that serves an artifact: its kind's (:mod:`quantkit.formats.kinds`)."""
    kind = kinds.detect(path)
    if kind.serve is None:
        raise UsageError(f"{path} holds {kind.label}, which no engine serves as it is",
                         hint="serve the hf/ or engine/ folder of a TensorRT-LLM artifact, or pass --engine")
    return kind.serve
