"""A folder's configs as every part of quantkit reads them: ``config.json``, its quantization config, and the GGUF
files a path stands for.

The bottom floor: the artifact kinds, ``inspect``, ``doctor``, vLLM's kernel table and the evaluation's dense copy
all find a checkpoint's quantization here, so they never disagree about where it sits (``quantization_config`` at
the top of ``config.json``, also for a multimodal model whose shapes are under ``text_config``) or what a missing or
malformed one reads as (none). Whether a checkpoint is FP4, and weight-only or W4A4, is read here too (:func:`fp4`):
the engines say from it which arithmetic a W4A4 checkpoint gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.manifest import open_regular


def read_config(path: Path, name: str = "config.json") -> dict[str, Any]:
    """A checkpoint folder's JSON config as a dict; ``{}`` when it is missing or unreadable (recognising a folder,
    or checking one before an engine reads it, must not fail on a folder that is something else). A FIFO, a socket
    or a device there is an :class:`~quantkit.errors.IntegrityError` naming it (exit 1): reading it would never end,
    and taking it for no config would only move the wait to the library that reads it next."""
    try:
        with open_regular(path / name) as f:
            data = json.loads(f.read().decode())
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


# FP4: the two 4-bit float layouts compressed-tensors writes and vLLM 0.26 serves, told apart as vLLM's compressed-
# tensors config does (_is_nvfp4_format, _is_mxfp4): E2M1 values, symmetric, in groups of 16 with a tensor-wide
# global scale (strategy tensor_group: NVFP4) or of 32 with power-of-two scales (strategy group: MXFP4).
NVFP4 = "NVFP4"
MXFP4 = "MXFP4"
_FP4_LAYOUTS = {("tensor_group", 16): NVFP4, ("group", 32): MXFP4}


@dataclass(frozen=True)
class Fp4:
    """An FP4 checkpoint: its layout (:data:`NVFP4` or :data:`MXFP4`) and whether it quantizes activations to FP4
    too (W4A4), which only a GPU with FP4 arithmetic runs as such."""

    layout: str
    w4a4: bool


def fp4_layout(args: Any) -> str | None:
    """:data:`NVFP4` or :data:`MXFP4` for one ``QuantizationArgs`` mapping (weights or input activations), else None."""
    if not isinstance(args, dict) or args.get("type") != "float" or args.get("num_bits") != 4 \
            or not args.get("symmetric", True):
        return None
    return _FP4_LAYOUTS.get((str(args.get("strategy")), args.get("group_size")))


def fp4(config: dict[str, Any]) -> Fp4 | None:
    """The FP4 quantization of a parsed ``config.json`` (None when no config group has FP4 weights): W4A4 when a
    group with FP4 weights also quantizes its input activations to 4-bit floats."""
    groups = quantization_config(config).get("config_groups")
    found = None
    for group in (groups.values() if isinstance(groups, dict) else ()):
        if not isinstance(group, dict) or not (layout := fp4_layout(group.get("weights"))):
            continue
        inputs = group.get("input_activations")
        w4a4 = isinstance(inputs, dict) and inputs.get("type") == "float" and inputs.get("num_bits") == 4
        found = Fp4(layout, w4a4 or bool(found and found.w4a4))
    return found
