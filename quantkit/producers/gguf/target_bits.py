"""A bits target for GGUF: llama.cpp's own type mix, with the layers that cost the most raised to Q8_0.

``quantkit gguf MODEL OUT -t Q4_K_M --target-bits 5.5`` first makes the requested type as llama.cpp always does (its
mix, its row-size fallbacks, the importance matrix when one is given), then spends the bits left up to the target
where they buy the most, by the same measured sensitivity as the compressed-tensors bits target
(:mod:`quantkit.producers.mixed`):

1. each layer group's KLD at int4 round-to-nearest in groups of 32 (asymmetric, like Q4_K's and Q5_0's blocks) is
   measured in transformers on the calibration tokens;
2. what llama.cpp's file actually does to each tensor is read back: its relative squared error against the
   unquantized intermediate (gguf-py dequantizes every type), so a group llama.cpp already keeps at 6 bits
   (``attn_v``) is worth little and a group that fell back to Q5_0 is priced as Q5_0;
3. a group's KLD at the file's types is estimated as its int4 KLD scaled by the ratio of those errors, and groups
   are raised to Q8_0 by most KLD saved per extra bit, the mix within the tolerance of the target
   (:func:`quantkit.producers.mixed.pick`, which refuses a target no mix comes near before the file is made again);
4. ``llama-quantize --tensor-type-file`` makes the file again with those tensors at Q8_0 (and the same matrix);
   its bits per weight over the block matrices are counted from the file (tensor data bytes over weights) and the
   run fails, nothing written, when they are more than :data:`quantkit.producers.mixed.TOLERANCE` off.

The bits are those of the transformer blocks' matrices (what the target controls; ``token_embd`` and ``output``
keep llama.cpp's choice). The plan, every group's measurements and the measured bits go into the manifest.

A target below what the type's mix spends is refused before any work, from the tensor shapes in the converter's
plan (:func:`floor_bits`: the least the mix can spend, its raises left out), and, for what only the made file shows,
right after the type is made, before anything is measured.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.devices import cores
from quantkit.errors import UsageError
from quantkit.producers import mixed
from quantkit.formats import gguf_types as types
from quantkit.producers.gguf import tools

HIGH_TYPE = "Q8_0"
HIGH_BITS = 8.5  # Q8_0: 32 int8 values and one f16 scale per block
PROXY_GROUP = 32  # the int4 proxy's group: the 32-weight blocks of Q4_K's sub-blocks, Q4_0/Q5_0 and IQ4_NL
_BLOCK_MATRIX = re.compile(r"blk\.\d+\..+\.weight$")

# What llama.cpp's quantizer (b11312, src/llama-quant.cpp) does that the least a type's mix spends depends on:
# the mixes of IQ3_XS and IQ3_XXS give some block matrices a type below the bulk one (attn_q and attn_k, and IQ3_XS's
# middle ffn_gate and ffn_up, at IQ3_XXS; IQ3_XXS's attn_q and attn_k at IQ2_S), every other choice of a mix raises a
# tensor above it; and a tensor whose rows are not whole blocks of its type falls back to a type of 32-weight blocks
# (F16 where even those do not fit), never to fewer bits.
_BELOW_BULK = {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}
_FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
             "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
             "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def check(spec: Any, tensors: list[Any]) -> None:
    """Refuse, before any work, a request the bits target cannot serve: one llama.cpp-made type below Q8_0, and a
    target between the least that type's mix spends on this model's block matrices (:func:`floor_bits`, from the
    shapes in the converter's plan, ``tensors``) and Q8_0's bits. ``--dry-run`` runs it too."""
    wanted = [types.get(t) for t in types.validate(list(spec.types))]
    if len(wanted) != 1 or not wanted[0].quantized_by_llama_cpp or wanted[0].bits >= HIGH_BITS:
        raise UsageError("--target-bits raises layers of one llama.cpp type (its mix) to Q8_0; it needs exactly "
                         "one --type below 8 bits that llama.cpp quantizes",
                         hint="e.g. -t Q4_K_M --target-bits 5.5")
    if spec.target_bits >= HIGH_BITS + mixed.TOLERANCE:
        raise UsageError(f"--target-bits {spec.target_bits:g} is above Q8_0's {HIGH_BITS} bits per weight, the most "
                         "the mix raises a layer to", hint="use -t Q8_0 for 8-bit everywhere")
    floor = floor_bits(wanted[0].name, tensors)
    if spec.target_bits < floor - mixed.TOLERANCE:
        raise UsageError(f"--target-bits {spec.target_bits:g} is below what {wanted[0].name}'s mix spends here: at "
                         f"least {floor:.2f} bits per weight in the block matrices ({wanted[0].bulk} and its "
                         "fallbacks, from the tensor shapes; the mix raises some tensors above that)",
                         hint=f"choose a target of at least {floor:.2f}, or a smaller --type")
    tools.require("llama-quantize", "quantizing to a bits target")


def floor_bits(type_name: str, tensors: list[Any]) -> float:
    """The least a type's mix can spend on the block matrices (``blk.N.*.weight``, 2-D or more) of a file planned as
    ``tensors`` (name and shape, outermost axis first), in bits per weight, from the shapes alone: each matrix at the
    lowest type the mix gives any (the bulk type, or :data:`_BELOW_BULK`'s), or the type llama.cpp falls back to
    when its rows are not whole blocks of that (:data:`_FALLBACK`). The mix's own raises (attn_v, ffn_down...) are
    left out, so the file spends this or more: a target below it cannot be met, whatever the measurement finds."""
    import gguf

    def bits(name: str) -> float:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        return size * 8 / block

    def fits(name: str, cols: int) -> bool:
        return cols % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0] == 0

    row = types.get(type_name)
    low = _BELOW_BULK.get(row.name, row.bulk)
    weights = stored = 0.0
    for t in tensors:
        if not _BLOCK_MATRIX.match(t.name) or len(t.shape) < 2:
            continue
        cols, n = int(t.shape[-1]), math.prod(int(d) for d in t.shape)
        kind = low if fits(low, cols) else _FALLBACK.get(low, "F16")
        weights += n
        stored += n * (bits(kind) if fits(kind, cols) else 16.0)
    return stored / weights if weights else 0.0


@dataclass(frozen=True)
class Tensor:
    """A block matrix of a GGUF file: its ggml type, stored bytes and weights."""

    type: str
    nbytes: int
    weights: int


def block_matrices(path: Path) -> dict[str, Tensor]:
    """The transformer blocks' matrices of a GGUF file (2-D or more, ``blk.N.*.weight``)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {t.name: Tensor(t.tensor_type.name, int(t.n_bytes), int(t.n_elements)) for t in reader.tensors
            if _BLOCK_MATRIX.match(t.name) and len(t.shape) >= 2}


def file_bits(path: Path) -> float:
    """Bits per weight of a GGUF file's block matrices, counted from its tensors' stored bytes."""
    found = block_matrices(path)
    return sum(t.nbytes for t in found.values()) * 8 / sum(t.weights for t in found.values())


def relative_errors(quantized: Path, reference: Path, names: set[str]) -> dict[str, float]:
    """||dequantized - reference||^2 / ||reference||^2 of each named tensor, read with gguf-py (every type).

    Relative squared error does not change when the converter reorders a matrix's rows (its rotary permutation of
    attn_q/attn_k), so it compares with the same measure on the Hugging Face weights."""
    import gguf
    import numpy as np

    def arrays(path: Path) -> dict[str, Any]:
        return {t.name: t for t in gguf.GGUFReader(path).tensors if t.name in names}

    q, ref = arrays(quantized), arrays(reference)
    out = {}
    for name in names:
        a = gguf.quants.dequantize(q[name].data, q[name].tensor_type).astype(np.float64).ravel()
        b = gguf.quants.dequantize(ref[name].data, ref[name].tensor_type).astype(np.float64).ravel()
        out[name] = float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))
    return out


