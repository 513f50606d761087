"""GGUF for llama.cpp: convert a Hugging Face checkpoint once, then quantize it into each requested type.

The artifact folder holds one ``<model>-<TYPE>.gguf`` per requested type. Which types exist and how each is made
is :mod:`.types`'s table: F32/F16/BF16/Q8_0 are written directly by llama.cpp's own converter (:mod:`.convert`,
``convert_hf_to_gguf.py`` from the sdist the tools are built from: every architecture it converts); every other
type is made by llama.cpp's own quantizer (:mod:`.quantize`) from one unquantized intermediate: a requested
F32/BF16/F16 file when there is one, otherwise a lossless file of the checkpoint's own precision, deleted once the
quantized files exist.

With an importance matrix (``spec.imatrix``: computed from the recipe's calibration set, see :mod:`.collect`, per
expert for mixture-of-experts models; or ``spec.imatrix_file``: one made elsewhere, GGUF or legacy ``.dat``, see
:mod:`.imatrix`), every type llama.cpp quantizes is made with it by ``llama-quantize --imatrix``, and the matrix is
shipped in the artifact as ``imatrix/<model>.imatrix.gguf`` (or ``.dat``; in a subfolder so nothing takes it for a
model file) with its sha256, the calibration tokens' sha256 and the tool's version in the manifest (and, for an
MoE model, the calibration tokens each expert got). Types llama.cpp cannot make without one (IQ1/IQ2, IQ3_XXS,
Q2_K_S) are refused without one, before any work.

The converter's plan of the file (:func:`.convert.plan`: no weight read) is made in :meth:`GgufProducer.check`,
so an architecture, tokenizer or tensor it cannot take is refused before any work; the importance matrix is named
and checked against it. What the flags alone decide (the types, the importance matrix asked for, its file there) is
refused before the plan, a subprocess of seconds.

A checkpoint already quantized is refused before any work, except an NVFP4 one (compressed-tensors or ModelOpt),
which llama.cpp's converter repacks without loss into GGUF type NVFP4 (:mod:`.prequantized`; the manifest's
``repacked`` says from what, with the file's tensor types).

A vision-language model (``vision_config``) is its language model, made as above (the importance matrix and the
bits target measured on it), plus its vision side as llama.cpp's ``mmproj`` file in F16 (:mod:`.mmproj`:
``mmproj/mmproj-<model>-F16.gguf``, named in the manifest's ``quantization.mmproj``), planned in ``check`` too.

Tested with gguf 0.19.0, llama-cpp-python 0.3.36 and its llama.cpp's tools and converter (b11312),
transformers 5.17.0, torch 2.13.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import SourceModelError, UsageError
from quantkit.producers import mixed, moe
from quantkit.producers.base import ProduceContext, Produced
from quantkit.formats import gguf_types as types
from quantkit.producers.gguf import (collect, convert, guards, imatrix, mmproj, prequantized, quantize, target_bits,
                                     tools)
from quantkit.seal import sha256_file  # the manifest's own file hash
from quantkit.source import SourceModel, load_tokenizer, tokenizer_file

# Preferred intermediate among requested unquantized types: the most precise one.
_INTERMEDIATE_ORDER = ("F32", "BF16", "F16")
# Room for what llama.cpp writes beside the files as it works (the converter's and the quantizer's own files)
_WORKING_MARGIN = 64 << 20
IMATRIX_DIR = "imatrix"


def model_name(source: SourceModel) -> str:
    """The file-name stem: the checkpoint folder's or hub repo's name, in safe characters."""
    raw = Path(source.spec.rstrip("/")).name or source.path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-.") or "model"


def _ordered(spec: Any) -> list[str]:
    """The requested types in table spelling, first occurrence kept."""
    try:
        return list(dict.fromkeys(types.validate(list(spec.types))))
    except ValueError as e:
        raise UsageError(str(e)) from None


def imatrix_request(spec: Any) -> tuple[bool, Path | None]:
    """(compute one from the calibration set, a file to use). ``imatrix_file`` is read with a default until the
    recipe's GGUF spec has the field (the formats registry adds it)."""
    given = getattr(spec, "imatrix_file", None)
    return bool(spec.imatrix), Path(given).expanduser() if given else None


