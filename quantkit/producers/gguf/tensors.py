"""Tensors: plan every GGUF tensor from the safetensors headers, then stream them into the file chunk by chunk.

Planning reads only headers. Every Hugging Face tensor name goes through one function, :func:`targets`, which
says which GGUF tensor(s) it becomes (names from :class:`gguf.TensorNameMap`), and which part of it each one
takes: an expert's slot in a stacked tensor, one half of a fused ``gate_up_proj``, one side of MLA's
``kv_b_proj``. The planner groups those pieces per GGUF tensor, gives each its output type and byte size, and
refuses anything llama.cpp would not recognise before a byte of data is read. Writing then reads one row chunk
of one source tensor at a time (``safe_open`` and ``get_slice``, the file closed again after each tensor so its
mapped pages are released), transforms it (rope permutation, Gemma's norm offset, the MLA split), converts it
and appends it to the file. Memory stays around one chunk whatever the model's size, so a checkpoint larger
than RAM converts.

Experts come in two layouts, both read: one 2-D tensor per expert and projection, as published on the hub and
as transformers 5.17's ``save_pretrained`` writes by default (``experts.<i>.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.<i>.w1.weight``), stacked here on a new outer axis; and the fused 3-D tensors
transformers 5 holds in memory and saves with ``save_original_format=False`` (``experts.gate_up_proj`` of
shape (experts, 2 x ffn, hidden) with gate rows first, ``experts.down_proj`` of (experts, hidden, ffn)), whose
outer axis already is llama.cpp's. transformers' ``from_pretrained`` accepts both.

Tested with gguf 0.19.0, safetensors 0.6, torch 2.13, transformers 5.17.0 and llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import functools
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

# How transformers names expert weights; the same in every MoE family.
PER_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")
FUSED_GATE_UP = re.compile(r"(?P<prefix>.+\.experts)\.gate_up_proj")
FUSED_DOWN = re.compile(r"(?P<prefix>.+\.experts)\.down_proj")
KV_B = re.compile(r"(?P<prefix>.+)\.kv_b_proj\.weight")
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Target:
    """Where one Hugging Face tensor, or a part of it, goes in the GGUF file.

    ``name`` is the GGUF tensor (``blk.3.ffn_up_exps.weight``). ``expert`` is set for a checkpoint that stores one
    tensor per expert: the slot on the stacked GGUF tensor's outer axis. A fused 3-D expert tensor leaves it None:
    its outer axis already holds the experts, in the same order. ``half`` says which half of a fused
    ``gate_up_proj``'s rows (0 gate, 1 up) this target takes; both halves see the same input. ``split`` is set
    for MLA's ``kv_b_proj``: ``"k_b"`` (per head, transposed, so its input in llama.cpp is the head's q_nope,
    not the latent kv this module reads) or ``"v_b"`` (per head, same input).
    """

    name: str
    expert: int | None = None
    half: int | None = None
    split: str | None = None


@functools.lru_cache(maxsize=16)
def _name_map(gguf_arch: str, n_layer: int) -> tuple[Any, frozenset]:
    import gguf

    arch = getattr(gguf.MODEL_ARCH, gguf_arch)
    return gguf.get_tensor_name_map(arch, n_layer), frozenset(gguf.MODEL_TENSORS[arch])


def _mapped(hf_name: str, family: Family, hp: HParams) -> str | None:
    name_map, allowed = _name_map(family.gguf_arch, hp.n_layer)
    hit = name_map.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
    return hit[1] if hit is not None and hit[0] in allowed else None


def targets(hf_name: str, family: Family, hp: HParams) -> list[Target]:
    """The GGUF tensor(s) one Hugging Face tensor becomes; [] when llama.cpp's layout has no place for it.

    ``hf_name`` is a tensor name (``model.layers.0.mlp.experts.3.gate_proj.weight``, the fused
    ``model.layers.0.mlp.experts.gate_up_proj``) or a module name, which stands for its ``.weight``
    (``model.layers.0.self_attn.q_proj``). This is the only map from Hugging Face names to GGUF names: the
    converter plans every tensor through it, and other code (importance matrices computed from Hugging Face
    activations) gets the same answer. ``family`` and ``hp`` come from :func:`.families.resolve` and
    :func:`.metadata.from_config`. An lm_head tied to the embeddings has no tensor of its own: [].
    """
    for pattern, repl in family.renames:
        hf_name = re.sub(pattern, repl, hf_name)
    if hp.tied and hf_name in ("lm_head", "lm_head.weight"):
        return []
    if family.experts is not None:
        if m := FUSED_GATE_UP.fullmatch(hf_name):
            names = [_mapped(f"{m['prefix']}.{proj}.weight", family, hp) for proj in ("gate_proj", "up_proj")]
            return [Target(str(n), half=i) for i, n in enumerate(names)] if all(names) else []
        if m := FUSED_DOWN.fullmatch(hf_name):
            name = _mapped(f"{m['prefix']}.down_proj.weight", family, hp)
            return [Target(name)] if name else []
    if not hf_name.endswith((".weight", ".bias")):
        hf_name += ".weight"
    if family.experts is not None and (m := PER_EXPERT.fullmatch(hf_name)):
        name = _mapped(f"{m['prefix']}.{m['proj']}.weight", family, hp)
        return [Target(name, expert=int(m["expert"]))] if name else []
    if family.mla and (m := KV_B.fullmatch(hf_name)):
        names = [_mapped(f"{m['prefix']}.{side}_proj.weight", family, hp) for side in ("k_b", "v_b")]
        return [Target(str(n), split=side) for n, side in zip(names, ("k_b", "v_b"))] if all(names) else []
    name = _mapped(hf_name, family, hp)
    return [Target(name)] if name else []


@dataclass
class Part:
    """One source tensor: which safetensors file and key."""

    file: Path
    key: str
    shape: tuple[int, ...]


@dataclass
class Piece:
    """The part of a source tensor that one GGUF tensor takes (see :class:`Target`)."""

    part: Part
    half: int | None = None
    split: tuple[str, int, int] | None = None  # MLA: ("k_b" or "v_b", heads, qk_nope)

    @property
    def shape(self) -> tuple[int, ...]:
        """What this piece contributes: half the rows of a fused gate_up_proj, or from MLA's kv_b_proj
        (heads x (nope + v), rank) either k_b (heads, rank, nope) or v_b (heads, v, rank)."""
        if self.split is not None:
            side, heads, nope = self.split
            rows, rank = self.part.shape
            return (heads, rank, nope) if side == "k_b" else (heads, rows // heads - nope, rank)
        shape = list(self.part.shape)
        if self.half is not None:
            shape[-2] //= 2
        return tuple(shape)


@dataclass
class Planned:
    """One GGUF tensor: its name, logical shape (outermost axis first), type, and where its data comes from."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    pieces: list[Piece] = field(default_factory=list)  # stacked on the outer axis when more than one (experts)
    permute_heads: int = 0  # rope row permutation over this many heads; 0 = none
    plus_one: bool = False  # Gemma norms: store w + 1
    data: Any = None  # a generated float32 array (rope_freqs) instead of pieces
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


