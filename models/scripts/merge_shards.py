"""Join a sharded safetensors checkpoint into one ``model.safetensors``.

The GPU machine returns files of at most 16 MiB, so training saves shards; the shipped reference model is one
file, which every engine and converter reads most simply.

Usage::

    python models/scripts/merge_shards.py SHARDED_DIR OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def merge(src: Path, dst: Path) -> None:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "metrics.json"):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)


if __name__ == "__main__":
    merge(Path(sys.argv[1]), Path(sys.argv[2]))