def _check_request(spec: Any) -> list[types.GgufType]:
    """The requested types' rows, once what the command line alone decides is sound: no --ignore, no type quantkit
    refuses, an importance matrix asked for one way, that exists, for types that use one, and given to those that
    need one. Asked before the source's checks and the converter's plan, so a mistyped flag is refused at once."""
    if spec.ignore:
        raise UsageError("--ignore is not supported for GGUF: llama.cpp's type mixes decide per tensor",
                         hint="pick a higher-precision --type (Q6_K, Q8_0) instead")
    wanted = [types.get(t) for t in _ordered(spec)]
    for t in wanted:
        if t.refused:
            raise UsageError(f"GGUF type {t.name} is not offered: {t.refused}",
                             hint="choose another --type (quantkit gguf --help lists them)")
    compute, given = imatrix_request(spec)
    if compute and given:
        raise UsageError(f"{imatrix.COMPUTE_FLAG} (compute an importance matrix) and {imatrix.FILE_FLAG} (use "
                         "one) were both given", hint=f"pass {imatrix.COMPUTE_FLAG} to compute one from the "
                                                     f"calibration set, or {imatrix.FILE_FLAG} FILE, not both")
    if not (compute or given):
        _refuse_needing_a_matrix(wanted)
        return wanted
    direct = [t.name for t in wanted if not t.quantized_by_llama_cpp]
    if len(direct) == len(wanted):
        raise UsageError(f"an importance matrix is only used by types llama.cpp quantizes, and {_listed(direct)} "
                         f"{'is' if len(direct) == 1 else 'are'} written directly",
                         hint=f"drop {imatrix.COMPUTE_FLAG}/{imatrix.FILE_FLAG}, or add a type llama.cpp "
                              "quantizes (Q4_K_M, IQ4_XS...)")
    if given is not None and not given.is_file():
        _refuse_missing_matrix(given)
    tools.require("llama-quantize", "quantizing with an importance matrix")
    return wanted


def _refuse_needing_a_matrix(wanted: list[types.GgufType]) -> None:
    """Types llama.cpp will not make without an importance matrix, none given: refused, naming both flags."""
    needy = [t.name for t in wanted if t.needs_imatrix]
    if needy:
        one = len(needy) == 1
        raise UsageError(f"GGUF type{'' if one else 's'} {', '.join(needy)} need{'s' if one else ''} an "
                         f"importance matrix: llama.cpp will not make {'it' if one else 'them'} without one",
                         hint=f"add {imatrix.COMPUTE_FLAG} (computed from the calibration set) or "
                              f"{imatrix.FILE_FLAG} FILE (one made by llama-imatrix)")


def _refuse_missing_matrix(given: Path) -> None:
    """An --imatrix-file that is not there: where a relative path was looked for, and the other way to get one."""
    where = "" if given.is_absolute() else f" (looked for in {Path.cwd()})"
    raise UsageError(f"importance matrix {given} does not exist{where}",
                     hint=f"check the path, or pass {imatrix.COMPUTE_FLAG} instead to compute one from the "
                          "calibration set")


