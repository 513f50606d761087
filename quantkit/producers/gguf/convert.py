"""One Hugging Face checkpoint -> one GGUF file of a directly written type (F32, F16, BF16 or Q8_0).

The file is laid out by :class:`gguf.GGUFWriter` in its documented order: header, metadata (hyperparameters
from :mod:`.metadata`, vocabulary from :mod:`.tokenizer`), tensor infos (planned by :mod:`.tensors`), then the
tensor data, streamed.

Tested with gguf 0.19.0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.producers.gguf import metadata, quantize, tensors, tokenizer
from quantkit.producers.gguf.families import Family
from quantkit.progress import Reporter


@dataclass
class Converted:
    """A written GGUF file and the vocabulary it carries (for the manifest)."""

    path: Path
    vocab: tokenizer.Vocab
    n_tensors: int
    fallbacks: dict[str, str]  # tensor -> the type it got instead of the requested one (row size)


def convert(model_dir: Path, weight_files: list[Path], family: Family, hp: metadata.HParams, out: Path,
            type_name: str, *, name: str, reporter: Reporter) -> Converted:
    """Write ``out`` as a GGUF of ``type_name``; raises SourceModelError before writing for unsupported input."""
    import gguf

    planned = tensors.plan(weight_files, family, hp, quantize.ggml_type(type_name))
    n_vocab = next(p.shape[0] for p in planned if p.name == "token_embd.weight")
    vocab = tokenizer.load(model_dir, n_vocab)
    name = _safe_general_name(name, vocab)
    writer = gguf.GGUFWriter(out, arch=gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.gguf_arch)])
    try:
        metadata.write(writer, hp, family, name=name, file_type=quantize.file_type(type_name))
        tokenizer.write(writer, vocab, model_dir)
        tensors.add_infos(writer, planned)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with reporter.bar(f"Converting to GGUF {type_name}", total=len(planned)) as task:
            tensors.write_data(writer, planned, task)
    finally:
        writer.close()
    return Converted(out, vocab, len(planned), {p.name: p.qtype.name for p in planned if p.fallback})


# llama.cpp keys a Phi-3 tokenizer fix-up on general.name containing "phi3"/"phi-3", and fails to load the model
# when that vocabulary lacks the Phi-3 tokens it then looks up.
_PHI3_NAME = re.compile(r"phi-?3", re.IGNORECASE)
_PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def _safe_general_name(name: str, vocab: tokenizer.Vocab) -> str:
    """The model name for ``general.name``, spelled so llama.cpp's name-based quirks cannot break loading."""
    if _PHI3_NAME.search(name) and not set(_PHI3_TOKENS) <= set(vocab.tokens):
        vocab.notes.append(f"general.name is {_PHI3_NAME.sub('phi 3', name)!r}, not {name!r}: llama.cpp applies a "
                           "Phi-3 tokenizer fix-up to names containing 'phi3' that this vocabulary cannot take")
        return _PHI3_NAME.sub("phi 3", name)
    return name


def source_type(weight_files: list[Path]) -> str:
    """The lossless unquantized GGUF type for a checkpoint's weights (the quantizer's input)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in weight_files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                sl: Any = h.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                counts[sl.get_dtype()] = counts.get(sl.get_dtype(), 0) + n
    dominant = max(counts, key=lambda k: counts[k]) if counts else "F32"
    return {"BF16": "BF16", "F16": "F16"}.get(dominant, "F32")
