"""Bits per weight of an FP4 (NVFP4 or MXFP4) compressed-tensors artifact's quantized layers, counted from its files:
the packed E2M1 values, the group scales and the global scales, over the weights they encode.

    python bench/fp4_bits.py ARTIFACT... > artifacts.json

Reads tensor shapes and dtypes from the safetensors headers only (no weights are loaded). The layout fixes the result
(NVFP4: 4 + 8/16 bits, plus one FP32 global scale per tensor; MXFP4: 4 + 8/32), so an artifact made anywhere with
the same shapes counts the same: bench/results/h200/fp4/artifacts.json was counted on artifacts the CPU made.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from safetensors import safe_open

from quantkit.source import DTYPE_BYTES
PARTS = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")


def count(folder: Path) -> dict[str, float | int]:
    """The quantized layers' bits per weight and how many weights they hold."""
    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                shapes[k] = sl.get_shape()
                sizes[k] = DTYPE_BYTES[sl.get_dtype()] * math.prod(shapes[k])
    bits = weights = 0
    for name in (k for k in shapes if k.endswith(".weight_packed")):
        module = name.removesuffix(".weight_packed")
        rows, cols = shapes[name]
        weights += rows * cols * 2  # two E2M1 values a byte
        bits += 8 * sum(sizes.get(module + part, 0) for part in PARTS)
    if not weights:
        raise SystemExit(f"{folder}: no FP4 weight_packed tensor")
    return {"measured_bits": round(bits / weights, 4), "quantized_weights": weights}


def main() -> None:
    print(json.dumps({Path(p).name: count(Path(p)) for p in sys.argv[1:]}, indent=1))


if __name__ == "__main__":
    main()
