"""A folder's configs as every part of quantkit reads them: ``config.json``, its quantization config, and the GGUF
files a path stands for.

The bottom floor: the artifact kinds, ``inspect``, ``doctor``, vLLM's kernel table and the evaluation's dense copy
all find a checkpoint's quantization here, so they never disagree about where it sits (``quantization_config`` at
the top of ``config.json``, also for a multimodal model whose shapes are under ``text_config``) or what a missing or
malformed one reads as (none).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_config(path: Path, name: str = "config.json") -> dict[str, Any]:
    """A checkpoint folder's JSON config as a dict; ``{}`` when it is missing or unreadable (recognising a folder,
    or checking one before an engine reads it, must not fail on a folder that is something else)."""
    try:
        data = json.loads((path / name).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``quantization_config`` section of a parsed ``config.json``; ``{}`` for an unquantized checkpoint (or a
    section that is not an object)."""
    q = config.get("quantization_config")
    return q if isinstance(q, dict) else {}


def quant_method(path: Path) -> str | None:
    """The ``quant_method`` a checkpoint folder's ``config.json`` names, or None."""
    return quantization_config(read_config(path)).get("quant_method")


def gguf_files(path: Path) -> list[Path]:
    """The GGUF files a path stands for: the file itself, or every ``.gguf`` in a folder."""
    if path.is_file():
        return [path] if path.suffix == ".gguf" else []
    return sorted(path.glob("*.gguf")) if path.is_dir() else []
