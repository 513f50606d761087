"""A checkpoint of a bench/shapes.py shape whose headers are real and whose data takes no disk: every tensor named and
shaped as ``save_pretrained`` writes it (transformers' own class built on the meta device, its save-time renaming
applied: Qwen3-MoE's fused experts as one tensor per expert and projection), in shards of at most 5 GB with their
index, each shard a sparse file of its full size.

What quantkit decides from headers and config alone (``--dry-run``'s memory plan, the host-memory refusal, the
producers' checks) then runs at a 32B or 30B-A3B width on any machine, in seconds, before a byte of weights exists;
loading one gives zeros, so nothing else should read it.

    python bench/header_only.py 32b /tmp/hdr-32b
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "quantkit-tiny"
SHARD_BYTES = 5_000_000_000
DTYPE = {"torch.bfloat16": ("BF16", 2), "torch.float32": ("F32", 4)}


def config(shape: str) -> dict[str, Any]:
    """config.json of ``shape`` as the benchmarks write it (the reference tokenizer's special ids, bf16)."""
    return {**SHAPES[shape].config(), "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}


def tensors(shape: str) -> dict[str, tuple[str, list[int]]]:
    """Every tensor ``save_pretrained`` would write for ``shape``: name -> (safetensors dtype, shape)."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cfg = transformers.AutoConfig.for_model(**config(shape))
    with torch.device("meta"):
        model = getattr(transformers, SHAPES[shape].architecture)(cfg).to(torch.bfloat16)
    state = revert_weight_conversion(model, model.state_dict())
    return {name: (DTYPE[str(t.dtype)][0], list(t.shape)) for name, t in state.items()}


def write(shape: str, folder: Path) -> Path:
    """``folder`` as a header-only checkpoint of ``shape`` (config, the reference tokenizer, sparse shards)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config(shape), indent=1))
    widths = {code: width for code, width in DTYPE.values()}
    shards: list[dict[str, tuple[str, list[int]]]] = [{}]
    size = 0
    for name, (dtype, dims) in tensors(shape).items():
        n = widths[dtype] * _numel(dims)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, dims)
        size += n
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, (dtype, dims) in shard.items():
            n = widths[dtype] * _numel(dims)
            header[name] = {"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder


def _numel(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        raise SystemExit(f"usage: header_only.py SHAPE FOLDER (SHAPE one of {', '.join(SHAPES)})")
    print(write(sys.argv[1], Path(sys.argv[2])))
