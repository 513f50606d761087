"""GGUF for llama.cpp: convert a Hugging Face checkpoint once, then quantize it into each requested type.

The artifact folder holds one ``<model>-<TYPE>.gguf`` per requested type. F32/F16/BF16/Q8_0 are written directly
by the converter (:mod:`.convert`); every other type is made by llama.cpp's own quantizer (:mod:`.quantize`)
from one unquantized intermediate: a requested F32/BF16/F16 file when there is one, otherwise a lossless file of
the checkpoint's own precision, deleted once the quantized files exist.

Tested with gguf 0.19.0, llama-cpp-python 0.3.36, transformers 5.17.0, torch 2.13.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantkit.errors import SourceModelError, UsageError
from quantkit.producers.base import ProduceContext, Produced
from quantkit.producers.gguf import convert, families, metadata, quantize, tokenizer
from quantkit.source import SourceModel

# Preferred intermediate among requested unquantized types: the most precise one.
_INTERMEDIATE_ORDER = ("F32", "BF16", "F16")


def model_name(source: SourceModel) -> str:
    """The file-name stem: the checkpoint folder's or hub repo's name, in safe characters."""
    raw = Path(source.spec.rstrip("/")).name or source.path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-.") or "model"


def _ordered(types: list[str]) -> list[str]:
    return list(dict.fromkeys(types))


class GgufProducer:
    """The ``gguf`` method."""

    def check(self, spec: Any, source: SourceModel) -> None:
        """Refuse, before any weight is read, everything the conversion would otherwise fail on half-way."""
        if spec.imatrix:
            raise UsageError(
                "--imatrix-calib is not available for GGUF: llama-cpp-python 0.3.36 can apply an importance "
                "matrix but has no maintained way to compute one",
                hint="compute one with llama.cpp's llama-imatrix tool and quantize with llama-quantize, or drop "
                     "--imatrix-calib")
        if spec.ignore:
            raise UsageError("--ignore is not supported for GGUF: llama.cpp's type mixes decide per tensor",
                             hint="pick a higher-precision --type (Q6_K, Q8_0) instead")
        if source.is_pickle:
            raise SourceModelError(f"{source.path} holds pickle weights; GGUF conversion reads safetensors only",
                                   hint="convert the checkpoint to safetensors first")
        family = families.resolve(source.config)
        metadata.from_config(metadata.load_config(source.path), family)
        tokenizer.inspect(source.path)
        for t in spec.types:
            if t not in quantize.DIRECT and t not in quantize.QUANTIZED:
                raise UsageError(f"GGUF type {t} is not supported",
                                 hint=f"choose from {', '.join([*quantize.DIRECT, *quantize.QUANTIZED])}")

    def estimate_bytes(self, spec: Any, source: SourceModel) -> int:
        """Every requested file, plus the intermediate that sits beside them until the quantizer is done."""
        types = _ordered(spec.types)
        bits = sum(quantize.BITS_PER_WEIGHT[t] for t in types)
        if any(t in quantize.QUANTIZED for t in types) and not any(t in _INTERMEDIATE_ORDER for t in types):
            bits += 16.0  # the intermediate lives in the folder until the quantized files exist
        return int(source.num_parameters * bits / 8) + (64 << 20)

    def produce(self, ctx: ProduceContext) -> Produced:
        """Convert each directly written type (and the intermediate), then quantize the others from it."""
        spec, source, rep = ctx.spec, ctx.source, ctx.reporter
        family = families.resolve(source.config)
        hp = metadata.from_config(metadata.load_config(source.path), family)
        name = model_name(source)
        types = _ordered(spec.types)
        direct = [t for t in types if t in quantize.DIRECT]
        to_quantize = [t for t in types if t in quantize.QUANTIZED]
        intermediate = None
        if to_quantize:
            intermediate = next((t for t in _INTERMEDIATE_ORDER if t in direct),
                                convert.source_type(source.weight_files))
        paths = {t: ctx.workdir / f"{name}-{t}.gguf" for t in types}
        if intermediate and intermediate not in paths:
            paths[intermediate] = ctx.workdir / f".{name}-{intermediate}.intermediate.gguf"

        fell_back: dict[str, dict[str, str]] = {}
        vocab: tokenizer.Vocab | None = None
        for t in _ordered(([intermediate] if intermediate else []) + direct):
            with rep.timed(f"convert_{t}"):
                done = convert.convert(source.path, source.weight_files, family, hp, paths[t], t, name=name,
                                       reporter=rep)
            vocab, fell_back[t] = done.vocab, done.fallbacks
        for t in to_quantize:
            with rep.step(f"quantize_{t}", f"Quantizing {t} with llama.cpp (from {intermediate})"):
                quantize.quantize(paths[intermediate], paths[t], t)
            with rep.timed(f"fallbacks_{t}"):
                fell_back[t] = quantize.fallbacks(paths[t], t)
        if intermediate and intermediate not in types:
            paths[intermediate].unlink()

        assert vocab is not None  # at least one file was converted
        notes = list(hp.notes) + list(vocab.notes)
        for t in types:
            if fell_back[t]:
                notes.append(_fallback_note(t, fell_back[t]))
                rep.warn(notes[-1])
        return Produced(
            quantization={
                "scheme": "GGUF " + ", ".join(types),
                "types": types,
                "files": {t: paths[t].name for t in types},
                "fallbacks": {t: fell_back[t] for t in types if fell_back[t]},
                "pre_tokenizer": vocab.pre,
                "tokenizer": vocab.model,
                "architecture": family.gguf_arch.lower(),
                "family": family.key,
                "intermediate": intermediate,
                "imatrix": False,
            },
            notes=notes,
        )


def _fallback_note(type_name: str, tensors: dict[str, str]) -> str:
    shown = ", ".join(f"{n} -> {t}" for n, t in list(tensors.items())[:8])
    more = f" and {len(tensors) - 8} more" if len(tensors) > 8 else ""
    return (f"{type_name}: {len(tensors)} tensor(s) could not take {type_name} because of their row size and fell "
            f"back, as llama.cpp does: {shown}{more}")


PRODUCER = GgufProducer()
