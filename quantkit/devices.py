"""Which torch device a job runs on: ``auto`` resolved, an explicit ``cuda`` checked, before any model loads; and
the CPU cores a job may use.

The bottom floor, beside the errors: evaluation in transformers and the GGUF importance matrix computed in
transformers both resolve ``--device`` here, so neither reaches into the other to ask; llama.cpp's quantizer and
its evaluation engine take their thread counts from :func:`cores`.
"""

from __future__ import annotations

import os

from quantkit.errors import UsageError


def cores() -> int:
    """The CPUs this process may run on (its affinity, which a container or ``taskset`` narrows), as llama.cpp's
    own tools count them by default."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; anything else is checked and kept."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} was asked for but torch sees no CUDA GPU",
                         hint="use --device cpu (or auto)")
    return device
