"""quantkit: one interface from a Hugging Face checkpoint to verified quantized artifacts.

Importing the package is cheap on purpose: torch, transformers and every backend are imported inside the
function that needs them, so ``quantkit --help`` stays fast.
"""

__version__ = "0.1.0"
