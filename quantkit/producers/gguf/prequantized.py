"""A source checkpoint that is already quantized: what llama.cpp's converter makes of it, decided before any work.

llama.cpp's ``convert_hf_to_gguf.py`` (b11312) does three different things with a quantized checkpoint:

* NVFP4 (compressed-tensors ``nvfp4-pack-quantized``, also as ``mixed-precision`` groups that are all NVFP4; ModelOpt
  ``quant_algo`` NVFP4 or W4A16_NVFP4, in ``config.json`` or ``hf_quant_config.json``): it repacks the E2M1 values and
  E4M3 scales bit for bit into ggml's NVFP4 blocks (``_generate_nvfp4_tensors`` in conversion/base.py; the
  compressed-tensors names since upstream #21095, 2026-03), the global scale as a per-tensor ``.scale`` tensor, and
  writes the rest of the checkpoint in the ``--outtype`` asked. The file is the checkpoint, losslessly: GGUF type
  NVFP4 (:data:`quantkit.formats.gguf_types.REPACKED`). Any other type would quantize FP4 weights a second time
  (llama-quantize also refuses to requantize), so it is refused;
* compressed-tensors MXFP4 (``mxfp4-pack-quantized``): repacked only inside the Kimi-K3, DeepSeek-V4 and MiMo model
  classes (their routed experts); for every other architecture the converter raises "Quant format
  'mxfp4-pack-quantized' ... is not yet supported". No llama.cpp pull request found (to 2026-09) converts it for
  a dense model: upstream adds MXFP4 repacking per model class (gpt-oss, DeepSeek-V4, Kimi-K3 merged; Gemma 4's
  ``quant_method: mxfp4``, #24738, open), so quantkit refuses it in one line, with the way that works;
* every other compressed-tensors or ModelOpt format (int4 ``pack-quantized``, FP8 ``float-quantized``, W8A8
  ``int-quantized``, ModelOpt FP8...): dequantized to floats (its ``dequant_model``; ``pack-quantized`` ignores an
  activation-order ``weight_g_idx``), which quantkit would then quantize a second time. Refused: a GGUF is made from
  the unquantized checkpoint.

Other ``quant_method`` values (FP8 releases such as DeepSeek-V3's ``fp8``, GPTQ, AWQ, BitNet, gpt-oss's ``mxfp4``)
are left to the converter, which converts or refuses them itself.

Tested with llama.cpp b11312 (llama-cpp-python 0.3.36's sdist), llm-compressor 0.14.0.1, compressed-tensors 0.19.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.checkpoint import quantization_config, read_config
from quantkit.errors import BackendError, UsageError
from quantkit.formats import gguf_types as types

NVFP4_CT = "nvfp4-pack-quantized"
MXFP4_CT = "mxfp4-pack-quantized"
COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT = "modelopt"
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
REPACKED_TYPE = "NVFP4"  # the GGUF type an NVFP4 checkpoint is repacked into
BUILD = "llama.cpp b11312 (0c1e57098)"


@dataclass(frozen=True)
class Quantized:
    """How a source checkpoint is quantized, as far as llama.cpp's converter cares."""

    producer: str  # COMPRESSED_TENSORS or MODELOPT
    scheme: str  # "nvfp4-pack-quantized", "mxfp4-pack-quantized", "pack-quantized", "FP8"...
    repacks_to: str | None  # the GGUF type the converter repacks it into losslessly, or None

    def describe(self) -> str:
        return f"{self.producer} {self.scheme}"


def _modelopt(path: Path, q: dict[str, Any]) -> dict[str, Any] | None:
    """ModelOpt's quantization section: ``hf_quant_config.json``'s, else config.json's (quant_method modelopt)."""
    hf = read_config(path, "hf_quant_config.json")
    section = hf.get("quantization") if isinstance(hf.get("quantization"), dict) else None
    if section:
        return section
    return q if q.get("quant_method") == MODELOPT else None


def _modelopt_algos(section: dict[str, Any]) -> set[str]:
    """Every quant_algo a ModelOpt section names: the checkpoint's, and each quantized layer's (mixed precision)."""
    algos = {str(section.get("quant_algo"))} if section.get("quant_algo") else set()
    layers = section.get("quantized_layers")
    if isinstance(layers, dict):
        algos |= {str(v.get("quant_algo")) for v in layers.values() if isinstance(v, dict) and v.get("quant_algo")}
    return algos


