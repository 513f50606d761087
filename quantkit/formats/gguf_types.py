"""THE table of GGUF types: every type llama.cpp's quantizer offers, and how quantkit makes each one.

One row per type, spelled as ``llama-quantize`` spells it: who writes it (quantkit's converter writes the plain
per-row encodings directly while converting; llama.cpp's quantizer makes every mix from an unquantized
intermediate), its llama.cpp file type (``LLAMA_FTYPE_*`` name and value, llama.h of llama-cpp-python 0.3.36's
llama.cpp, b11312), the ggml type of its bulk tensors (a tensor that ends up with neither that type nor F32 fell
back because of its row size), approximate bits per weight (for the free-space estimate), and whether llama.cpp
refuses to make it without an importance matrix. That last column is llama.cpp's own rule
(``tensor_requires_imatrix`` in src/llama-quant.cpp): a type needs one when its mix gives some tensor IQ1_S,
IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S or IQ3_XXS (IQ3_XS does: its attention q/k are IQ3_XXS), or Q2_K inside Q2_K_S.
IQ3_S/IQ3_M/IQ4_XS/IQ4_NL can be made without one (llama.cpp allows it); they are better with one.
``tests/test_gguf_imatrix.py`` checks every column against the built ``llama-quantize``.

MXFP4_MOE is for mixture-of-experts models: its expert tensors (3-D, one slice per expert) are MXFP4 and every other
tensor Q8_0, ``output`` and ``token_embd`` included (``llama_tensor_get_type_impl`` in src/llama-quant.cpp), so a
dense model comes out Q8_0 throughout, byte for byte llama.cpp's Q8_0 (measured: tests/test_gguf_fp4.py). The
aliases llama-quantize accepts (Q3_K, Q4_K, Q5_K for the _M mixes) resolve to their mix. ``COPY`` is not a type (it
copies tensors). Q2_0 is listed and refused: gguf-py 0.19.0, which quantkit reads GGUF files with (inspect, verify,
evaluate, fallback detection), cannot read Q2_0 tensors.

NVFP4 (``REPACKED``) is not offered by llama-quantize (b11312 has the file type, ``LLAMA_FTYPE_MOSTLY_NVFP4``, but
no quantizer for it): llama.cpp's converter writes it only by repacking a checkpoint that already holds NVFP4 weights
(compressed-tensors ``nvfp4-pack-quantized``, ModelOpt NVFP4), bit for bit, the rest of the checkpoint in its own
precision; :mod:`quantkit.producers.gguf.prequantized` says which checkpoints those are.

On the bottom floor, in the formats registry: the recipe's validator (:class:`quantkit.formats.specs.GgufSpec`) and
the GGUF producer both read it. Standard library only: the recipe's validator and ``--help`` import this without
loading gguf, llama_cpp or torch.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

CONVERTER = "converter"  # written directly by llama.cpp's converter from the checkpoint's weights
LLAMA_CPP = "llama.cpp"  # made by llama.cpp's quantizer from an unquantized intermediate
REPACK = "repack"  # written by llama.cpp's converter from a checkpoint already quantized in this format


@dataclass(frozen=True)
class GgufType:
    """One GGUF type and how quantkit makes it."""

    name: str
    made_by: str  # CONVERTER, LLAMA_CPP or REPACK
    ftype: str  # llama.cpp's LLAMA_FTYPE_<ftype> (gguf.LlamaFileType member name)
    ftype_id: int  # its value in llama.h
    bulk: str  # ggml type of the bulk of its tensors (gguf.GGMLQuantizationType member name)
    bits: float  # approximate bits per weight of the whole file
    needs_imatrix: bool = False
    refused: str | None = None  # why quantkit will not make it, when it will not

    @property
    def quantized_by_llama_cpp(self) -> bool:
        return self.made_by == LLAMA_CPP

    @property
    def repacked(self) -> bool:
        """Written only from a checkpoint whose weights are already in this format (never from float weights)."""
        return self.made_by == REPACK


def _t(name: str, made_by: str, ftype_id: int, bulk: str, bits: float, needs_imatrix: bool = False,
       ftype: str | None = None, refused: str | None = None) -> GgufType:
    return GgufType(name, made_by, ftype or f"MOSTLY_{name}", ftype_id, bulk, bits, needs_imatrix, refused)


_ROWS = (
    _t("F32", CONVERTER, 0, "F32", 32.0, ftype="ALL_F32"),
    _t("F16", CONVERTER, 1, "F16", 16.0),
    _t("BF16", CONVERTER, 32, "BF16", 16.0),
    _t("Q8_0", CONVERTER, 7, "Q8_0", 8.5),
    _t("Q6_K", LLAMA_CPP, 18, "Q6_K", 6.6),
    _t("Q5_K_M", LLAMA_CPP, 17, "Q5_K", 5.7),
    _t("Q5_K_S", LLAMA_CPP, 16, "Q5_K", 5.5),
    _t("Q5_1", LLAMA_CPP, 9, "Q5_1", 6.0),
    _t("Q5_0", LLAMA_CPP, 8, "Q5_0", 5.5),
    _t("Q4_K_M", LLAMA_CPP, 15, "Q4_K", 4.9),
    _t("Q4_K_S", LLAMA_CPP, 14, "Q4_K", 4.6),
    _t("Q4_1", LLAMA_CPP, 3, "Q4_1", 5.0),
    _t("Q4_0", LLAMA_CPP, 2, "Q4_0", 4.5),
    _t("IQ4_NL", LLAMA_CPP, 25, "IQ4_NL", 4.6),
    _t("IQ4_XS", LLAMA_CPP, 30, "IQ4_XS", 4.4),
    _t("MXFP4_MOE", LLAMA_CPP, 38, "MXFP4", 8.5),  # MXFP4 experts; every other tensor (all of a dense model) Q8_0
    _t("Q3_K_L", LLAMA_CPP, 13, "Q3_K", 4.3),
    _t("Q3_K_M", LLAMA_CPP, 12, "Q3_K", 3.9),
    _t("Q3_K_S", LLAMA_CPP, 11, "Q3_K", 3.5),
    _t("IQ3_M", LLAMA_CPP, 27, "IQ3_S", 3.8),
    _t("IQ3_S", LLAMA_CPP, 26, "IQ3_S", 3.6),
    _t("IQ3_XS", LLAMA_CPP, 22, "IQ3_S", 3.4, needs_imatrix=True),  # its attn_q/attn_k and middle ffns are IQ3_XXS
    _t("IQ3_XXS", LLAMA_CPP, 23, "IQ3_XXS", 3.2, needs_imatrix=True),
    _t("Q2_K", LLAMA_CPP, 10, "Q2_K", 3.4),
    _t("Q2_K_S", LLAMA_CPP, 21, "Q2_K", 3.1, needs_imatrix=True),
    _t("IQ2_M", LLAMA_CPP, 29, "IQ2_S", 2.9, needs_imatrix=True),
    _t("IQ2_S", LLAMA_CPP, 28, "IQ2_XS", 2.7, needs_imatrix=True),
    _t("IQ2_XS", LLAMA_CPP, 20, "IQ2_XS", 2.5, needs_imatrix=True),
    _t("IQ2_XXS", LLAMA_CPP, 19, "IQ2_XXS", 2.3, needs_imatrix=True),
    _t("TQ2_0", LLAMA_CPP, 37, "TQ2_0", 2.3),
    _t("Q2_0", LLAMA_CPP, 41, "Q2_0", 2.5,
       refused="gguf-py 0.19.0 cannot read Q2_0 tensors, so quantkit could not inspect, verify or evaluate the file"),
    _t("IQ1_M", LLAMA_CPP, 31, "IQ1_M", 2.0, needs_imatrix=True),
    _t("TQ1_0", LLAMA_CPP, 36, "TQ1_0", 1.9),
    _t("IQ1_S", LLAMA_CPP, 24, "IQ1_S", 1.8, needs_imatrix=True),
    _t("Q1_0", LLAMA_CPP, 40, "Q1_0", 1.4),
)

# NVFP4's bits: 16 E2M1 values share an E4M3 scale, four scales and 64 values a 36-byte block (4.5 bits per weight);
# what is not NVFP4 in the checkpoint (embeddings, ignored layers) stays in its precision, so a file's bits per
# weight are counted from it
_REPACKED = (
    _t("NVFP4", REPACK, 39, "NVFP4", 4.5),
)

TYPES: dict[str, GgufType] = {t.name: t for t in _ROWS}  # what llama-quantize offers (and the converter writes)
REPACKED: dict[str, GgufType] = {t.name: t for t in _REPACKED}  # only repacked from a checkpoint in that format
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
NAMES = tuple(TYPES)
_ALL: dict[str, GgufType] = {**TYPES, **REPACKED}


def canonical(name: str) -> str:
    """The table's spelling of a type name (any case, llama-quantize's aliases); ValueError if unknown."""
    upper = name.strip().upper()
    upper = ALIASES.get(upper, upper)
    if upper not in _ALL:
        raise _unknown([name])
    return upper


def get(name: str) -> GgufType:
    """The row of a type (any spelling :func:`canonical` accepts)."""
    return _ALL[canonical(name)]


def validate(names: list[str]) -> list[str]:
    """Canonical names of a list of requested types, for the recipe's validator (ValueError names the bad ones)."""
    bad = [n for n in names if n.strip().upper() not in _ALL and n.strip().upper() not in ALIASES]
    if bad:
        raise _unknown(bad)
    return [canonical(n) for n in names]


def _unknown(bad: list[str]) -> ValueError:
    """Unknown type names, each with the nearest names there are, then what can be chosen: the types quantkit makes
    (not one it always refuses) and a repacked type as what it is, so the list offers nothing that is then refused."""
    offered = [t.name for t in _ROWS if not t.refused]

    def named(name: str) -> str:
        close = difflib.get_close_matches(name.strip().upper(), [*offered, *REPACKED], n=3)
        return f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")

    repacked = ", ".join(f"{n} from an {n} checkpoint only" for n in REPACKED)
    return ValueError(f"unknown GGUF type{'s' if len(bad) > 1 else ''} {', '.join(named(n) for n in bad)}; the "
                      f"types: {', '.join(offered)}; {repacked}")
