"""The names quantkit spells once: engines, quantization methods and artifact kinds. The kinds table, the engines
registry, messages and manifests use these; code outside the registries compares against them, never a bare string.

The bottom floor, below :mod:`quantkit.formats.kinds` (which names the engine that evaluates and serves each kind)
and :mod:`quantkit.engines.registry` (one row per engine). Plain strings (a :class:`StrEnum` member is one): they go
into JSON and manifests as they are. The registries are built from these: the specs' ``method:`` literals and the
formats table read :class:`Method`, the kinds table :class:`KindName`, the engines registry (and the recipe's and the
CLI's ``--engine`` choices) :data:`ENGINES`, :data:`EVALUATING` and :data:`SERVING`.
"""

from enum import StrEnum

TRANSFORMERS = "transformers"
LLAMACPP = "llama.cpp"
VLLM = "vllm"
TRTLLM = "trtllm"
SGLANG = "sglang"
ENGINES = (TRANSFORMERS, LLAMACPP, VLLM, TRTLLM, SGLANG)  # one row each in quantkit.engines.registry, in this order
# What each engine does: scores token windows for `quantkit eval` (its engines/<name>/logits.py), serves for
# `quantkit smoke` (its engines/<name>/server.py). The registry's rows, the recipe's verify.engine and smoke.engine
# choices and the CLI's --engine choices are read from these.
EVALUATING = (TRANSFORMERS, LLAMACPP, VLLM, SGLANG)
SERVING = (LLAMACPP, VLLM, TRTLLM, SGLANG)


class Method(StrEnum):
    """The recipe's ``method:`` values: one per method of the formats registry (:data:`quantkit.formats.FORMATS`)."""

    AWQ = "awq"
    GPTQ = "gptq"
    AUTOROUND = "autoround"
    FP8 = "fp8"
    INT8 = "int8"
    W4A8 = "w4a8"
    RTN = "rtn"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    GGUF = "gguf"
    TRT = "trt"


class KindName(StrEnum):
    """The artifact kinds' names (:data:`quantkit.formats.kinds.KINDS`), as manifests record them (``format``)."""

    TENSORRT_LLM = "tensorrt-llm"
    GGUF = "gguf"
    TRTLLM_ENGINE = "trtllm-engine"
    MODELOPT = "modelopt"
    TRTLLM_CHECKPOINT = "trtllm-checkpoint"
    COMPRESSED_TENSORS = "compressed-tensors"
    AWQ = "awq"
    GPTQ = "gptq"
    HF_QUANTIZED = "hf-quantized"
    HF = "hf"
