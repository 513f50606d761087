"""Tensors: plan every GGUF tensor from the safetensors headers, then stream them into the file chunk by chunk.

Planning reads only headers: names are mapped with :class:`gguf.TensorNameMap`, experts are grouped for
stacking, each tensor gets its output type and byte size, and anything llama.cpp would not recognise is refused
before a byte of data is read. Writing then reads one row chunk of one source tensor at a time (``safe_open``
and ``get_slice``, the file closed again after each tensor so its mapped pages are released), transforms it
(rope permutation, Gemma's norm offset), converts it and appends it to the file. Memory stays around one chunk
whatever the model's size, so a checkpoint larger than RAM converts.

Tested with gguf 0.19.0, safetensors 0.6, torch 2.13 and llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError, SourceModelError
from quantkit.producers.gguf.families import Family
from quantkit.producers.gguf.metadata import HParams, llama3_rope_factors

CHUNK_ELEMENTS = 1 << 24  # rows are read and converted ~16M elements (64 MiB as float32) at a time
SKIP = re.compile(r".*\.rotary_emb\.inv_freq$")  # recomputed by llama.cpp; older checkpoints stored it
Q8_BLOCK = 32


@dataclass
class Part:
    """One source tensor: which safetensors file and key."""

    file: Path
    key: str
    shape: tuple[int, ...]


@dataclass
class Planned:
    """One GGUF tensor: its name, logical shape (outermost axis first), type, and where its data comes from."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    parts: list[Part] = field(default_factory=list)  # stacked on the outer axis when more than one (experts)
    permute_heads: int = 0  # rope row permutation over this many heads; 0 = none
    plus_one: bool = False  # Gemma norms: store w + 1
    data: Any = None  # a generated float32 array (rope_freqs) instead of parts
    fallback: str | None = None  # why it did not get the requested type

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def _read_headers(files: list[Path]) -> dict[str, Part]:
    from safetensors import safe_open

    out: dict[str, Part] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                out[key] = Part(f, key, tuple(h.get_slice(key).get_shape()))
    return out


def _output_type(name: str, shape: tuple[int, ...], requested: Any) -> tuple[Any, str | None]:
    """1-D tensors, norms and MoE routers stay F32 (small, and precision there is cheap); the rest get the
    requested type, except Q8_0 rows that are not whole 32-value blocks, which fall back to F16 as llama.cpp's
    own quantizer does."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) == 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name:
        return T.F32, None
    if requested == T.Q8_0 and shape[-1] % Q8_BLOCK:
        return T.F16, f"row size {shape[-1]} is not a multiple of {Q8_BLOCK}"
    return requested, None


def plan(files: list[Path], family: Family, hp: HParams, requested: Any) -> list[Planned]:
    """Every tensor the GGUF file will hold, in order, with its type; refuses unknown or missing tensors."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, family.gguf_arch)
    name_map = gguf.get_tensor_name_map(arch, hp.n_layer)
    allowed = set(gguf.MODEL_TENSORS[arch])
    T = gguf.MODEL_TENSOR
    headers = _read_headers(files)

    experts: dict[str, dict[int, Part]] = {}
    singles: list[Part] = []
    for key, part in headers.items():
        if SKIP.match(key) or (hp.tied and key == "lm_head.weight"):
            continue
        m = family.experts.match(key) if family.experts else None
        if m:
            experts.setdefault(f"{m['prefix']}.{m['proj']}.weight", {})[int(m["expert"])] = part
        else:
            singles.append(part)

    planned: list[Planned] = []
    unknown: list[str] = []

    def mapped(hf_name: str) -> tuple[Any, str] | None:
        hit = name_map.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        return hit if hit is not None and hit[0] in allowed else None

    for part in singles:
        hit = mapped(part.key)
        if hit is None:
            unknown.append(part.key)
            continue
        ttype, name = hit
        qtype, why = _output_type(name, part.shape, requested)
        heads = 0
        if family.rope_permute and ttype in (T.ATTN_Q, T.ATTN_K):
            heads = hp.n_head if ttype == T.ATTN_Q else hp.n_head_kv
        planned.append(Planned(name, part.shape, qtype, [part], permute_heads=heads,
                               plus_one=family.norm_plus_one and name.endswith("norm.weight"), fallback=why))
    for hf_name, by_index in experts.items():
        hit = mapped(hf_name)
        if hit is None:
            unknown.append(hf_name)
            continue
        if sorted(by_index) != list(range(hp.n_expert)):
            raise SourceModelError(f"{hf_name}: expected experts 0..{hp.n_expert - 1}, found {len(by_index)}",
                                   hint="the checkpoint is incomplete or its config does not match its weights")
        parts = [by_index[i] for i in range(hp.n_expert)]
        shape = (hp.n_expert, *parts[0].shape)
        qtype, why = _output_type(hit[1], shape, requested)
        planned.append(Planned(hit[1], shape, qtype, parts, fallback=why))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise SourceModelError(
            f"{family.label}: tensor(s) {', '.join(unknown[:5])}{more} have no place in llama.cpp's "
            f"{family.gguf_arch.lower()} layout", hint=f"the checkpoint is not a plain {family.label} model")

    names = {p.name for p in planned}
    if "token_embd.weight" not in names:
        raise SourceModelError("the checkpoint has no token embeddings (model.embed_tokens.weight)")
    if not hp.tied and "output.weight" not in names:
        raise SourceModelError("the checkpoint has no lm_head.weight but tie_word_embeddings is false",
                               hint="the checkpoint is incomplete; download it again")
    if hp.rope_type == "llama3":
        import numpy as np

        data = np.asarray(llama3_rope_factors(hp), dtype=np.float32)
        planned.append(Planned(gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight", data.shape,
                               gguf.GGMLQuantizationType.F32, data=data))
    planned.sort(key=_order)
    return planned


