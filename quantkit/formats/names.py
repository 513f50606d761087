"""The names quantkit spells once: engines, quantization methods, artifact kinds and the text files it reads. The
kinds table, the engines registry, messages and manifests use these; code outside the registries compares against
them, never a bare string.

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

# The text files calibration and evaluation read (quantkit.calibration), by how their name ends (lower-cased), one
# tuple per way of reading: plain text (a document per blank-line-separated block), JSON Lines (a record per line),
# a JSON array of the same records, parquet (a record per row). Here, below the recipe and the CLI, so the reader,
# its messages, the flags' help and the recipe's descriptions name the same files.
PLAIN_TEXT_FILES = (".txt", ".md", ".rst", ".txt.gz")
JSON_LINES_FILES = (".jsonl", ".jsonl.gz", ".ndjson")
JSON_FILES = (".json", ".json.gz")
PARQUET_FILES = (".parquet",)
# As help and messages name them: each kind by its first suffix, "(.gz)" where it is read gzip-compressed too;
# FIELD_FILES_SHOWN: the kinds whose records have fields to choose the text from (--calib-field, eval --field).
TEXT_FILES_SHOWN = "/".join(k[0] + "(.gz)" * (k[0] + ".gz" in k)
                            for k in (PLAIN_TEXT_FILES, JSON_LINES_FILES, JSON_FILES, PARQUET_FILES))
FIELD_FILES_SHOWN = "/".join(k[0] for k in (JSON_LINES_FILES, JSON_FILES, PARQUET_FILES))


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
