"""The engines' names, spelled once: the kinds table, the engines registry, messages and manifests use these.

The bottom floor, below :mod:`quantkit.formats.kinds` (which names the engine that evaluates and serves each kind)
and :mod:`quantkit.engines.registry` (one row per engine). Plain strings: they go into JSON and manifests as they are.
"""

TRANSFORMERS = "transformers"
LLAMACPP = "llama.cpp"
VLLM = "vllm"
TRTLLM = "trtllm"
