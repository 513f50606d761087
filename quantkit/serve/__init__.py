"""Engine servers: one module per engine, the same shape in each (:class:`quantkit.serve.base.Engine`).

:func:`detect` picks the engine an artifact is served by (``--engine auto``): GGUF files go to llama.cpp,
TensorRT-LLM engine folders and ModelOpt checkpoints to TensorRT-LLM, every other Hugging Face checkpoint
(compressed-tensors, AutoAWQ, GPTQ, plain) to vLLM. Modules are imported only when used.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from quantkit.errors import UsageError
from quantkit.serve.base import Engine

_MODULES = {"llama.cpp": "quantkit.serve.llamacpp", "vllm": "quantkit.serve.vllm", "trtllm": "quantkit.serve.trtllm"}
NAMES = tuple(_MODULES)


def get(name: str) -> Engine:
    """The engine called ``name`` (llama.cpp, vllm, trtllm)."""
    if name not in _MODULES:
        raise UsageError(f"unknown engine {name!r}", hint=f"choose one of: auto, {', '.join(NAMES)}")
    return importlib.import_module(_MODULES[name]).ENGINE


def detect(path: Path) -> str:
    """The engine that serves an artifact, from its files."""
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_file():
        if path.suffix == ".gguf":
            return "llama.cpp"
        raise UsageError(f"{path} is a file but not a .gguf", hint="pass an artifact folder or a .gguf file")
    if any(path.glob("*.gguf")):
        return "llama.cpp"
    if any(path.glob("rank*.engine")) or (path / "hf_quant_config.json").exists():
        return "trtllm"
    if (path / "config.json").exists():
        return "vllm"
    raise UsageError(f"{path} holds neither .gguf files nor a checkpoint (config.json)",
                     hint="pass an artifact folder written by quantkit, or --engine")