def plan(model: Any, convert_plan: Any, base: Path, intermediate: Path, target: float, samples: list[list[int]],
         reporter: Any) -> tuple[dict[str, Any], list[str]]:
    """Measure, estimate and choose; returns the manifest record and every block matrix's type: Q8_0 for those
    raised, the type the mix gave it in ``base`` for the rest. A target below what the mix spends in ``base`` (the
    exact figure, which :func:`check`'s floor bounds from below) is refused first, before anything is measured."""
    import torch

    in_file = block_matrices(base)
    weights = sum(t.weights for t in in_file.values())
    stored = sum(8 * t.nbytes for t in in_file.values())
    base_bits = stored / weights
    if target < base_bits - mixed.TOLERANCE:  # the mix's raises, which check()'s floor leaves out
        raise UsageError(f"--target-bits {target:g} is below what the requested type's mix already spends here "
                         f"({base_bits:.2f} bits per weight in the block matrices)",
                         hint=f"choose a target of at least {base_bits:.2f}, or a smaller --type")
    found = [u for u in mixed.units(model, ["lm_head"]) if all(
        convert_plan.gguf_name(m) in in_file for m in u.modules)]
    names = {m: convert_plan.gguf_name(m) for u in found for m in u.modules}
    t0 = time.monotonic()
    with reporter.bar(f"Measuring the 4-bit KLD of {len(found)} layer groups", len(found)) as task:
        measured, sensitivity = mixed.measure(model, found, samples,
                                              mixed.int_precision(mixed.LOW_BITS, PROXY_GROUP, False), task.advance)
    modules = dict(model.named_modules())
    proxy = {}
    for m, gguf_name in names.items():
        w = modules[m].weight.data.float()
        dq = mixed.fake_quantize(w, mixed.LOW_BITS, PROXY_GROUP, False).float()
        proxy[gguf_name] = float(((dq - w) ** 2).sum() / torch.clamp((w ** 2).sum(), min=1e-30))
    actual = relative_errors(base, intermediate, set(names.values()))
    gain, extra, rows = {}, {}, []
    for u in measured:
        tensors = [names[m] for m in u.modules]
        scale = sum(actual[t] * in_file[t].weights for t in tensors) / max(
            sum(proxy[t] * in_file[t].weights for t in tensors), 1e-30)
        gain[u.name] = u.kld * scale
        extra[u.name] = sum(HIGH_BITS * in_file[t].weights - 8 * in_file[t].nbytes for t in tensors)
        rows.append({"name": u.name, "tensors": tensors, "params": u.params, "kld_int4": u.kld,
                     "types": sorted({in_file[t].type for t in tensors}), "error_ratio": scale,
                     "kld_estimated": gain[u.name]})
    high = mixed.pick({k: v for k, v in gain.items() if extra[k] > 0}, extra, stored, weights, target)
    raised = {t for r in rows if r["name"] in high for t in r["tensors"]}
    for r in rows:
        r["type"] = HIGH_TYPE if r["name"] in high else "+".join(r["types"])
    record = {"target_bits": target, "base_bits": round(base_bits, 4), "high_type": HIGH_TYPE,
              "planned_bits": round((stored + sum(extra[n] for n in high)) / weights, 4),
              "units_at_high": len(high), "units": len(rows),
              "estimated_kld": round(sum(v for k, v in gain.items() if k not in high), 5),
              "estimated_kld_base": round(sum(gain.values()), 5),
              "sensitivity": {**sensitivity, "proxy": f"round-to-nearest int4 groups of {PROXY_GROUP} asymmetric, "
                                                      "scaled by each tensor's error in the file",
                              "seconds": round(time.monotonic() - t0, 1)},
              "plan": rows}
    return record, {n: HIGH_TYPE if n in raised else t.type for n, t in sorted(in_file.items())}


def requantize(intermediate: Path, dest: Path, type_name: str, assignment: dict[str, str], imatrix: Path | None,
               work: Path) -> None:
    """``llama-quantize --tensor-type-file``: every block matrix at the type :func:`plan` gave it (same importance
    matrix).

    The ones not raised are named too, at the type the mix gave them: llama.cpp's mix counts the tensors it chooses
    for (``use_more_bits`` over the ffn_down and attn_v it has seen), so tensors taken out of it would shift which of
    the rest it keeps at 6 bits."""
    listing = work / ".tensor-types.txt"
    listing.write_text("".join(f"^{re.escape(n)}$={t.lower()}\n" for n, t in assignment.items()))
    args = ["--tensor-type-file", str(listing)] + (["--imatrix", str(imatrix)] if imatrix else [])
    try:
        tools.run("llama-quantize", [*args, str(intermediate), str(dest), types.get(type_name).name,
                                     str(cores())], purpose=f"quantizing {type_name} to the bits target")
    finally:
        listing.unlink(missing_ok=True)