def of(path: Path) -> Quantized | None:
    """How ``path``'s checkpoint is quantized (compressed-tensors or ModelOpt); None when it is not, or when another
    ``quant_method`` is left to the converter."""
    q = quantization_config(read_config(path))
    if q.get("quant_method") == COMPRESSED_TENSORS:
        fmt = str(q.get("format"))
        groups = q.get("config_groups") if isinstance(q.get("config_groups"), dict) else {}
        formats = {str(g.get("format") or fmt) for g in groups.values() if isinstance(g, dict)} or {fmt}
        if fmt == "mixed-precision" and len(formats) == 1:
            fmt = next(iter(formats))
        if fmt == NVFP4_CT:
            return Quantized(COMPRESSED_TENSORS, fmt, REPACKED_TYPE)
        if fmt == "mixed-precision":
            fmt = "mixed-precision (" + ", ".join(sorted(formats)) + ")"
        return Quantized(COMPRESSED_TENSORS, fmt, None)
    section = _modelopt(path, q)
    if section is not None:
        algos = _modelopt_algos(section)
        if algos and algos <= set(NVFP4_ALGOS):
            return Quantized(MODELOPT, "/".join(sorted(algos)), REPACKED_TYPE)
        return Quantized(MODELOPT, "/".join(sorted(algos)) or "unknown quant_algo", None)
    return None


def check(path: Path, spec_name: str, architecture: str, wanted: list[str]) -> Quantized | None:
    """Refuse, in one line and before any work, what llama.cpp's converter cannot make right from this checkpoint
    (UsageError, exit 2); returns how it is quantized (None: not)."""
    found = of(path)
    repack = [t for t in wanted if types.get(t).repacked]
    if found is None:
        if repack:
            raise UsageError(
                f"GGUF {', '.join(repack)} is written only by repacking a checkpoint already in that format, and "
                f"{spec_name} is not quantized: {BUILD}'s llama-quantize has no {repack[0]} type",
                hint=f"make it NVFP4 first (quantkit nvfp4 {spec_name} OUT), then run quantkit gguf OUT ... -t "
                     f"{repack[0]}; or choose a type llama.cpp quantizes (Q4_K_M, MXFP4_MOE for a mixture of experts)")
        return None
    if found.repacks_to is not None:
        others = [t for t in wanted if t != found.repacks_to]
        if others:
            raise UsageError(
                f"{spec_name} is already quantized ({found.describe()}): llama.cpp's converter repacks it into GGUF "
                f"{found.repacks_to} without loss, and {', '.join(others)} would quantize its 4-bit weights a second "
                "time", hint=f"pass -t {found.repacks_to}; for other types convert the unquantized checkpoint")
        return found
    if found.scheme == MXFP4_CT:
        raise UsageError(
            f"{spec_name} is compressed-tensors MXFP4: {BUILD}'s converter repacks MXFP4 only for the experts of "
            f"Kimi-K3, DeepSeek-V4 and MiMo, not for {architecture}, and no later llama.cpp build is known to",
            hint=f"convert the unquantized checkpoint with -t MXFP4_MOE (MXFP4 experts of a mixture of experts) or "
                 f"-t Q4_K_M; or make it NVFP4 (quantkit nvfp4) and convert that with -t {REPACKED_TYPE}")
    raise UsageError(
        f"{spec_name} is already quantized ({found.describe()}): llama.cpp's converter would dequantize it and GGUF "
        "would quantize it a second time; quantkit makes GGUF from unquantized weights (or repacks NVFP4)",
        hint="convert the unquantized checkpoint it was made from")


def record(found: Quantized, path: Path) -> dict[str, Any]:
    """The manifest's account of a repacked file, read back from it: where its weights came from and its tensor
    types. BackendError when the converter wrote no tensor of the repacked type, or another file type (a file
    named NVFP4 that is not must never be left)."""
    import gguf

    assert found.repacks_to is not None
    reader = gguf.GGUFReader(path)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    field = reader.fields.get("general.file_type")
    file_type = int(field.contents()) if field is not None else None
    want = types.get(found.repacks_to)
    if not counts.get(want.bulk) or file_type != want.ftype_id:
        raise BackendError(f"llama.cpp's converter did not repack {found.describe()} into {want.name}: the file has "
                           f"file type {file_type} and tensors {counts}")
    return {"from": found.describe(), "tensor_types": dict(sorted(counts.items()))}
