"""Importance matrices for llama.cpp's quantizer: computed from quantkit's calibration tokens, or read from a file.

An importance matrix is, for every weight matrix of the transformer blocks, the sum over calibration tokens of
the square of each input activation (one value per input column), and the number of tokens summed. llama.cpp's
quantizer weighs each column's rounding error by it (``sum / count``), which is what makes the I-quants usable
at 2-3 bits and lowers the error of the K-quants.

Why quantkit computes it itself instead of running ``llama-imatrix``: every quantkit method calibrates on the
recipe's token samples, recorded by their sha256 in the manifest. ``llama-imatrix`` takes text, tokenizes it with
its own tokenizer, and cuts that stream into chunks whose first token it replaces by BOS, so the tokens it used
could only be reconstructed, never recorded, and a packed sample that starts mid-document cannot be given to it
at all. :mod:`.collect` computes it in transformers with forward pre-hooks, summing exactly the recorded token
ids on any device torch has (a GPU for large models, where ``llama-imatrix`` would run the GGUF on the CPU
here), per expert for mixture-of-experts models. This module is the matrix itself: its entries, its files, and
what a matrix says about a model's experts.

Names are llama.cpp's (:func:`quantkit.producers.gguf.tensors.targets`), so an entry is named like the tensor
it weighs (``blk.0.attn_q.weight``, ``blk.0.ffn_up_exps.weight``). A stacked expert tensor's entry holds one row
of sums and one count per expert.

Files are written in llama.cpp's GGUF imatrix format (``general.type = imatrix``, ``imatrix.datasets``,
``imatrix.chunk_count``, ``imatrix.chunk_size``, and per entry ``<name>.in_sum2`` [n_mat x n_cols] and
``<name>.counts`` [n_mat x 1], all F32), as ``llama-imatrix`` writes it (common/imatrix-loader.cpp reads it).
Given files may be in that format or the legacy ``.dat`` one; :func:`read` reads both, and :func:`check_fits`
refuses a file made for another model before any quantization starts.

Tested with transformers 5.17.0, torch 2.13, gguf 0.19.0 and llama.cpp b11312 (llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import UsageError

# The CLI flags (defined with the recipe's GGUF fields ``imatrix`` and ``imatrix_file``), named in messages.
COMPUTE_FLAG = "--imatrix"
FILE_FLAG = "--imatrix-file"
MAX_DATASET_CHARS = 127  # llama-quantize copies datasets[0] into a 127-character GGUF string


@dataclass
class Entry:
    """One weight matrix's statistics: per matrix (one, or one per expert) the sums of squared inputs per column
    and the number of tokens summed. Legacy ``.dat`` files hold ``(sum / count) * ncall`` and ``ncall`` instead."""

    sums: Any  # numpy float32 [n_mat, n_cols]
    counts: Any  # numpy float32 [n_mat]


@dataclass
class Imatrix:
    """An importance matrix as llama.cpp reads it."""

    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    format: str = "gguf"  # or "dat" (legacy)


def _np() -> Any:
    """numpy, imported when first needed: this module is imported with the package, whose types table the
    recipe's validator and ``--help`` load."""
    import numpy as np

    return np


# ---------------------------------------------------------------------------------------------------------------
# files


def dataset_label(calibration: Any) -> list[str]:
    """``imatrix.datasets`` for a matrix computed from a calibration set: the token hash first (llama-quantize
    copies the first entry into the quantized file, 127 characters at most), then what the tokens came from."""
    m = calibration.manifest()
    return [f"quantkit tokens sha256:{m.tokens_sha256}"[:MAX_DATASET_CHARS],
            f"{m.dataset} ({m.samples} x {m.seq_len} tokens, seed {m.seed})"]


def expert_tokens(im: Imatrix, threshold: int) -> dict[str, Any] | None:
    """How many tokens the router sent to each expert, per block (the counts of the block's stacked expert
    entries), in the shape of :meth:`quantkit.producers.moe.RouterTokens.summary`; None for a dense model."""
    per_layer: dict[str, list[int]] = {}
    for name, e in im.entries.items():
        if len(e.counts) > 1:
            per_layer.setdefault(name.split(".")[1], [int(c) for c in e.counts])
    if not per_layer:
        return None
    per_layer = dict(sorted(per_layer.items(), key=lambda kv: int(kv[0])))
    below = {k: [i for i, c in enumerate(v) if c < threshold] for k, v in per_layer.items()}
    return {"per_layer": per_layer, "min": min(min(v) for v in per_layer.values()), "threshold": threshold,
            "below_threshold": {k: v for k, v in below.items() if v}}


