"""GGUF types: which are written directly, which go through llama.cpp's own quantizer, and what fell back.

F32, F16, BF16 and Q8_0 are plain per-row encodings that gguf-py writes directly while converting. Every
other type (the K-quant mixes, IQ4, the legacy Q4_0...) is made by ``llama_model_quantize`` from
llama-cpp-python's low-level bindings, from an unquantized intermediate GGUF, exactly as llama.cpp's
``llama-quantize`` tool does: same mixes, same per-tensor choices, same code.

A tensor whose rows are not whole blocks of a type cannot take it: llama.cpp silently gives it another type.
:func:`fallbacks` reads the written file back with :class:`gguf.GGUFReader` and names those tensors, so the
summary can say which ones did.

Importance matrices: llama-cpp-python 0.3.36 binds ``llama_model_quantize_params.imatrix`` (applying one) but
nothing that computes one (that is the ``llama-imatrix`` tool, which is not part of the library), so
quantkit does not offer ``--imatrix-calib`` for GGUF.

Tested with llama-cpp-python 0.3.36 and gguf 0.19.0.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantkit.errors import BackendError

# type -> llama.cpp file type (gguf.LlamaFileType member) for the types written directly
DIRECT = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}
# type -> (llama_cpp ftype constant, the ggml type of its bulk tensors, whose block size decides fallbacks)
QUANTIZED = {
    "Q6_K": ("LLAMA_FTYPE_MOSTLY_Q6_K", "Q6_K"),
    "Q5_K_M": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q5_K"),
    "Q5_K_S": ("LLAMA_FTYPE_MOSTLY_Q5_K_S", "Q5_K"),
    "Q5_0": ("LLAMA_FTYPE_MOSTLY_Q5_0", "Q5_0"),
    "Q5_1": ("LLAMA_FTYPE_MOSTLY_Q5_1", "Q5_1"),
    "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K"),
    "Q4_K_S": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q4_K"),
    "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_0"),
    "Q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", "Q4_1"),
    "Q3_K_L": ("LLAMA_FTYPE_MOSTLY_Q3_K_L", "Q3_K"),
    "Q3_K_M": ("LLAMA_FTYPE_MOSTLY_Q3_K_M", "Q3_K"),
    "Q3_K_S": ("LLAMA_FTYPE_MOSTLY_Q3_K_S", "Q3_K"),
    "Q2_K": ("LLAMA_FTYPE_MOSTLY_Q2_K", "Q2_K"),
    "IQ4_XS": ("LLAMA_FTYPE_MOSTLY_IQ4_XS", "IQ4_XS"),
    "IQ4_NL": ("LLAMA_FTYPE_MOSTLY_IQ4_NL", "IQ4_NL"),
}
# Approximate bits per weight of each type (llama.cpp's published sizes), for the free-space estimate.
BITS_PER_WEIGHT = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.6, "Q5_K_M": 5.7, "Q5_K_S": 5.5,
    "Q5_0": 5.5, "Q5_1": 6.0, "Q4_K_M": 4.9, "Q4_K_S": 4.6, "Q4_0": 4.5, "Q4_1": 5.0, "Q3_K_L": 4.3,
    "Q3_K_M": 3.9, "Q3_K_S": 3.5, "Q2_K": 3.4, "IQ4_XS": 4.3, "IQ4_NL": 4.5,
}


def file_type(type_name: str) -> int:
    """The ``general.file_type`` value of a directly written type."""
    import gguf

    return int(getattr(gguf.LlamaFileType, DIRECT[type_name]))


def ggml_type(type_name: str):  # noqa: ANN201 - gguf.GGMLQuantizationType
    import gguf

    return gguf.GGMLQuantizationType[type_name]


@contextmanager
def _captured_llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines instead of letting its per-tensor chatter reach the terminal."""
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        # llama-cpp-python's own forwarding callback (installed at import) goes back in place.
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def quantize(src: Path, dst: Path, type_name: str, nthread: int | None = None) -> None:
    """Quantize an unquantized GGUF into ``type_name`` with llama.cpp's quantizer (its default mix)."""
    import llama_cpp

    ftype_const, _ = QUANTIZED[type_name]
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_const)
    params.nthread = nthread or len(os.sched_getaffinity(0))
    with _captured_llama_log() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.exists():
        tail = "".join(log).strip().splitlines()[-5:]
        raise BackendError(f"llama.cpp could not quantize {src.name} to {type_name} (status {rc}): "
                           + (" | ".join(tail) or "no message"))


def fallbacks(path: Path, type_name: str) -> dict[str, str]:
    """Tensors of a written GGUF that did not get the requested type because of their row size.

    A quantizable tensor (2-D or more, not kept F32) whose row length is not a multiple of the requested
    type's block size cannot hold it; llama.cpp gives it a fallback type, which is what is returned here,
    by tensor name.
    """
    import gguf

    base = ggml_type(QUANTIZED[type_name][1] if type_name in QUANTIZED else type_name)
    block = gguf.GGML_QUANT_SIZES[base][0]
    reader = gguf.GGUFReader(path)
    out: dict[str, str] = {}
    for t in reader.tensors:
        if len(t.shape) < 2 or t.tensor_type in (gguf.GGMLQuantizationType.F32, base):
            continue
        if int(t.shape[0]) % block:
            out[t.name] = t.tensor_type.name
    return out