def _one(name: str, pieces: list[tuple[Target, Part]], hp: HParams) -> tuple[tuple[int, ...], list[Piece]]:
    """The shape and pieces of one GGUF tensor: a single source tensor (or part of one), or one per expert."""
    by_expert = {t.expert: p for t, p in pieces if t.expert is not None}
    if not by_expert:
        if len(pieces) > 1:
            raise SourceModelError(f"{name}: the checkpoint holds it twice ({', '.join(p.key for _, p in pieces)})",
                                   hint="the checkpoint mixes two layouts; re-save it with save_pretrained")
        t, part = pieces[0]
        split = (t.split, hp.n_head, hp.mla.qk_nope) if t.split and hp.mla is not None else None
        piece = Piece(part, half=t.half, split=split)
        return piece.shape, [piece]
    n_expert = hp.moe.n_expert if hp.moe else 0
    if len(by_expert) != len(pieces) or sorted(by_expert) != list(range(n_expert)):
        raise SourceModelError(f"{name}: expected experts 0..{n_expert - 1}, found {len(by_expert)}",
                               hint="the checkpoint is incomplete or its config does not match its weights")
    stacked = [Piece(by_expert[i]) for i in range(n_expert)]
    return (n_expert, *stacked[0].shape), stacked


def plan(files: list[Path], family: Family, hp: HParams, requested: Any) -> list[Planned]:
    """Every tensor the GGUF file will hold, in order, with its type; refuses unknown or missing tensors."""
    import gguf

    T = gguf.MODEL_TENSOR
    grouped: dict[str, list[tuple[Target, Part]]] = {}
    unknown: list[str] = []
    extra: list[str] = []
    for key, part in _read_headers(files).items():
        if SKIP.match(key) or (hp.tied and key == "lm_head.weight"):
            continue
        if family.extra_layers_ignored and (m := LAYER.match(key)) and int(m.group(1)) >= hp.n_layer:
            extra.append(key)
            continue
        found = targets(key, family, hp)
        if not found:
            unknown.append(key)
        for t in found:
            grouped.setdefault(t.name, []).append((t, part))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise SourceModelError(
            f"{family.label}: tensor(s) {', '.join(unknown[:5])}{more} have no place in llama.cpp's "
            f"{family.gguf_arch.lower()} layout", hint=f"the checkpoint is not a plain {family.label} model")

    if extra:
        note = (f"{len(extra)} tensor(s) of layers past the model's {hp.n_layer} (a multi-token-prediction module) "
                f"were left out: transformers does not use them for logits, nor does llama.cpp's "
                f"{family.gguf_arch.lower()} graph")
        if note not in hp.notes:
            hp.notes.append(note)

    planned: list[Planned] = []
    for name, pieces in grouped.items():
        shape, parts = _one(name, pieces, hp)
        qtype, why = _output_type(name, shape, requested)
        planned.append(Planned(name, shape, qtype, parts, permute_heads=_rope_heads(name, family, hp),
                               plus_one=family.norm_plus_one and name.endswith("norm.weight"), fallback=why))

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