def _order(p: Planned) -> tuple[int, str]:
    m = re.match(r"blk\.(\d+)\.", p.name)
    return (int(m.group(1)) if m else -1, p.name)


def _permute(x: Any, heads: int) -> Any:
    """Rotate-half row order -> interleaved pairs, per head (rows of q/k weights and biases)."""
    rows = x.shape[0]
    return x.reshape(heads, 2, rows // heads // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _encode(x: Any, qtype: Any) -> Any:
    """A float torch tensor -> the numpy bytes of ``qtype`` (row-wise, so chunks of rows concatenate)."""
    import gguf
    import torch

    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return x.to(torch.float32).contiguous().numpy()
    if qtype == T.F16:
        return x.to(torch.float16).contiguous().numpy()
    if qtype == T.BF16:
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return gguf.quants.quantize(x.to(torch.float32).contiguous().numpy(), qtype)


def _chunks(p: Planned) -> Iterator[Any]:
    """The converted bytes of one planned tensor, a row chunk at a time.

    Each source tensor is opened on its own and closed when done: the checkpoint is memory-mapped, and closing
    it unmaps the pages read so far, so the process holds one tensor's pages at most, not the whole file.
    """
    import torch
    from safetensors import safe_open

    if p.data is not None:
        yield _encode(torch.from_numpy(p.data), p.qtype)
        return
    for part in p.parts:
        with safe_open(str(part.file), framework="pt") as h:
            sl = h.get_slice(part.key)
            if len(part.shape) == 1 or p.permute_heads or p.plus_one:
                x = sl[:]
                if p.permute_heads:
                    x = _permute(x, p.permute_heads)
                if p.plus_one:
                    x = x.to(torch.float32) + 1.0
                yield _encode(x, p.qtype)
            else:
                step = max(1, CHUNK_ELEMENTS // max(1, part.shape[-1]))
                for r in range(0, part.shape[0], step):
                    yield _encode(sl[r:r + step], p.qtype)
            del sl  # the slice holds the file's mapping; drop it so closing really unmaps


def add_infos(writer: Any, planned: list[Planned]) -> None:
    """Declare every tensor (name, shape, type, size) before the header is written."""
    import numpy as np

    for p in planned:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)


def write_data(writer: Any, planned: list[Planned], progress: Any) -> None:
    """Stream the tensor data, in declaration order, each aligned as the header's offsets promise."""
    fout = writer.fout[0]
    for p in planned:
        writer.write_padding(fout, fout.tell())
        written = 0
        for chunk in _chunks(p):
            chunk.tofile(fout)
            written += chunk.nbytes
        if written != p.nbytes:
            raise BackendError(f"GGUF writer: {p.name} came out as {written} bytes, {p.nbytes} were planned")
        writer.write_padding(fout, p.nbytes)
        progress.advance(1)
    writer.flush()
