"""The GGUF producer's name for the one table of GGUF types, which stands on the bottom floor with the formats
(:mod:`quantkit.formats.gguf_types`), where the recipe's validator reads it too."""

from quantkit.formats.gguf_types import ALIASES, CONVERTER, LLAMA_CPP, NAMES, TYPES, GgufType, canonical, get, validate

__all__ = ["ALIASES", "CONVERTER", "LLAMA_CPP", "NAMES", "TYPES", "GgufType", "canonical", "get", "validate"]
