"""Installed versions of quantkit's backends, read from package metadata (no heavy imports)."""

from __future__ import annotations

from importlib import metadata

# Distributions whose versions decide what an artifact looks like or whether an engine reads it.
TRACKED = (
    "quantkit", "torch", "transformers", "accelerate", "llmcompressor", "compressed-tensors", "safetensors",
    "gguf", "llama_cpp_python", "autoawq", "nvidia-modelopt", "vllm", "tensorrt_llm", "datasets", "numpy",
    "tokenizers",
)


def version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed(dists: tuple[str, ...] = TRACKED) -> dict[str, str]:
    """Versions of the tracked distributions that are installed (the manifest's ``versions``)."""
    return {d: v for d in dists if (v := version(d)) is not None}


def require(module: str, extra: str, purpose: str):  # noqa: ANN201 - returns the imported module
    """Import a heavy optional backend, or raise one clear line naming the extra that provides it."""
    import importlib

    from quantkit.errors import MissingBackendError

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingBackendError(module, extra, purpose) from None