def write_gguf(im: Imatrix, path: Path, arch: str) -> None:
    """Write ``im`` in llama.cpp's GGUF imatrix format (entries in sorted order, as llama-imatrix does)."""
    import gguf

    np = _np()
    writer = gguf.GGUFWriter(path, arch=arch)
    try:
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(gguf.Keys.IMatrix.DATASETS, list(im.datasets))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(im.chunk_count))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(im.chunk_size))
        for name in sorted(im.entries):
            e = im.entries[name]
            writer.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(e.sums, dtype=np.float32))
            writer.add_tensor(f"{name}.counts", np.ascontiguousarray(e.counts, dtype=np.float32).reshape(-1, 1))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def read(path: Path) -> Imatrix:
    """Read an importance matrix in the GGUF format or the legacy ``.dat`` one (UsageError if it is neither)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _read_gguf(path)
    return _read_dat(path)


def _read_gguf(path: Path) -> Imatrix:
    import gguf

    np = _np()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError/IndexError... for damaged files
        raise UsageError(f"{path} is not a readable GGUF file: {e}") from None
    fields = reader.fields
    kind = fields.get("general.type")
    if kind is None or kind.contents() != gguf.GGUFType.IMATRIX:
        raise UsageError(f"{path} is a GGUF file but not an importance matrix (general.type is "
                         f"{kind.contents() if kind else 'missing'})",
                         hint="pass the .gguf written by llama-imatrix (or quantkit), not a model")
    by_name: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        for suffix in (".in_sum2", ".counts"):
            if t.name.endswith(suffix):
                by_name.setdefault(t.name[:-len(suffix)], {})[suffix] = np.asarray(t.data, dtype=np.float32)
    entries = {}
    for name, parts in sorted(by_name.items()):
        if len(parts) != 2:
            raise UsageError(f"{path}: {name} has {'sums' if '.in_sum2' in parts else 'counts'} but not both",
                             hint="the file is damaged; compute it again")
        counts = parts[".counts"].reshape(-1)
        entries[name] = Entry(parts[".in_sum2"].reshape(len(counts), -1), counts)
    datasets = fields.get(gguf.Keys.IMatrix.DATASETS)
    return Imatrix(entries, datasets=datasets.contents() if datasets else [],
                   chunk_count=_int_field(fields, gguf.Keys.IMatrix.CHUNK_COUNT),
                   chunk_size=_int_field(fields, gguf.Keys.IMatrix.CHUNK_SIZE), format="gguf")


def _int_field(fields: dict[str, Any], key: str) -> int:
    f = fields.get(key)
    return int(f.contents()) if f is not None else 0


def _read_dat(path: Path) -> Imatrix:
    """The legacy format: n_entries, then per entry name, ncall, nval and nval floats; then optionally the chunk
    count and the dataset name (llama.cpp's common/imatrix-loader.cpp)."""
    np = _np()
    data = path.read_bytes()
    bad = UsageError(f"{path} is neither a GGUF importance matrix nor a legacy .dat one",
                     hint="pass the file written by llama-imatrix (imatrix.gguf, or imatrix.dat with "
                          "--output-format dat)")
    try:
        (n,), pos = struct.unpack_from("<i", data, 0), 4
        if not 0 < n < 1_000_000:
            raise bad
        entries = {}
        for _ in range(n):
            (ln,) = struct.unpack_from("<i", data, pos)
            name = data[pos + 4:pos + 4 + ln].decode("utf-8")
            ncall, nval = struct.unpack_from("<ii", data, pos + 4 + ln)
            pos += 12 + ln
            if nval < 1 or pos + 4 * nval > len(data):
                raise bad
            sums = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
            pos += 4 * nval
            entries[name] = Entry(sums.reshape(1, -1), np.asarray([ncall], dtype=np.float32))
        chunks, datasets = 0, []
        if pos + 4 <= len(data):
            (chunks,) = struct.unpack_from("<i", data, pos)
            if pos + 8 <= len(data):
                (ln,) = struct.unpack_from("<i", data, pos + 4)
                if ln > 0:
                    datasets = [data[pos + 8:pos + 8 + ln].decode("utf-8", errors="replace")]
    except (struct.error, UnicodeDecodeError):
        raise bad from None
    return Imatrix(entries, datasets=datasets, chunk_count=chunks, format="dat")


def check_fits(im: Imatrix, planned: list[Any], path: Path) -> list[str]:
    """Refuse a matrix that does not belong to this model; return notes about what it leaves uncovered.

    llama.cpp's quantizer silently skips entries that name no tensor and stops half-way on one of the wrong size;
    both mean the matrix was made for another model (or another conversion of it), so both are refused here,
    before any work. A model tensor without an entry is quantized without importance weights, as llama.cpp does.
    """
    shapes = {p.name: p.shape for p in planned}
    unknown = sorted(n for n in im.entries if n not in shapes)
    if unknown and len(unknown) == len(im.entries):
        raise UsageError(f"the importance matrix {path} names none of this model's tensors (it has "
                         f"{', '.join(unknown[:3])}...)", hint=f"it was made for another model; compute one "
                                                                f"with {COMPUTE_FLAG}, or pass the right file")
    wrong = [f"{n} ({e.sums.size} values, the tensor has {_cols(shapes[n])})" for n, e in im.entries.items()
             if n in shapes and e.sums.size != _cols(shapes[n])]
    if wrong:
        raise UsageError(f"the importance matrix {path} does not fit this model: {'; '.join(wrong[:3])}"
                         f"{' ...' if len(wrong) > 3 else ''}", hint=f"it was made for another model or another "
                                                                       f"layout of it; compute one with {COMPUTE_FLAG}")
    notes = []
    if unknown:
        notes.append(f"importance matrix: {len(unknown)} entries name no tensor of this model and are ignored "
                     f"({', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''})")
    uncovered = sorted(n for n in shapes if n.startswith("blk.") and len(shapes[n]) >= 2 and n not in im.entries)
    if uncovered:
        notes.append(f"importance matrix: {len(uncovered)} block tensors have no entry and are quantized without "
                     f"importance weights ({', '.join(uncovered[:3])}{' ...' if len(uncovered) > 3 else ''})")
    return notes


def _cols(shape: tuple[int, ...]) -> int:
    """Values an entry holds for a tensor of this logical shape: input columns, times experts if stacked."""
    return shape[-1] * (shape[0] if len(shape) == 3 else 1)
