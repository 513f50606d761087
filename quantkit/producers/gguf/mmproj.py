"""A vision-language model's vision side as llama.cpp's ``mmproj`` GGUF, beside the text model's files.

llama.cpp keeps a vision-language model in two files: the language model (converted and quantized like any text
model, :mod:`.convert` and :mod:`.quantize`) and the ``mmproj`` file (the vision tower and the projector into the
language model's embeddings), which ``llama-server --mmproj`` loads beside it. Both are written by llama.cpp's own
``convert_hf_to_gguf.py`` (the mmproj with ``--mmproj``), through quantkit's wrapper :mod:`.hf_to_gguf`.

The vision side stays unquantized, at F16: what llama.cpp's converter writes for it and its guides use
(``--outtype f16 --mmproj``), the converter keeping what it must in F32 (norms, biases, position embeddings); the
vision tower is a few percent of the weights, and the compressed-tensors methods keep it in bf16 too. The file
goes in ``mmproj/`` of the artifact, so the folder's ``*.gguf`` are the text model's files only (what ``eval`` and
``smoke`` take one at a time), and the manifest says which file it is (``quantization.mmproj``).

:func:`plan` runs the converter up to the writing (no weight read) in :meth:`GgufProducer.check`, so a family whose
vision side llama.cpp cannot convert is refused in one line, naming the reason, before any work (measured with
llama.cpp b11312: LLaVA with a CLIP tower, whose only upstream class takes Pixtral towers; docs/vision.md).
:func:`check_written` reads the written file back: an mmproj, every tensor the plan named, nothing overflowed F16.

Tested with llama.cpp b11312 (0c1e57098, llama-cpp-python 0.3.36's sdist), gguf-py from the same sdist,
transformers 5.17.0, on the Qwen2.5-VL and Gemma 3 checkpoints of ``tests/vlm_models.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError, SourceModelError
from quantkit.producers.gguf import convert
from quantkit.progress import Reporter

FOLDER = "mmproj"
TYPE = "F16"
_PART = "the vision side (mmproj) of "
# Why quantkit's wrapper named vision tensors that upstream's map could not (:mod:`.hf_to_gguf`).
RENAMED = {
    "merger_index": "the patch merger's mlp.0/mlp.2 named although the tower has fewer than three blocks "
                    "(llama.cpp's converter names them through its per-block map)",
}
HINT = ("llama.cpp converts the vision side of Qwen2-VL, Qwen2.5-VL, Gemma 3, Pixtral, Mistral 3 and others "
        "(docs/vision.md); for this model choose a compressed-tensors method (quantkit awq, gptq, fp8...) and serve "
        "it with vLLM")
WHY = ("F16, as llama.cpp's converter writes an mmproj and its guides use it (--outtype f16 --mmproj); the vision "
       "tower and projector stay unquantized, as the compressed-tensors methods keep them")


def wanted(config: dict[str, Any]) -> bool:
    """Whether a checkpoint has a vision side to convert (a vision-language model's ``vision_config``)."""
    return bool(config.get("vision_config"))


@dataclass(frozen=True)
class Plan:
    """What llama.cpp's converter will write as the mmproj file, found without writing."""

    architecture: str | None
    model_class: str  # the converter's class (Qwen2VLVisionModel...)
    projector: str | None  # clip.projector_type (qwen2.5vl_merger, gemma3...)
    block_count: int
    tensors: list[convert.Tensor]
    renamed: tuple[str, ...]  # why the wrapper named tensors upstream's map could not (keys of RENAMED)

    @property
    def parameters(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total


_plans: dict[tuple[str, float], Plan] = {}


def plan(model_dir: Path) -> Plan:
    """The mmproj file the converter would write for ``model_dir`` (once per folder state), or its refusal."""
    stamp = max((p.stat().st_mtime for p in model_dir.iterdir() if p.is_file()), default=0.0)
    key = (str(model_dir.resolve()), stamp)
    if key not in _plans:
        try:
            out = convert.run_wrapper(model_dir, ["--mmproj"], plan_only=True, part=_PART)
        except SourceModelError as e:
            raise SourceModelError(e.message, hint=HINT) from None
        _plans[key] = Plan(architecture=out.get("architecture"), model_class=out["model_class"],
                           projector=out.get("projector"), block_count=int(out["block_count"]),
                           tensors=[convert.Tensor(n, tuple(s), t) for n, s, t in out["tensors"]],
                           renamed=tuple(out.get("vision_names") or ()))
    return _plans[key]


def file_name(name: str) -> str:
    """The mmproj file's path inside the artifact."""
    return f"{FOLDER}/mmproj-{name}-{TYPE}.gguf"


def produce(model_dir: Path, workdir: Path, name: str, reporter: Reporter) -> tuple[dict[str, Any], list[str]]:
    """Write the mmproj file into ``workdir``, check it, and return its manifest record and notes."""
    p = plan(model_dir)
    out = workdir / file_name(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert.run_wrapper(model_dir, ["--mmproj", "--outtype", convert.OUTTYPES[TYPE], "--outfile", str(out),
                             "--model-name", name], plan_only=False, reporter=reporter, part=_PART,
                 label=f"Converting the vision side to an mmproj GGUF {TYPE} (llama.cpp's convert_hf_to_gguf.py "
                       "--mmproj)")
    check_written(out, p)
    notes = [f"mmproj: {RENAMED[why]}" for why in p.renamed]
    record = {"file": out.relative_to(workdir).as_posix(), "type": TYPE, "why": WHY, "projector": p.projector,
              "converter_class": p.model_class, "tensors": len(p.tensors), "parameters": p.parameters,
              "renamed_by_quantkit": list(p.renamed)}
    return record, notes


def check_written(path: Path, p: Plan) -> None:
    """The file is an mmproj with every tensor of the plan, and no value overflowed to inf or NaN in F16."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.type")
    kind = field.contents() if field is not None else None
    if kind != "mmproj":
        raise BackendError(f"{path.name}: llama.cpp's converter wrote general.type {kind!r}, not 'mmproj'")
    names = {t.name for t in reader.tensors}
    missing = sorted({t.name for t in p.tensors} - names)
    if missing:
        raise BackendError(f"{path.name} lacks {len(missing)} tensor(s) the converter planned: "
                           f"{', '.join(missing[:6])}")
    bad = [t.name for t in reader.tensors
           if t.tensor_type.name in ("F16", "F32") and not np.isfinite(np.asarray(t.data)).all()]
    if bad:
        raise BackendError(f"{path.name}: {len(bad)} vision tensor(s) hold values F16 cannot represent (inf or "
                           f"NaN): {', '.join(bad[:6])}", hint="the checkpoint's vision weights exceed F16's range")