def _listed(names: list[str]) -> str:
    """``A``, ``A and B``, ``A, B and C``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class GgufProducer:
    """The ``gguf`` method."""

    def check(self, spec: Any, source: SourceModel) -> None:
        """Refuse, before any weight is read, everything the conversion would otherwise fail on half-way: first what
        the command line alone decides (:func:`_check_request`), then what the source decides, the converter's plan
        of the file last (a subprocess of seconds)."""
        wanted = _check_request(spec)
        if source.is_pickle:
            raise SourceModelError(f"{source.path} holds pickle weights; GGUF conversion reads safetensors only",
                                   hint="convert the checkpoint to safetensors first")
        prequantized.check(source.path, source.spec, source.architecture, [t.name for t in wanted])
        guards.refuse(source.config)
        if spec.target_bits is not None and moe.family(source.config):
            raise UsageError(f"--target-bits plans dense layers; {source.spec} is a mixture-of-experts model",
                             hint="drop --target-bits and choose a --type")
        plan = convert.plan(source.path)
        if spec.target_bits is not None:
            target_bits.check(spec, plan.tensors)
        if mmproj.wanted(source.config):
            mmproj.plan(source.path)
        compute, given = imatrix_request(spec)
        if compute:
            collect.refuse_uncovered(plan, wanted)
        elif given is not None:
            imatrix.check_fits(imatrix.read(given), plan.tensors, given)

    def estimate_bytes(self, spec: Any, source: SourceModel) -> int:
        """The artifact's size on disk: every requested file (its type's bits per weight, and the vocabulary each
        file carries, about the size of the checkpoint's tokenizer file), the vision side's F16 file; a file
        repacked from the checkpoint (NVFP4) is the checkpoint's size. What sits beside the files only while they
        are made is :meth:`working_bytes`."""
        wanted = [types.get(t) for t in _ordered(spec)]
        bits = sum(t.bits for t in wanted if not t.repacked)
        vocabulary = source.path / tokenizer_file(source.path)
        vocabulary_bytes = vocabulary.stat().st_size if vocabulary.is_file() else 0
        vision = mmproj.plan(source.path).parameters * 2 if mmproj.wanted(source.config) else 0
        repacked = source.size_bytes * sum(t.repacked for t in wanted)
        return int(source.num_parameters * bits / 8) + len(wanted) * vocabulary_bytes + repacked + vision

    def working_bytes(self, spec: Any, source: SourceModel) -> int:
        """What is written beside the artifact's files only while they are made, so must be free too (with
        :meth:`estimate_bytes`) but is not part of the artifact: the unquantized intermediate llama.cpp quantizes
        from (a lossless file of the checkpoint's own precision, about its size) unless a requested F32/BF16/F16 file
        serves as it, and a margin for the files llama.cpp writes as it works."""
        wanted = [types.get(t) for t in _ordered(spec)]
        made_here = any(t.quantized_by_llama_cpp for t in wanted) and not any(
            t.name in _INTERMEDIATE_ORDER for t in wanted)
        return (source.size_bytes if made_here else 0) + _WORKING_MARGIN

    def produce(self, ctx: ProduceContext) -> Produced:
        """Make the importance matrix (if asked), convert each directly written type (and the intermediate), then
        quantize the others from it."""
        spec, source, rep = ctx.spec, ctx.source, ctx.reporter
        plan = convert.plan(source.path)
        name = model_name(source)
        wanted = _ordered(spec)
        direct = [t for t in wanted if not types.get(t).quantized_by_llama_cpp]
        to_quantize = [t for t in wanted if types.get(t).quantized_by_llama_cpp]
        im = _importance_matrix(ctx, plan, name) if to_quantize else None
        intermediate = None
        if to_quantize:
            intermediate = next((t for t in _INTERMEDIATE_ORDER if t in direct),
                                convert.source_type(source.weight_files))
        paths = {t: ctx.workdir / f"{name}-{t}.gguf" for t in wanted}
        if intermediate and intermediate not in paths:
            paths[intermediate] = ctx.workdir / f".{name}-{intermediate}.intermediate.gguf"

        fell_back: dict[str, dict[str, str]] = {}
        done: convert.Converted | None = None
        found = prequantized.of(source.path)
        repacked: dict[str, Any] = {}
        for t in _ordered_unique(([intermediate] if intermediate else []) + direct):
            with rep.timed(f"convert_{t}"):
                done = convert.convert(source.path, paths[t], t, name=name, reporter=rep)
            fell_back[t] = done.fallbacks
            if types.get(t).repacked:
                assert found is not None  # prequantized.check
                repacked[t] = prequantized.record(found, paths[t])
        for t in to_quantize:
            assert intermediate is not None
            how = "with llama-quantize and the importance matrix" if im else "with llama.cpp"
            with rep.step(f"quantize_{t}", f"Quantizing {t} {how} (from {intermediate})"):
                if im:
                    quantize.quantize_with_imatrix(paths[intermediate], paths[t], t, ctx.workdir / im.record["file"])
                else:
                    quantize.quantize(paths[intermediate], paths[t], t)
            with rep.timed(f"fallbacks_{t}"):
                fell_back[t] = quantize.fallbacks(paths[t], t)
        mix = None
        if spec.target_bits is not None:
            assert intermediate is not None and len(to_quantize) == 1  # target_bits.check
            mix = _to_target(ctx, plan, paths[intermediate], paths[to_quantize[0]], to_quantize[0], im)
            fell_back[to_quantize[0]] = quantize.fallbacks(paths[to_quantize[0]], to_quantize[0])
        if intermediate and intermediate not in wanted:
            paths[intermediate].unlink()
        vision, vision_notes = None, []
        if mmproj.wanted(source.config):
            with rep.timed("convert_mmproj"):
                vision, vision_notes = mmproj.produce(source.path, ctx.workdir, name, rep)

        assert done is not None  # at least one file was converted
        notes = list(plan.notes) + (im.notes if im else []) + vision_notes
        for t in wanted:
            if fell_back[t]:
                notes.append(_fallback_note(t, fell_back[t]))
                rep.warn(notes[-1])
        return Produced(
            quantization={
                "scheme": "GGUF " + ", ".join(wanted) + (" + importance matrix" if im else ""),
                "types": wanted,
                "files": {t: paths[t].name for t in wanted},
                "fallbacks": {t: fell_back[t] for t in wanted if fell_back[t]},
                "pre_tokenizer": done.pre,
                "pre_tokenizer_from": done.pre_from,
                "tokenizer": done.tokenizer,
                "architecture": done.gguf_arch,
                "source_architecture": plan.architecture,
                "converter": tools.describe_converter(),
                "intermediate": intermediate,
                "imatrix": {**im.record, "types": to_quantize} if im else None,
                **({"mixed": mix[0]} if mix else {}),
                **({"repacked": repacked} if repacked else {}),
                **({"mmproj": vision} if vision else {}),
            },
            calibration=im.calibration if im else (mix[1] if mix else None),
            notes=notes,
        )


def _to_target(ctx: ProduceContext, plan: convert.Plan, intermediate: Path, made: Path, type_name: str,
               im: "_Made | None") -> tuple[dict[str, Any], Any]:
    """Raise the costliest layer groups of ``made`` to Q8_0 until the bits target (:mod:`.target_bits`); replaces
    ``made``; the manifest record and the calibration set it measured on."""
    import torch
    import transformers

    from quantkit.devices import resolve_device

    rep = ctx.reporter
    calib = im.calibration if im and im.calibration else ctx.calibration_set(load_tokenizer(ctx.source.path))
    model = collect._load(transformers, torch, ctx.source.path, resolve_device(ctx.runtime.device), rep)
    with rep.timed("sensitivity"):
        record, assignment = target_bits.plan(model, plan, made, intermediate, ctx.spec.target_bits, calib.samples,
                                              rep)
    del model
    rep.log(f"bits plan: {record['units_at_high']} of {record['units']} layer groups raised to "
            f"{target_bits.HIGH_TYPE} ({record['planned_bits']:.3f} bits per weight planned, base "
            f"{record['base_bits']:.3f}, target {ctx.spec.target_bits:g})")
    with rep.step(f"quantize_{type_name}_target", f"Quantizing {type_name} again with {record['units_at_high']} "
                                                  f"layer groups at {target_bits.HIGH_TYPE} "
                                                  "(llama-quantize --tensor-type-file)"):
        target_bits.requantize(intermediate, made, type_name, assignment,
                               ctx.workdir / im.record["file"] if im else None, ctx.workdir)
    record["measured_bits"] = round(target_bits.file_bits(made), 4)
    record["tolerance"] = mixed.TOLERANCE
    mixed.verify(record["measured_bits"], ctx.spec.target_bits, record["planned_bits"])
    rep.log(f"bits per weight of the block matrices: {record['measured_bits']:.3f} (target {ctx.spec.target_bits:g})")
    return record, calib


@dataclass
class _Made:
    """The importance matrix of one run: its manifest record, the calibration set it came from, notes."""

    record: dict[str, Any]
    calibration: Any = None
    notes: list[str] = field(default_factory=list)


def _importance_matrix(ctx: ProduceContext, plan: convert.Plan, name: str) -> _Made | None:
    """Compute the matrix from the calibration set, or copy the given file, into ``imatrix/`` of the artifact."""
    compute, given = imatrix_request(ctx.spec)
    if not (compute or given):
        return None
    rep = ctx.reporter
    folder = ctx.workdir / IMATRIX_DIR
    folder.mkdir()
    quantizer = tools.describe_one("llama-quantize")
    if given is not None:
        im = imatrix.read(given)
        notes = imatrix.check_fits(im, plan.tensors, given)
        dest = folder / f"{name}.imatrix.{'gguf' if im.format == 'gguf' else 'dat'}"
        shutil.copyfile(given, dest)
        record = {"source": "file", "given": str(given), "datasets": im.datasets, "chunks": im.chunk_count,
                  "chunk_size": im.chunk_size}
        return _Made(_record(ctx, dest, im, record, quantizer), notes=notes)
    calib = ctx.calibration_set(load_tokenizer(ctx.source.path))
    with rep.step("imatrix", f"Computing the importance matrix ({calib.num_tokens:,} calibration tokens)"):
        im, how = collect.compute(ctx.source.path, plan, calib.samples, device=ctx.runtime.device, reporter=rep)
    im.datasets = imatrix.dataset_label(calib)
    im.chunk_count, im.chunk_size = len(calib.samples), calib.spec.seq_len
    dest = folder / f"{name}.imatrix.gguf"
    imatrix.write_gguf(im, dest, arch=plan.gguf_arch)
    notes = imatrix.check_fits(im, plan.tensors, dest)  # what it leaves uncovered (MLA's attn_k_b/attn_v_b)
    record = {"source": "calibration", "calibration_tokens_sha256": calib.tokens_sha256,
              "calibration_tokens": calib.num_tokens, "computed_with": how, "datasets": im.datasets,
              "chunks": im.chunk_count, "chunk_size": im.chunk_size}
    tokens = imatrix.expert_tokens(im, ctx.calibration.min_expert_tokens)
    if tokens is not None:
        record["expert_tokens"] = tokens
        warning = moe.low_token_warning(tokens, "llama-quantize weighs their columns by those few tokens (evenly "
                                                "where there are none)")
        if warning:
            rep.warn(warning)
            notes.append(warning)
    return _Made(_record(ctx, dest, im, record, quantizer), calibration=calib, notes=notes)


def _record(ctx: ProduceContext, dest: Path, im: imatrix.Imatrix, record: dict[str, Any],
            quantizer: dict[str, Any]) -> dict[str, Any]:
    return {"file": dest.relative_to(ctx.workdir).as_posix(), "sha256": sha256_file(dest), "format": im.format,
            "entries": len(im.entries), **record, "applied_by": quantizer}


def _ordered_unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _fallback_note(type_name: str, tensors_fell: dict[str, str]) -> str:
    shown = ", ".join(f"{n} -> {t}" for n, t in list(tensors_fell.items())[:8])
    more = f" and {len(tensors_fell) - 8} more" if len(tensors_fell) > 8 else ""
    return (f"{type_name}: {len(tensors_fell)} tensor(s) could not take {type_name} because of their row size and "
            f"fell back, as llama.cpp does: {shown}{more}")


PRODUCER = GgufProducer()