def _rope_heads(name: str, family: Family, hp: HParams) -> int:
    """How many heads the rows of q or k (weight or bias) are permuted over for llama.cpp's rope; 0 for others."""
    if not family.rope_permute:
        return 0
    kind = re.sub(r"^blk\.\d+\.", "", name).rsplit(".", 1)[0]
    return {"attn_q": hp.n_head, "attn_k": hp.n_head_kv}.get(kind, 0)


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


def _split_kv_b(x: Any, side: str, heads: int, nope: int) -> Any:
    """kv_b_proj's rows are, per head, nope rows of k then v rows of v: k_b is the k part transposed (llama.cpp
    multiplies it with q_nope to absorb it into the query), v_b the v part as it is."""
    per_head = x.reshape(heads, x.shape[0] // heads, x.shape[1])
    return per_head[:, :nope].transpose(1, 2) if side == "k_b" else per_head[:, nope:]


def _rows(sl: Any, piece: Piece) -> Iterator[Any]:
    """A source tensor (2-D, or 3-D with experts outermost) as chunks of rows, only the rows this piece takes."""
    shape = piece.part.shape
    rows = shape[-2]
    lo, hi = (0, rows) if piece.half is None else (piece.half * rows // 2, (piece.half + 1) * rows // 2)
    step = max(1, CHUNK_ELEMENTS // max(1, shape[-1]))
    for e in range(shape[0] if len(shape) == 3 else 1):
        for r in range(lo, hi, step):
            yield sl[e, r:min(r + step, hi)] if len(shape) == 3 else sl[r:min(r + step, hi)]


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
    for piece in p.pieces:
        with safe_open(str(piece.part.file), framework="pt") as h:
            sl = h.get_slice(piece.part.key)
            if len(piece.part.shape) == 1 or p.permute_heads or p.plus_one or piece.split:
                x = sl[:]
                if p.permute_heads:
                    x = _permute(x, p.permute_heads)
                if p.plus_one:
                    x = x.to(torch.float32) + 1.0
                if piece.split:
                    x = _split_kv_b(x, *piece.split)
                yield _encode(x, p.qtype)
            else:
                for rows in _rows(sl, piece):
                    yield _encode(rows, p.qtype)
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
