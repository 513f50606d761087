"""Which torch device a job runs on: ``auto`` resolved, an explicit ``cuda`` checked, before any model loads.

The bottom floor, beside the errors: evaluation in transformers and the GGUF importance matrix computed in
transformers both resolve ``--device`` here, so neither reaches into the other to ask.
"""

from __future__ import annotations

from quantkit.errors import UsageError


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; anything else is checked and kept."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} was asked for but torch sees no CUDA GPU",
                         hint="use --device cpu (or auto)")
    return device
