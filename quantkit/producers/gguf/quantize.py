"""llama.cpp's quantizer: make a type of :mod:`.types` from an unquantized intermediate GGUF, and find fallbacks.

Every type that :mod:`.types` says llama.cpp makes (the K-quant mixes, the I-quants, Q4_0...) is made by
``llama_model_quantize``, exactly as the ``llama-quantize`` tool does: same mixes, same per-tensor choices, same
code. Two ways in, one library:

* without an importance matrix, in-process through llama-cpp-python's bindings (no tool needed: a plain
  ``pip install 'quantkit[gguf]'`` makes every type that needs no matrix);
* with one, by running the ``llama-quantize`` binary that ``make install`` builds from the same llama.cpp
  source (:mod:`.tools`). The bindings could pass the matrix (``llama_model_quantize_params.imatrix`` is a plain
  array of name/values structs in 0.3.36), but the tool is llama.cpp's reference for reading both matrix formats
  (its normalisation of sums by counts, legacy ``.dat`` rescaling) and for recording ``quantize.imatrix.*`` in the
  quantized file, so files made with a matrix are the ones llama.cpp users get from ``llama-quantize
  --imatrix``. It also runs in its own process: the I-quant code aborts the process on some inputs
  (``GGML_ABORT``), which must not take quantkit and its cleanup with it. ``tests/test_gguf_imatrix.py`` checks
  that both ways write identical tensors when no matrix is given.

A tensor whose rows are not whole blocks of a type cannot take it: llama.cpp silently gives it another type.
:func:`fallbacks` reads the written file back with :class:`gguf.GGUFReader` and names those tensors, so the
summary can say which ones did.

Tested with llama-cpp-python 0.3.36, its llama.cpp (b11312) tools, and gguf 0.19.0.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantkit.devices import cores
from quantkit.errors import BackendError
from quantkit.formats import gguf_types as types
from quantkit.producers.gguf import tools



def file_type(type_name: str) -> int:
    """The ``general.file_type`` value of a type (llama.cpp's ftype)."""
    return types.get(type_name).ftype_id


def ggml_type(type_name: str):  # noqa: ANN201 - gguf.GGMLQuantizationType
    """The ggml type of a type's bulk tensors."""
    import gguf

    return gguf.GGMLQuantizationType[types.get(type_name).bulk]


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
    """Quantize an unquantized GGUF into ``type_name`` in-process (llama.cpp's default mix, no matrix)."""
    import llama_cpp

    t = types.get(type_name)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = t.ftype_id
    params.nthread = nthread or cores()
    with _captured_llama_log() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.exists():
        tail = "".join(log).strip().splitlines()[-5:]
        raise BackendError(f"llama.cpp could not quantize {src.name} to {type_name} (status {rc}): "
                           + (" | ".join(tail) or "no message"))


def quantize_with_imatrix(src: Path, dst: Path, type_name: str, imatrix: Path, nthread: int | None = None) -> str:
    """Quantize with ``llama-quantize --imatrix``; returns the tool's output (its log of every tensor)."""
    t = types.get(type_name)
    proc = tools.run("llama-quantize", ["--imatrix", str(imatrix), str(src), str(dst), t.name,
                                        str(nthread or cores())],
                     purpose=f"quantizing {type_name} with an importance matrix")
    if not dst.exists():
        raise BackendError(f"llama-quantize exited without writing {dst.name}: "
                           f"{tools.tail(proc.stdout + proc.stderr, 5)}")
    return proc.stdout + proc.stderr


def fallbacks(path: Path, type_name: str) -> dict[str, str]:
    """Tensors of a written GGUF that did not get the requested type because of their row size.

    A quantizable tensor (2-D or more, not kept F32) whose row length is not a multiple of the requested
    type's block size cannot hold it; llama.cpp gives it a fallback type, which is what is returned here,
    by tensor name. A repacked type (NVFP4) has none: the converter repacks exactly the tensors the checkpoint
    quantized, and writes the others as the checkpoint holds them.
    """
    import gguf

    if types.get(type_name).repacked:
        return {}
    base = ggml_type(type_name)
    block = gguf.GGML_QUANT_SIZES[base][0]
    reader = gguf.GGUFReader(path)
    out: dict[str, str] = {}
    for t in reader.tensors:
        if len(t.shape) < 2 or t.tensor_type in (gguf.GGMLQuantizationType.F32, base):
            continue
        if int(t.shape[0]) % block:
            out[t.name] = t.tensor_type.name
    return out
